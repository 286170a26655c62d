"""Real `ftis-node join` processes on loopback: a swarm that trains on each other's samples.

Four nodes start: three joining through the status URL of a bootstrap started after them
(they wait for it), then the bootstrap. The fourth is SIGKILLed after its first round. b and
c must finish every round, the bootstrap runs until a SIGINT stops it cleanly, and each of
the three must have trained on samples admitted from both of the others. Nothing may be
left running, the killed node's p2pd included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import describe, status_of
from tests.procs import free_port as _free_port
from tests.procs import p2pd_pids as _p2pd_pids

ROUNDS = 4


def _spawn(
    tmp_path: Path,
    name: str,
    model: str,
    swarm: str | None,
    expect: int,
    rounds: int | None = ROUNDS,
    api_port: int | None = None,
):
    api_port = api_port or _free_port()
    cmd = [
        sys.executable,
        "-m",
        "node.console.cli",
        "join",
        "--name",
        name,
        "--model",
        model,
        "--data-dir",
        str(tmp_path / name),
        "--swarm-id",
        "test",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--api-port",
        str(api_port),
        "--round-seconds",
        "8",
        "--gather-seconds",
        "5",
        "--expect-peers",
        str(expect),
        "--prompts-per-round",
        "4",
        "--group-size",
        "4",
        "--max-tokens",
        "12",
    ]
    if rounds is not None:
        cmd += ["--rounds", str(rounds)]
    if swarm:
        cmd += ["--swarm", swarm]
    log = open(tmp_path / f"{name}.log", "w")
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{api_port}"


def _tails(logs: Path) -> str:
    return json.dumps({p.name: p.read_text()[-2000:] for p in logs.glob("*.log")}, indent=1)


def _wait(predicate, timeout: float, what: str, logs: Path, alive: dict | None = None):
    """Poll `predicate` until true. Fails at once, with the logs, if a process in `alive` exits
    (the event it waits for can no longer come); the bound is for a hang, set for a loaded machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for name, proc in (alive or {}).items():
            if proc.poll() is not None:
                raise AssertionError(
                    f"{name} exited ({proc.returncode}) while waiting for {what}; logs: {_tails(logs)}"
                )
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; logs: {_tails(logs)}")


def _exit(proc: subprocess.Popen, timeout: float, name: str, logs: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} did not exit within {timeout} s; logs: {_tails(logs)}") from None


# Under load (2 cores at 100 % from other work) each node loads for a minute or more; every
# wait below ends on an event (a status field, an exit) and its bound only catches a hang.
@pytest.mark.timeout(900)
def test_four_processes_exchange_and_survive_a_killed_peer(tmp_path):
    from node.models import model_folder, resolve_model

    for model in ("tiny-s", "tiny-m"):
        model_folder(resolve_model(model))  # build once, before the nodes race for it
    # The joiners start first, pointed at a status URL where nothing listens yet: they must wait
    # for the bootstrap (--swarm-wait), not give up. The bootstrap runs until stopped: on a loaded
    # machine the others may take longer to load their models than a fixed number of its rounds lasts.
    boot_port = _free_port()
    boot_url = f"http://127.0.0.1:{boot_port}"
    procs, urls = {}, {}
    try:
        for name, model in (("b", "tiny-s"), ("c", "tiny-s"), ("d", "tiny-m")):
            procs[name], urls[name] = _spawn(
                tmp_path, name, model, boot_url, expect=3, rounds=None if name == "d" else ROUNDS
            )
        boot, _ = _spawn(tmp_path, "a", "tiny-m", None, expect=3, rounds=None, api_port=boot_port)
        procs["a"], urls["a"] = boot, boot_url
        _wait(lambda: status_of(boot_url).get("join_addrs"), 300, "the bootstrap to join", tmp_path, procs)
        must_run = {"a": boot, "d": procs["d"]}
        _wait(lambda: (status_of(urls["d"]).get("rounds_done") or 0) >= 1, 300, "d's first round", tmp_path, must_run)
        procs["d"].send_signal(signal.SIGKILL)  # mid-round: it starts its next one at once
        procs["d"].wait(timeout=30)
        for name in "bc":
            _exit(procs[name], 400, name, tmp_path)
        boot.send_signal(signal.SIGINT)  # a clean stop: the round in progress ends, a last checkpoint
        _exit(boot, 180, "a", tmp_path)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name in "abc":
        assert procs[name].returncode == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    status = {n: json.loads((tmp_path / n / "status.json").read_text()) for n in "abc"}
    peer_ids = {n: s["peer_id"] for n, s in status.items()}
    for name, s in status.items():
        assert s["rounds_done"] >= ROUNDS if name == "a" else s["rounds_done"] == ROUNDS, s["rounds_done"]
        assert s["phase"] == "stopped"
        for other in "abc":
            if other == name:
                continue
            peer = s["peers"].get(peer_ids[other])
            assert peer is not None, f"{name} never heard from {other}: {list(s['peers'])}"
            assert peer["samples_admitted"] > 0 and peer["samples_used"] > 0, (name, other, peer)
            assert peer["offpolicy"], (name, other, peer)
        assert sum(r["peer_samples"] for r in s["history"]) > 0

    # Only this test's daemons (their identity files are under tmp_path): other tests' may run.
    left = _p2pd_pids(tmp_path)
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _p2pd_pids(tmp_path)
    assert not left, f"p2pd outlived its node (the killed one's included):\n{describe(left)}\n{_tails(tmp_path)}"


def test_bad_bootstrap_addresses_fail_fast_with_one_clear_line(tmp_path):
    def join(*swarm: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "node.console.cli",
            "join",
            "--model",
            "tiny-s",
            "--data-dir",
            str(tmp_path / "x"),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--api-port",
            "0",
            "--startup-timeout",
            "15",
            "--swarm-wait",  # the default (120 s) is for a peer that is still starting
            "15",
        ]
        for s in swarm:
            cmd += ["--swarm", s]
        # The bound only catches a hang: a loaded machine takes tens of seconds to import.
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env=os.environ | {"HF_HUB_OFFLINE": "1"}
        )

    # Fast means before anything slow: no model prepared, no DHT started, no identity made.
    garbage = join("not-an-address")
    assert garbage.returncode == 2 and "--swarm 'not-an-address' is not a multiaddr like" in garbage.stderr
    assert "preparing" not in garbage.stdout and not (tmp_path / "x" / "identity.key").exists()
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    unreachable = join(dead)
    assert unreachable.returncode == 2, unreachable.stderr[-2000:]
    assert "error:" in unreachable.stderr and "Traceback" not in unreachable.stderr
    # It retried for --swarm-wait, saying what it waits for (the swarm is joined before the model loads).
    assert f"waiting for the bootstrap peer(s) {dead} to answer" in unreachable.stderr
    assert "could not reach any bootstrap peer" in unreachable.stderr
    no_api = join(f"http://127.0.0.1:{_free_port()}")
    assert no_api.returncode == 2 and "could not get join addresses" in no_api.stderr
    # While it waits it says what for, before it gives up.
    assert "waiting for http://127.0.0.1:" in no_api.stderr and "nothing listens there yet" in no_api.stderr


def _running(pid: int) -> bool:
    """Exists and is not a zombie (an exited child PID 1 has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.timeout(300)
def test_a_p2pd_that_cannot_act_still_dies_with_its_node(tmp_path):
    """The kernel ends p2pd when its node dies, not p2pd's own shutdown: a p2pd that cannot
    run at all (stopped, as a starved one on a loaded machine nearly is) is gone as soon as
    its node (and so the node's DHT process) is SIGKILLed."""
    from node.swarm import SwarmConfig

    config = SwarmConfig(swarm_id="orphans", host="127.0.0.1", port=0)
    helper = Path(__file__).with_name("swarm_peer.py")
    with (tmp_path / "peer.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(helper), config.model_dump_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    p2pd: list[int] = []
    try:
        assert json.loads(proc.stdout.readline())["event"] == "ready", (tmp_path / "peer.log").read_text()
        proc.stdin.write(json.dumps({"op": "descendants"}) + "\n")
        proc.stdin.flush()
        tree = json.loads(proc.stdout.readline())
        p2pd = [pid for pid, name in zip(tree["pids"], tree["names"]) if name == "p2pd"]
        assert len(p2pd) == 1, tree
        os.kill(p2pd[0], signal.SIGSTOP)  # it can no longer notice anything, nor shut down
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _running(p2pd[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(p2pd[0]), f"p2pd outlived its node:\n{describe(set(p2pd))}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in p2pd:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
