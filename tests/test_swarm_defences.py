"""Gather-level defences against Sybils that announce big, slow bodies, over real DHTs.

Node A (the receiver) runs in the test process; B (honest) and X (the attacker, hosting
Sybil nodes, each a real Swarm with its own key, DHT process and p2pd, whose body servers
accept a request and never answer) are separate processes. The default run uses 6 Sybils
whose announced bodies alone exceed A's byte budget; the slow run adds the issue's 16.
"""

from __future__ import annotations

import hashlib

import pytest
from swarm_peer import payload, sha
from test_swarm import LARGE, SMALL, Peer, base_round, local_config

from node.swarm import RejectReason, Swarm

MIB = 1 << 20


@pytest.fixture(scope="module")
def sybil_net(tmp_path_factory):
    logs = tmp_path_factory.mktemp("sybils")
    # This node accepts packets up to 16 MiB and holds 64 MiB per gather: 4 Sybil bodies fill it.
    a = Swarm(local_config(max_packet_bytes=16 * MIB, max_total_bytes=64 * MIB)).start()
    b = Peer("B", local_config(initial_peers=a.join_addrs()), logs)
    x = Peer("X", local_config(initial_peers=a.join_addrs()), logs)
    try:
        b.ready()
        x.ready()
        sybils = x.call(op="sybils", count=6, timeout=300)["peer_ids"]
        assert len(set(sybils)) == 6
        yield a, b, x, sybils
    finally:
        b.close()
        x.close()
        a.shutdown()


def fetch_order(receiver: str, rnd: int, peer: str) -> bytes:
    """The tie-break a receiver gives a peer among same-sized candidates (see gather.GatherRun._judge)."""
    return hashlib.sha256(f"{receiver}/{rnd}/{peer}".encode()).digest()


def check_sybils_do_not_starve_the_honest_peer(a: Swarm, b: Peer, x: Peer, sybils: list[str], rnd: int) -> None:
    assert x.call(op="sybil_publish", round=rnd, size=16 * MIB)["ok"]  # 16 MiB each, more than the budget
    assert b.call(op="publish", round=rnd, seed=71, size=SMALL)["ok"]
    res = a.gather(rnd, deadline_s=30, expect_peers=1)  # returns once B is in; 30 s for a busy machine
    assert [(p.peer_id, sha(p.data)) for p in res.packets] == [(b.peer_id, sha(payload(71, SMALL)))]
    assert b.peer_id not in res.rejected_by_peer
    # No Sybil delivered anything; those it tried hold a slot each, never more than k at once.
    assert set(res.rejected_by_peer) <= set(sybils) and res.fetches <= a.config.max_peers_per_round

    # The next round, the honest peer is waited for again, and the Sybils go last.
    assert x.call(op="sybil_publish", round=rnd + 1, size=16 * MIB)["ok"]
    assert b.call(op="publish", round=rnd + 1, seed=72, size=SMALL)["ok"]
    res = a.gather(rnd + 1, deadline_s=30, expect_peers=1)
    assert [p.peer_id for p in res.packets] == [b.peer_id] and b.peer_id not in res.rejected_by_peer


def test_sybils_with_16_mib_slow_bodies_do_not_starve_an_honest_peer(sybil_net):
    a, b, x, sybils = sybil_net
    check_sybils_do_not_starve_the_honest_peer(a, b, x, sybils, base_round() + 100)


def test_a_failed_fetch_frees_its_budget_and_the_waiting_peer_is_judged_again(sybil_net):
    a, b, x, sybils = sybil_net
    slow = sybils[:2]
    # A round in which the receiver ranks the honest peer between the two Sybils (same size class:
    # 1 MiB and 1.5 MiB), so that it must wait for the first Sybil's fetch to time out.
    rnd = next(
        r
        for r in range(base_round() + 200, base_round() + 10_000)
        if fetch_order(a.peer_id, r, slow[0])
        < fetch_order(a.peer_id, r, b.peer_id)
        < fetch_order(a.peer_id, r, slow[1])
    )
    assert x.call(op="sybil_publish", round=rnd, size=MIB, which=[0, 1])["ok"]
    assert b.call(op="publish", round=rnd, seed=81, size=LARGE)["ok"]
    # Budget for one body at a time: the first Sybil's 1 MiB leaves no room for B's 1.5 MiB.
    res = a.gather(rnd, deadline_s=20, expect_peers=1, max_total_bytes=2 * MIB - 1)
    assert [(p.peer_id, sha(p.data)) for p in res.packets] == [(b.peer_id, sha(payload(81, LARGE)))]
    assert res.rejected_by_peer == {slow[0]: {RejectReason.FETCH_TIMEOUT: 1}}
    # It waited for that fetch's timeout (2 s + 1 MiB at 1 MiB/s), and was then fetched.
    timeout = a.config.fetch_base_s + MIB / a.config.fetch_min_bytes_per_s
    assert res.elapsed_s >= timeout - 0.5


@pytest.mark.slow
def test_sixteen_sybils_with_16_mib_slow_bodies_do_not_starve_an_honest_peer(sybil_net):
    a, b, x, sybils = sybil_net
    sybils = x.call(op="sybils", count=16 - len(sybils), timeout=300)["peer_ids"]  # all of them, old and new
    assert len(set(sybils)) == 16
    check_sybils_do_not_starve_the_honest_peer(a, b, x, sybils, base_round() + 300)
