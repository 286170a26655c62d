"""Two real `ftis-node join` processes on the default model and settings draw their own
prompts and samples (the seed comes from each node's identity, not a default shared by
all). A third DHT peer in the test process reads both nodes' packets off the swarm, as
any member would, and compares them: the prompts of a round differ, and at most 1 % of
completions (prompt and token ids) are the same on both nodes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import free_port, status_of

ROUNDS = 3
ROUND_SECONDS = 10  # the default 30 s would only make the test slower


def _spawn(tmp_path: Path, name: str, swarm: str | None, rounds: int) -> tuple[subprocess.Popen, str]:
    api_port = free_port()
    cmd = [sys.executable, "-m", "node.console.cli", "join", "--name", name, "--data-dir", str(tmp_path / name)]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--api-port", str(api_port), "--threads", "1"]
    cmd += ["--round-seconds", str(ROUND_SECONDS), "--rounds", str(rounds)]
    if swarm:
        cmd += ["--swarm", swarm]
    log = open(tmp_path / f"{name}.log", "w")
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{api_port}"


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in tmp_path.glob("*.log"))


@pytest.mark.timeout(420)
def test_two_default_nodes_draw_different_prompts_and_completions(tmp_path):
    from node.config import NodeConfig
    from node.models import model_folder, resolve_model
    from node.swarm import Swarm, SwarmConfig
    from protocol.codec import decode
    from protocol.keys import round_at

    model_folder(resolve_model(NodeConfig.model_fields["model"].default))  # built once, before the nodes race
    procs: dict[str, subprocess.Popen] = {}
    observer = None
    packets: dict[tuple[str, int], object] = {}  # (peer id, round) -> packet
    try:
        # a plays on until b has played its rounds, so the two share buckets (the same round
        # numbers: with one seed, the same prompts).
        procs["a"], url_a = _spawn(tmp_path, "a", None, ROUNDS + 20)
        deadline = time.monotonic() + 120
        while not (addrs := status_of(url_a).get("join_addrs")):
            assert time.monotonic() < deadline and procs["a"].poll() is None, _logs(tmp_path)
            time.sleep(0.5)
        procs["b"], _ = _spawn(tmp_path, "b", url_a, ROUNDS)
        observer = Swarm(
            SwarmConfig(
                swarm_id=NodeConfig.model_fields["swarm_id"].default,
                host="127.0.0.1",
                port=0,
                initial_peers=addrs,
                round_seconds=ROUND_SECONDS,
            )
        ).start()
        deadline = time.monotonic() + 300
        while procs["b"].poll() is None:
            assert time.monotonic() < deadline and procs["a"].poll() is None, _logs(tmp_path)
            now = round_at(observer.dht_time(), ROUND_SECONDS)
            for item in observer.gather(now, deadline_s=2.0, stale_rounds=2).packets:
                packets[(item.peer_id, item.round)] = decode(item.data)
        procs["a"].send_signal(signal.SIGINT)  # a clean stop after its current phase
        for p in procs.values():
            assert p.wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        if observer is not None:
            observer.shutdown()
        for p in procs.values():
            if p.poll() is None:
                p.kill()

    senders = sorted({peer for peer, _ in packets})
    assert len(senders) == 2, (senders, _logs(tmp_path))
    by_round = {s: {r: pk for (p, r), pk in packets.items() if p == s} for s in senders}
    assert all(len(rounds) >= ROUNDS for rounds in by_round.values()), {s: sorted(v) for s, v in by_round.items()}

    def completions(sender: str) -> list[tuple]:
        return [
            (g.task_id, tuple(int(t) for t in c.token_ids))
            for pk in by_round[sender].values()
            for g in pk.groups
            for c in g.completions
        ]

    a, b = (completions(s) for s in senders)
    identical = sum(1 for c in b if c in set(a)) / len(b)
    assert identical <= 0.01, identical
    shared_rounds = set(by_round[senders[0]]) & set(by_round[senders[1]])
    assert shared_rounds
    for r in shared_rounds:
        prompts = [[g.task_id for g in by_round[s][r].groups] for s in senders]
        assert prompts[0] != prompts[1], (r, prompts)
