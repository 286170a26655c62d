"""The dashboard in a real browser, against real nodes that have played real rounds.

Two `ftis-node join` processes (tiny-s, short rounds) on 127.0.0.1 train on each other's
samples while a third process, a real DHT peer, publishes a signed packet per round whose
task id and model name are HTML markup. Headless Chromium (Debian's `chromium` and
`chromium-driver`, installed here with apt-get when missing) driven by selenium then
checks the bootstrap's page: one chart point per finished round, the peer in the peers
table, the markup shown as text (no element, no script), and a layout that fits a phone.
It saves a screenshot in the test folder, or where FTIS_DASHBOARD_PNG says (docs/usage.md's
docs/dashboard.png is made with FTIS_DASHBOARD_PNG=docs/dashboard.png).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.bad_peer import MARKUP, MODEL, NAME
from tests.procs import free_port as _free_port
from tests.procs import status_of

REPO = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ROUND_SECONDS, GATHER_SECONDS = 5, 2.5
# The flags these machines need: no sandbox (root), no GPU, and no traffic of its own.
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def _p2pd_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "p2pd":
                pids.add(int(entry.name))
        except OSError:
            pass
    return pids


def _history(url: str) -> list[dict]:
    return httpx.get(url + "/history", timeout=5).json()


def _wait(predicate, timeout: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    tails = {p.name: p.read_text()[-2000:] for p in logs.glob("*.log")}
    raise AssertionError(f"timed out waiting for {what}; logs: {json.dumps(tails, indent=1)}")


def ensure_chromium() -> None:
    """Install Debian's chromium and chromium-driver once (as root), unless they are there."""
    if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
        return
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.skip("chromium is not installed and apt-get is not available to install it")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    with open("/tmp/ftis-node-chromium-install.lock", "w") as lock:  # one installer at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
            return
        for cmd in (
            [*sudo, apt, "-o", "DPkg::Lock::Timeout=300", "update", "-q"],
            [*sudo, apt, "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-q", "chromium", "chromium-driver"],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if done.returncode != 0:
                pytest.fail(f"{' '.join(cmd)} failed (exit {done.returncode}): {done.stderr[-1500:]}")


def _join(tmp_path: Path, name: str, swarm: str | None):
    api_port = _free_port()
    cmd = [sys.executable, "-m", "node.console.cli", "join", "--name", name, "--model", "tiny-s"]
    cmd += ["--data-dir", str(tmp_path / name), "--swarm-id", "dash", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--api-port", str(api_port), "--round-seconds", str(ROUND_SECONDS), "--gather-seconds", str(GATHER_SECONDS)]
    cmd += ["--expect-peers", "2", "--prompts-per-round", "2", "--group-size", "4", "--max-tokens", "8"]
    cmd += ["--threads", "1", "--seed", str(ord(name[0]))]  # other prompts on each node
    if swarm:
        cmd += ["--swarm", swarm]
    log = open(tmp_path / f"{name}.log", "w")
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{api_port}"


def _bad_peer(tmp_path: Path, bootstrap: str):
    config = {"swarm_id": "dash", "host": "127.0.0.1", "port": 0, "initial_peers": [bootstrap]}
    config["round_seconds"] = ROUND_SECONDS
    log = open(tmp_path / "bad.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "bad_peer.py"), json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    ready = json.loads(proc.stdout.readline() or '{"event": "no answer"}')
    assert ready["event"] == "ready", ready
    return proc, ready["peer_id"]


def _browser(tmp_path: Path, width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROME_FLAGS, f"--user-data-dir={tmp_path / f'chrome-{width}'}", f"--window-size={width},{height}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.mark.timeout(600)
def test_dashboard_in_chromium_after_real_rounds_with_a_peer(tmp_path):
    ensure_chromium()
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    from node.models import model_folder, resolve_model

    model_folder(resolve_model("tiny-s"))  # build once, before the nodes race for it
    p2pd_before = _p2pd_pids()
    procs: dict[str, subprocess.Popen] = {}
    driver = None
    try:
        procs["a"], a_url = _join(tmp_path, "a", None)
        _wait(lambda: status_of(a_url).get("join_addrs"), 180, "the bootstrap to start", tmp_path)
        a = status_of(a_url)
        procs["b"], b_url = _join(tmp_path, "b", a_url)
        procs["bad"], bad_id = _bad_peer(tmp_path, a["join_addrs"][-1])
        _wait(lambda: status_of(b_url).get("peer_id"), 180, "b to join", tmp_path)
        b_id = status_of(b_url)["peer_id"]

        def trained_with_b_and_rejected_bad() -> bool:
            s = status_of(a_url)
            used = (s.get("peers") or {}).get(b_id, {}).get("samples_used", 0)
            rounds_with_b = sum(1 for r in _history(a_url) if (r.get("peers") or {}).get(b_id, {}).get("used"))
            return used > 0 and rounds_with_b >= 3 and "foreign_task" in s.get("rejected", {})

        _wait(
            trained_with_b_and_rejected_bad, 300, "a to train on b's samples 3 times and reject the bad peer", tmp_path
        )

        driver = _browser(tmp_path, 1400, 1000)
        driver.get(a_url + "/")

        # The page redraws its tables and charts every poll: read an element's text in the same
        # script that finds it, or it may be replaced in between (a stale element).
        def text_of(css: str) -> str:
            got = driver.execute_script("const e = document.querySelector(arguments[0]); return e && e.innerText", css)
            assert got is not None, f"nothing on the page matches {css}"
            return got

        def texts(css: str) -> list[str]:
            return driver.execute_script(
                "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)", css
            )

        def points(series: str, chart: str = "chart-reward") -> int:
            return len(driver.find_elements(By.CSS_SELECTOR, f'#{chart} g[data-series="{series}"] circle'))

        def charts_match_history() -> tuple[int, int, int, int, int, int] | None:
            """The charts' points against one read of /history: (own, rounds, b's points, rounds with b,
            b's IS points, rounds that trained on b), or None while the page has not caught up."""
            history = _history(a_url)
            with_b = [(r.get("peers") or {}).get(b_id) or {} for r in history]
            rounds_with_b = sum(1 for p in with_b if p.get("reward_mean") is not None)
            rounds_b_trained = sum(1 for p in with_b if (p.get("offpolicy") or {}).get("is_weight_mean") is not None)
            got = (points("own"), len(history), points(b_id), rounds_with_b, points(b_id, "chart-is"), rounds_b_trained)
            if len(_history(a_url)) != len(history):  # a round ended while we counted: read again
                return None
            return got if got[0] == got[1] and got[2] == got[3] and got[4] == got[5] else None

        # The page polls every 2 s and a round takes 5 s or more: it catches up between rounds (on a
        # busy machine it may take a few rounds to meet one, hence waiting rather than one look).
        _wait(
            lambda: (lambda m: m is not None and m[1] >= 3 and m[2] >= 2 and m[5] >= 1)(charts_match_history()),
            120,
            "one point per round, and per round with b, on the charts",
            tmp_path,
        )

        # The reward axis fits the data (0 to just above the highest reward), 0-1 at a click and back.
        def reward_ticks() -> list[float]:
            return [float(t) for t in texts('#chart-reward svg text.tick[text-anchor="end"]')]

        history = _history(a_url)[: points("own")]  # the rounds the chart has drawn (another may have ended)
        rewards = [r["reward_mean"] for r in history if r.get("reward_mean") is not None]
        rewards += [
            p["reward_mean"]
            for r in history
            for p in (r.get("peers") or {}).values()
            if p.get("reward_mean") is not None
        ]
        fitted = reward_ticks()
        assert min(fitted) == 0 and max(fitted) >= max(rewards) - 1e-9, (fitted, max(rewards))
        if max(rewards) <= 0.5 and points("own") == len(history):  # no higher reward drawn since
            assert max(fitted) < 1, fitted
        driver.find_element(By.ID, "reward-scale").click()  # the button is static: never redrawn
        assert (min(reward_ticks()), max(reward_ticks())) == (0, 1) and text_of("#reward-scale") == "fit to data"
        driver.find_element(By.ID, "reward-scale").click()
        assert text_of("#reward-scale") == "0–1 view" and max(reward_ticks()) >= max(rewards) - 1e-9

        # Trust is on the first screen: a tile counting the peers in each state, as /status has them.
        def trust_tile() -> tuple[str, str, int]:
            value, y = driver.execute_script(
                "const t = [...document.querySelectorAll('#tiles .tile')].find("
                "x => x.querySelector('.label').textContent.toLowerCase() === 'peers trusted');"
                "return [t.querySelector('.value').textContent, t.getBoundingClientRect().top + window.scrollY]"
            )
            return value, "", y

        def trust_tile_matches() -> bool:
            peers = status_of(a_url)["peers"]
            want = sum(1 for p in peers.values() if p.get("trust") == "trusted")
            return trust_tile()[0] == str(want) and any(p.get("trust") for p in peers.values())

        _wait(trust_tile_matches, 30, "the trust tile to match /status", tmp_path)
        assert trust_tile()[2] < 700, "the trust tile is below the first screen"

        for chart in ("chart-admitted", "chart-used", "chart-is", "chart-capped", "chart-ess", "chart-filtered"):
            assert driver.find_elements(By.CSS_SELECTOR, f"#{chart} svg .tick"), f"{chart} has no axis ticks"

        # The phase pill and the progress line say where the round is.
        def phase_and_progress_agree() -> bool:  # both read at once: the phase moves on between two reads
            phase, text = driver.execute_script(
                "const t = id => document.getElementById(id).textContent; return [t('phase'), t('progress-text')]"
            )
            return bool(phase.strip()) and phase.split()[0] in text

        _wait(phase_and_progress_agree, 20, "the phase pill and the progress line to agree", tmp_path)
        assert driver.find_elements(By.CSS_SELECTOR, f'#chart-used g[data-series="{b_id}"] rect')
        legend = text_of("#chart-reward .legend")
        assert "own (tiny-s)" in legend and b_id[-6:] in legend

        # Rounds are counted from the start of the run; the DHT bucket is in the tooltip.
        round_label = driver.find_element(By.ID, "round")  # static: its text changes, not the element
        assert text_of("#round").startswith("round ") and text_of("#round").endswith(" of this run")
        assert "DHT time bucket" in round_label.get_attribute("title")

        b_row = text_of(f'#peers-table tr[data-peer="{b_id}"]')
        assert "tiny-s" in b_row and b_row.strip().startswith(f"b …{b_id[-6:]}"), b_row  # its --name, then its id
        legend = texts("#chart-reward .legend-item")
        assert any(t.startswith("b …") for t in legend), legend
        assert driver.find_elements(By.CSS_SELECTOR, f'#swarm-table tr[data-peer="{b_id}"]')
        # The swarm view lists the bad peer too, a peer a never trained on, with its model as text.
        assert bad_id in {p["peer_id"] for p in httpx.get(a_url + "/swarm", timeout=5).json()["peers"]}
        assert MODEL in text_of(f'#swarm-table tr[data-peer="{bad_id}"]')

        # The bad peer's markup is on the page as text, and nowhere as an element.
        assert MARKUP in text_of('#rejections tr[data-reason="foreign_task"] td.detail')
        bad_row = text_of(f'#peers-table tr[data-peer="{bad_id}"]')
        assert MODEL in bad_row and NAME in bad_row and "foreign_task" in bad_row
        assert driver.find_elements(By.TAG_NAME, "img") == [] and driver.find_elements(By.CSS_SELECTOR, "main b") == []
        assert driver.find_elements(By.CSS_SELECTOR, "main i") == []
        with pytest.raises(NoAlertPresentException):
            driver.switch_to.alert.text  # noqa: B018
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors

        # /metrics of the same node agrees with what the page drew.
        for _ in range(10):  # read between two rounds, so both answers describe the same one
            before = status_of(a_url)
            metrics = httpx.get(a_url + "/metrics", timeout=5).text
            if status_of(a_url)["rounds_done"] == before["rounds_done"]:
                break
        used_line = f'ftis_peer_samples_used_total{{peer="{b_id}"}} '
        scraped = [line for line in metrics.splitlines() if line.startswith(used_line)]
        assert scraped and float(scraped[0].split()[-1]) == before["peers"][b_id]["samples_used"] > 0
        assert f'ftis_rejected_total{{peer="{bad_id}",reason="foreign_task"}}' in metrics

        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1400, min(height + 40, 4000))
        time.sleep(1)  # charts redraw for the new size
        screenshot = Path(os.environ.get("FTIS_DASHBOARD_PNG") or tmp_path / "dashboard.png")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(screenshot.resolve()))

        # No dead space: no panel is more than a line taller than what it holds (a short panel
        # beside a tall one used to stretch to it, leaving an empty block under its chart).
        gaps = driver.execute_script(
            "return [...document.querySelectorAll('main .panel')].map(p => {"
            "  const kids = [...p.children].filter(k => k.offsetParent !== null);"
            "  const bottom = Math.max(...kids.map(k => k.getBoundingClientRect().bottom));"
            "  return [p.querySelector('h2').textContent, p.getBoundingClientRect().bottom - bottom]; })"
        )
        assert all(gap <= 40 for _, gap in gaps), gaps

        # Phone width: everything fits the width (wide tables scroll inside their panel).
        driver.set_window_size(400, 900)
        time.sleep(1)
        overflow = driver.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the page is {overflow} px wider than a phone screen"
        assert driver.find_element(By.CSS_SELECTOR, "#chart-reward svg").size["width"] <= 400
        driver.save_screenshot(str(tmp_path / "dashboard-phone.png"))
    finally:
        if driver is not None:
            driver.quit()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    _wait(lambda: not (_p2pd_pids() - p2pd_before), 30, "every p2pd to exit", tmp_path)


@pytest.mark.timeout(180)
def test_the_nodes_warnings_show_on_the_page_as_text(tmp_path):
    """A round's notices (no learning signal, an overrun bucket) are on the page, escaped."""
    ensure_chromium()
    from selenium.webdriver.common.by import By

    from node.serving.api import ApiServer
    from node.serving.status import NodeStatus
    from tests.observed import fill_status

    status = fill_status(NodeStatus(name="n1", model="tiny-s", task="toy", loss="f-tis"), rounds=2)
    notices = ["no learning signal: all rewards equal (every sample in every group scored 0)", f"odd {MARKUP}"]
    status.set(notices=notices)
    server = ApiServer(status, host="127.0.0.1", port=0).start()
    driver = _browser(tmp_path, 1280, 800)
    try:
        driver.get(server.url + "/")
        _wait(lambda: driver.find_element(By.ID, "notices").is_displayed(), 20, "the notices", tmp_path)
        shown = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#notices .notice")]
        assert shown == notices and driver.find_elements(By.TAG_NAME, "img") == []
        status.set(notices=[])  # the next round had nothing to say: the box goes away
        _wait(lambda: not driver.find_element(By.ID, "notices").is_displayed(), 20, "the notices to clear", tmp_path)
        # Bad --reward values stay on the page for the run, not only in the round that had them.
        status.set(reward_faults={"failed": 3, "clamped": 1, "last": f"my:f raised {MARKUP}"})

        def fault_line() -> list[str]:
            # Read in the script that finds them: the page replaces the box every poll.
            return driver.execute_script(
                "return [...document.querySelectorAll('#notices .notice')].map(e => e.textContent)"
            )

        _wait(lambda: fault_line() != [], 20, "the reward faults", tmp_path)
        assert fault_line() == [f"reward faults: failed 3, clamped 1 (last: my:f raised {MARKUP})"]
        assert driver.find_elements(By.TAG_NAME, "img") == []
    finally:
        driver.quit()
        server.stop()
