"""Real `ftis-node join` processes on loopback: a swarm that trains on each other's samples.

Four nodes start (one bootstrap, three joining through its status URL); the fourth is
SIGKILLed after its first round. b and c must finish every round, the bootstrap runs until
a SIGINT stops it cleanly, and each of the three must have trained on samples admitted from
both of the others. Nothing may be left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port as _free_port
from tests.procs import p2pd_pids as _p2pd_pids

ROUNDS = 4


def _spawn(tmp_path: Path, name: str, model: str, swarm: str | None, expect: int, rounds: int | None = ROUNDS):
    api_port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
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


def _status(url: str) -> dict:
    try:
        return httpx.get(url + "/status", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _wait(predicate, timeout: float, what: str, logs: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    tails = {p.name: p.read_text()[-2000:] for p in logs.glob("*.log")}
    raise AssertionError(f"timed out waiting for {what}; logs: {json.dumps(tails, indent=1)}")


@pytest.mark.timeout(420)
def test_four_processes_exchange_and_survive_a_killed_peer(tmp_path):
    from node.models import model_folder, resolve_model

    for model in ("tiny-s", "tiny-m"):
        model_folder(resolve_model(model))  # build once, before the nodes race for it
    p2pd_before = _p2pd_pids()
    # The bootstrap runs until stopped: on a loaded machine the others may take longer to load
    # their models than a fixed number of its rounds lasts.
    boot, boot_url = _spawn(tmp_path, "a", "tiny-m", None, expect=3, rounds=None)
    procs = {"a": boot}
    try:
        _wait(lambda: _status(boot_url).get("join_addrs"), 120, "the bootstrap to join", tmp_path)
        urls = {"a": boot_url}
        for name, model in (("b", "tiny-s"), ("c", "tiny-s"), ("d", "tiny-m")):
            procs[name], urls[name] = _spawn(
                tmp_path, name, model, boot_url, expect=3, rounds=None if name == "d" else ROUNDS
            )
        _wait(lambda: (_status(urls["d"]).get("rounds_done") or 0) >= 1, 180, "d to finish a round", tmp_path)
        procs["d"].send_signal(signal.SIGKILL)  # mid-round: it starts its next one at once
        for name in "bc":
            procs[name].wait(timeout=240)
        boot.send_signal(signal.SIGINT)  # a clean stop: the round in progress ends, a last checkpoint
        boot.wait(timeout=120)
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

    def no_new_p2pd():
        return not (_p2pd_pids() - p2pd_before)

    _wait(no_new_p2pd, 20, "every p2pd to exit (the killed node's included)", tmp_path)


def test_bad_bootstrap_addresses_fail_fast_with_one_clear_line(tmp_path):
    def join(*swarm: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "node.cli",
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
        ]
        for s in swarm:
            cmd += ["--swarm", s]
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env=os.environ | {"HF_HUB_OFFLINE": "1"}
        )

    start = time.monotonic()
    garbage = join("not-an-address")
    assert garbage.returncode == 2 and "--swarm 'not-an-address' is not a multiaddr like" in garbage.stderr
    assert time.monotonic() - start < 30
    start = time.monotonic()
    unreachable = join("/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN")
    assert unreachable.returncode == 2, unreachable.stderr[-2000:]
    assert "error:" in unreachable.stderr and "Traceback" not in unreachable.stderr
    assert time.monotonic() - start < 90
    no_api = join(f"http://127.0.0.1:{_free_port()}")
    assert no_api.returncode == 2 and "could not get join addresses" in no_api.stderr
