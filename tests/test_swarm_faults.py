"""Swarm faults with real processes: the bootstrap node dies and returns; 1 MiB packets for many rounds.

Every node here is a tests/swarm_peer.py process (its own DHT process and p2pd), except
where the test process itself is a node.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from swarm_peer import payload, sha
from test_swarm import Peer, alive, base_round, free_port, local_config

from node.swarm import Swarm

MIB = 1 << 20


SENT: dict[tuple[str, int], str] = {}  # (peer id, round) -> sha of what it published


def exchange(nodes: dict[str, Peer], rnd: int, size: int, deadline: float) -> dict[str, set[str]]:
    """Every node publishes, then every node gathers; returns name -> peer ids it got a round-`rnd` packet from.

    A gather also reads the round before (`stale_rounds`): on a busy machine a packet an earlier
    call published may arrive there, late but never wrong."""
    for i, (name, p) in enumerate(nodes.items()):
        answer = p.call(op="publish", round=rnd, seed=rnd * 10 + i, size=size)
        assert answer["ok"], (name, answer)
        SENT[(p.peer_id, rnd)] = answer["sha"]
    for p in nodes.values():
        p.send(op="gather", round=rnd, deadline=deadline, expect=len(nodes) - 1)
    got = {}
    for name, p in nodes.items():
        res = p.read(deadline + 60)
        packets = res["packets"]
        assert all(SENT.get((peer, r)) == digest for peer, r, _, digest in packets), (name, packets)  # never wrong
        got[name] = {peer for peer, r, *_ in packets if r == rnd}
    return got


def until(check, timeout: float, every: float = 0.5):
    """Poll `check()` until it returns something truthy; returns it, or the last value after `timeout`."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > end:
            return value
        time.sleep(every)


def test_the_swarm_survives_its_bootstrap_and_picks_it_back_up(tmp_path):
    port = free_port()
    boot_cfg = local_config(port=port, identity_path=tmp_path / "boot" / "identity.key")
    boot = Peer("boot", boot_cfg, tmp_path)
    boot.ready()
    join = local_config(initial_peers=boot.info["addrs"][:1], rejoin_interval_s=1.0)
    b, c = Peer("B", join, tmp_path), Peer("C", join, tmp_path)
    peers = {"boot": boot, "B": b, "C": c}
    try:
        b.ready()
        c.ready()
        ids = {name: p.peer_id for name, p in peers.items()}
        rnd = base_round() + 300
        got = exchange(peers, rnd, 48 << 10, deadline=15)
        assert got == {n: set(ids.values()) - {ids[n]} for n in peers}

        # The bootstrap dies. The others go on, round after round, with what is left.
        os.kill(boot.proc.pid, signal.SIGKILL)
        boot.proc.wait(timeout=10)
        for k in range(1, 3):
            started = time.monotonic()
            got = exchange({"B": b, "C": c}, rnd + k, 48 << 10, deadline=2)
            assert time.monotonic() - started < 2 + 20  # a gather ends by its deadline; nothing hangs
            assert got == {"B": {ids["C"]}, "C": {ids["B"]}}, k

        # It comes back on the same identity and port, knowing nobody: both find it again.
        boot = peers["boot"] = Peer("boot-again", boot_cfg, tmp_path)
        assert boot.ready()["peer_id"] == ids["boot"]

        def whole_again():
            nonlocal rnd
            rnd += 1
            got = exchange(peers, rnd + 10, 48 << 10, deadline=3)
            return got == {n: set(ids.values()) - {ids[n]} for n in peers}

        assert until(whole_again, timeout=60, every=0.1), "the swarm did not pick its bootstrap back up"
    finally:
        for p in peers.values():
            p.close()


def test_a_node_whose_bootstrap_is_gone_finds_the_swarm_through_a_peer_it_knew(tmp_path):
    """The bootstrap dies for good, and C restarts (same identity and port, joining nobody):
    B's table is empty, and B finds C again as a peer it saw headers from."""
    first = Peer("first", local_config(), tmp_path)
    first.ready()
    join = dict(initial_peers=first.info["addrs"][:1], rejoin_interval_s=1.0)
    c_cfg = local_config(port=free_port(), identity_path=tmp_path / "c" / "identity.key", **join)
    b, c = Peer("B", local_config(**join), tmp_path), Peer("C", c_cfg, tmp_path)
    nodes = [first, b, c]
    try:
        b.ready()
        c.ready()
        rnd = base_round() + 400
        assert exchange({"first": first, "B": b, "C": c}, rnd, 48 << 10, deadline=15)["B"] >= {c.peer_id}
        for p in (first, c):
            os.kill(p.proc.pid, signal.SIGKILL)
            p.proc.wait(timeout=10)
        assert exchange({"B": b}, rnd + 1, 48 << 10, deadline=2) == {"B": set()}  # alone: still answers
        c = Peer("C-again", c_cfg.model_copy(update={"initial_peers": []}), tmp_path)
        nodes.append(c)
        assert c.ready()["peer_id"] == nodes[2].peer_id

        attempt = iter(range(rnd + 10, rnd + 1000))
        got = until(
            lambda: (
                exchange({"B": b, "C": c}, next(attempt), 48 << 10, deadline=3) == {"B": {c.peer_id}, "C": {b.peer_id}}
            ),
            timeout=60,
            every=0.1,
        )
        assert got, "B did not find the swarm again through a peer it knew"
    finally:
        for p in nodes:
            p.close()


def test_one_mib_packets_every_round_for_many_rounds_kill_no_dht_process(tmp_path):
    a = Swarm(local_config(body_keep_rounds=2)).start()
    peers = {n: Peer(n, local_config(initial_peers=a.join_addrs(), body_keep_rounds=2), tmp_path) for n in "BC"}
    try:
        for p in peers.values():
            p.ready()
        trees = {n: p.call(op="descendants")["pids"] for n, p in peers.items()}
        rounds, r0 = 20, base_round() + 500
        for k in range(rounds):
            rnd = r0 + 2 * k
            sent = {}
            for i, (name, p) in enumerate(peers.items()):
                answer = p.call(op="publish", round=rnd, seed=k * 10 + i, size=MIB)
                assert answer["ok"], (k, name)
                sent[p.peer_id] = answer["sha"]
            assert a.publish(rnd, payload(k, MIB))
            res = a.gather(rnd, deadline_s=20, expect_peers=2)
            assert {(p.peer_id, sha(p.data)) for p in res.packets} == set(sent.items()), k
            assert res.rejected == {} and res.errors == {}, k
        assert a.alive
        for name, pids in trees.items():
            assert all(alive(pid) for pid in pids), f"a DHT process or p2pd of {name} died"
            # bodies are kept for body_keep_rounds rounds only: memory stays bounded
            rss = sum(psutil.Process(pid).memory_info().rss for pid in pids)
            assert rss < 1 << 30, (name, rss)
    finally:
        for p in peers.values():
            p.close()
        a.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_training_node_trains_alone_while_its_bootstrap_is_down_and_is_seen_again(tmp_path):
    """A real `ftis-node join` whose only bootstrap dies: its rounds go on (own samples only),
    and once the bootstrap is back on the same identity and port, it gathers the node's packets."""
    import subprocess
    import sys

    import httpx

    from protocol.keys import round_at

    port = free_port()
    boot_cfg = local_config(swarm_id="test", port=port, identity_path=tmp_path / "boot" / "identity.key")
    boot = Peer("boot", boot_cfg, tmp_path)
    boot.ready()
    api = free_port()
    cmd = [sys.executable, "-m", "node.console.cli", "join", "--name", "b", "--model", "tiny-s"]
    cmd += ["--data-dir", str(tmp_path / "b"), "--swarm-id", "test", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--api-port", str(api), "--round-seconds", "4", "--gather-seconds", "1", "--swarm", boot.info["addrs"][0]]
    cmd += ["--prompts-per-round", "2", "--group-size", "2", "--max-tokens", "8"]
    log = open(tmp_path / "b.log", "w")
    node = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})

    def status() -> dict:
        try:
            return httpx.get(f"http://127.0.0.1:{api}/status", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def rounds_done() -> int:
        return status().get("rounds_done") or 0

    try:
        assert until(lambda: rounds_done() >= 1, 240), (tmp_path / "b.log").read_text()[-3000:]
        peer_id = status()["peer_id"]
        os.kill(boot.proc.pid, signal.SIGKILL)
        boot.proc.wait(timeout=10)
        down_at = rounds_done()
        assert until(lambda: rounds_done() >= down_at + 3, 120), "the node stopped training without its bootstrap"
        assert node.poll() is None

        boot = Peer("boot-again", boot_cfg, tmp_path)
        boot.ready()

        def sees_the_node() -> bool:
            rnd = round_at(time.time(), 4)
            res = boot.call(op="gather", round=rnd, deadline=4, stale=1, timeout=60)
            return any(p[0] == peer_id for p in res["packets"])

        assert until(sees_the_node, 90, every=0.1), "the node never reached its bootstrap again"
        assert node.poll() is None and rounds_done() > down_at + 3
    finally:
        node.send_signal(signal.SIGINT)
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.kill()
        boot.close()
    assert node.returncode == 0, (tmp_path / "b.log").read_text()[-3000:]
