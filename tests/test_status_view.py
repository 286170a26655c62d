"""`ftis-node status URL`: the terminal view of a running node, and one clear error when there is none."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from node.console.status_view import normalize_url, safe, sparkline
from node.serving.api import ApiServer
from node.serving.status import NodeStatus
from tests.observed import PEER_L, PEER_M, fill_status

ENV = os.environ | {"COLUMNS": "200", "NO_COLOR": "1"}


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.console.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


@pytest.fixture()
def served():
    status = fill_status(NodeStatus(name="n1", model="tiny-s", task="toy", loss="f-tis"), rounds=3)
    # A peer's detail that would style, or clear, a terminal if printed as markup or raw.
    status.reject(PEER_M, "bad_task_id", "task id '[bold red]boom[/]' \x1b[2J\x07 is not a number")
    status.set(notices=["no learning signal: all rewards equal (every sample in every group scored 0)"])
    server = ApiServer(status, host="127.0.0.1", port=0).start()
    yield status, server
    server.stop()


def test_status_shows_round_phase_reward_peers_and_rejections(served):
    _, server = served
    out = cli(server.url.removeprefix("http://"))  # host:port works as well as the URL
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "ftis-node · n1" in text and "generating" in text
    assert "round 4 of this run (DHT bucket 1003)" in text
    assert "0.300" in text  # the last round's own reward
    assert "warning: no learning signal: all rewards equal" in text
    assert "medium-node …" + PEER_M[-6:] in text  # a peer's --name beside its id suffix
    for pid in (PEER_M, PEER_L):
        assert "…" + pid[-6:] in text
    assert "tiny-m" in text and "tiny-l" in text
    assert "foreign_task" in text and "<img src=x onerror=alert(1)>" in text
    assert "[bold red]boom[/]" in text  # printed as it came, not as style
    assert "\x1b" not in text and "\x07" not in text


def test_status_json_is_the_status_answer(served):
    status, server = served
    out = cli(server.url + "/status", "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["rounds_done"] == 3 and answer["name"] == "n1" and set(answer["peers"]) >= {PEER_M, PEER_L}


def test_unreachable_node_exits_2_with_one_error_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    out = cli(f"http://127.0.0.1:{port}", "--timeout", "2")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach"), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert time.monotonic() - start < 30  # a process start and a refused connection, nothing more


def test_a_url_that_is_not_a_node_is_named_as_such(served):
    _, server = served
    out = cli(server.url + "/nothing-here")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error:") and "HTTP 404" in out.stderr and len(out.stderr.splitlines()) == 1


def test_watch_keeps_going_when_the_node_goes_away_and_stops_on_ctrl_c(served):
    status, server = served
    answered = threading.Semaphore(0)  # one release per /status answer: the watcher's draws
    snapshot = status.snapshot

    def counted():
        answered.release()
        return snapshot()

    status.snapshot = counted
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.console.cli",
            "status",
            server.url,
            "--watch",
            "--interval",
            "0.3",
            "--timeout",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        # Three draws (events, not a guess at start-up time: a loaded machine imports slowly).
        for _ in range(3):
            assert answered.acquire(timeout=120), proc.stderr.read() if proc.poll() is not None else "no draw"
        assert proc.poll() is None, proc.stderr.read()
        server.stop()
        time.sleep(3)
        assert proc.poll() is None  # still watching, showing the node as unreachable
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "ftis-node · n1" in out and "unreachable" in out


def test_helpers():
    assert normalize_url("localhost:8470/") == "http://localhost:8470"
    assert normalize_url("http://h:1/status") == "http://h:1"
    assert safe("a\x1b[2Jb\u202e") == "a?[2Jb?" and len(safe("x" * 500)) == 120
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█" and sparkline([]) == ""


def test_fields_other_parts_add_are_shown_when_present():
    """Trust, quarantine and screening (the screening stage's PeerStats fields), phase detail, round_in_run."""
    from rich.console import Console

    from node.console.status_view import render

    status = fill_status(NodeStatus(name="n1", model="tiny-s", task="toy", loss="f-tis"), rounds=2).snapshot()
    status["peers"][PEER_L] |= {
        "trust": "quarantined",
        "trust_reason": "too many implausible samples",
        "quarantined_until": 1234,
        "screened": {"implausible": 7},
    }
    status |= {
        "round_in_run": 3,
        "phase": "gathering",
        "phase_detail": {"peers": 1, "deadline": status["server_time"] + 2},
    }
    console = Console(record=True, width=220, color_system=None)
    console.print(render({"url": "http://x", "status": status, "history": [], "swarm": {}}, width=220))
    text = console.export_text()
    assert "round 3 of this run" in text and "gathering: 1 peer answered, " in text
    assert "quarantined until round 1234" in text and "screened implausible×7" in text


def test_status_of_a_data_dir_whose_node_was_killed_says_stopped(tmp_path):
    """`ftis-node status DATA_DIR` reads the node's status.json; a killed node is "stopped",
    not the phase it was in when the file was last written."""
    status = fill_status(NodeStatus(name="k", model="tiny-s", task="toy", loss="f-tis"), rounds=3)
    status.set_phase("loading weights", 1002)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    data = json.loads(status.file_text()) | {"pid": gone.pid}  # as if that process had written it
    (tmp_path / "status.json").write_text(json.dumps(data))
    out = cli(str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert " stopped " in out.stdout and "not running: process" in out.stdout
    assert "it was loading weights when it stopped" in out.stdout and "ftis-node · k" in out.stdout
    as_json = json.loads(cli(str(tmp_path), "--json").stdout)
    assert as_json["phase"] == "stopped" and as_json["running"] is False
    missing = cli(str(tmp_path / "nothing" / "status.json"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


@pytest.mark.parametrize("width", [80, 100, 120, 140, 160, 200])
def test_status_lays_out_from_80_to_200_columns_without_cutting_a_header(width):
    from rich.console import Console

    from node.console.status_view import PEER_COLUMNS, render

    status = fill_status(NodeStatus(name="n1", model="tiny-s", task="toy", loss="f-tis"), rounds=3).snapshot()
    status["peers"][PEER_L] |= {"trust": "quarantined", "quarantined_until": 1234, "screened": {"implausible": 7}}
    swarm = {"source": "dht", "peers": [{"peer_id": PEER_M, "model": "tiny-m", "round": 1002, "size": 2048}]}
    console = Console(record=True, width=width, color_system=None)
    console.print(render({"url": "http://x", "status": status, "history": [], "swarm": swarm}, width=width))
    lines = console.export_text().splitlines()
    assert all(len(line.rstrip()) <= width for line in lines)
    header = next(line for line in lines if line.split()[:2] == ["peer", "model"] and "admitted" in line)
    shown = [name for name, _ in PEER_COLUMNS if f" {name} " in f" {header} "]
    assert "…" not in header and {"peer", "model", "trust", "admitted", "rejected / screened"} <= set(shown)
    # what is left out at this width is a whole column, never part of a header
    assert " ".join(shown) == " ".join(header.split()), header
    swarm_header = next(line for line in lines if line.lstrip("┃│ ").startswith("peer") and "packet" in line)
    assert "…" not in swarm_header and "last seen" in swarm_header
    if width >= 200:
        assert len(shown) == len(PEER_COLUMNS)
