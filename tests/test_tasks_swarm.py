"""Two real `ftis-node join` processes on the docs' `py:` task exchange samples: each admits
the other's groups (rebuilt from the ids by its own copy of the task) and trains on them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import free_port, status_of
from tests.test_tasks_custom import docs_example

REPO = Path(__file__).resolve().parents[1]
TASK = "py:my_task:make?limit=20"
ROUNDS = 3


def _spawn(cwd: Path, name: str, swarm: str | None, rounds: int) -> tuple[subprocess.Popen[bytes], str]:
    api_port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "node.console.cli",
        "join",
        "--name",
        name,
        "--data-dir",
        str(cwd / name),
        "--task",
        TASK,
    ]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--api-port", str(api_port), "--threads", "1"]
    cmd += ["--round-seconds", "10", "--rounds", str(rounds), "--prompts-per-round", "2", "--group-size", "4"]
    cmd += ["--max-tokens", "8"] + (["--swarm", swarm] if swarm else [])
    log = open(cwd / f"{name}.log", "w")
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{api_port}"


def _logs(cwd: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in cwd.glob("*.log"))


@pytest.mark.timeout(480)
def test_two_nodes_on_a_py_task_exchange_samples(tmp_path) -> None:
    (tmp_path / "my_task.py").write_text(docs_example("my_task.py"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["a"], url_a = _spawn(tmp_path, "a", None, ROUNDS + 20)  # plays on until b is done
        deadline = time.monotonic() + 180
        while not status_of(url_a).get("join_addrs"):
            assert time.monotonic() < deadline and procs["a"].poll() is None, _logs(tmp_path)
            time.sleep(0.5)
        procs["b"], _ = _spawn(tmp_path, "b", url_a, ROUNDS)
        assert procs["b"].wait(timeout=360) == 0, _logs(tmp_path)
        procs["a"].send_signal(signal.SIGINT)
        assert procs["a"].wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for name in ("a", "b"):
        status = json.loads((tmp_path / name / "status.json").read_text())
        assert status["task"] == TASK and "foreign_task" not in status["rejected"], status["rejected"]
        assert sum(h["peer_samples"] for h in status["history"]) > 0, (name, _logs(tmp_path))
