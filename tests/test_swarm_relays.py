"""Free identities against one honest peer: relayed copies and junk bodies, over real DHTs.

Node A (the receiver, with a node's body check) runs in the test process; H (honest) and X
(the attacker, hosting 8 Sybils, each a real Swarm with its own key, DHT process and
p2pd) are separate processes. H publishes a well-formed packet each round; the Sybils
re-publish H's bytes under their own keys (a relay race) or publish bodies that are no
packet at all (tiny junk, which used to win every fetch slot by being tiny). Then the
same attacks through the real daemon: gather, admission and trust of a `Node`.
"""

from __future__ import annotations

import pytest
from swarm_peer import sha
from test_swarm import Peer, base_round, local_config

from node.config import NodeConfig
from node.daemon import Node
from node.experiment.exchange import ExchangeHub
from node.swarm import RejectReason, Swarm
from node.swarm.ledger import body_verdict

SYBILS = 8


@pytest.fixture(scope="module")
def relay_net(tmp_path_factory):
    logs = tmp_path_factory.mktemp("relays")
    a = Swarm(local_config(), body_check=body_verdict).start()
    h = Peer("H", local_config(initial_peers=a.join_addrs()), logs)
    x = Peer("X", local_config(initial_peers=a.join_addrs()), logs)
    try:
        h.ready()
        x.ready()
        sybils = x.call(op="sybils", count=SYBILS, stall=False, timeout=300)["peer_ids"]
        assert len(set(sybils)) == SYBILS
        yield a, h, x, sybils
    finally:
        h.close()
        x.close()
        a.shutdown()


def test_relayed_copies_never_take_the_honest_peers_delivery(relay_net):
    """3 relayers re-publish H's packet each round: H's copy is delivered every round, and
    each relayer's is rejected `relayed` under the relayer's own id, whoever came first."""
    a, h, x, sybils = relay_net
    relayers = sybils[:3]
    for rnd in range(base_round() + 400, base_round() + 404):
        honest = h.call(op="publish_packet", round=rnd)
        assert honest["ok"]
        assert x.call(op="sybil_relay", round=rnd, data=honest["data"], which=[0, 1, 2])["ok"]
        res = a.gather(rnd, deadline_s=6)  # the whole window: every copy is judged
        assert [(p.peer_id, sha(p.data)) for p in res.packets] == [(h.peer_id, honest["sha"])], rnd
        assert res.rejected_by_peer == {r: {RejectReason.RELAYED: 1} for r in relayers}, rnd


def test_tiny_junk_bodies_do_not_take_the_fetch_slots(relay_net):
    """8 Sybils publish 10-byte junk, more than k = 4 slots: each is rejected `bad_magic` (a
    reason held against its signer) and frees its slot, and H's packet is delivered."""
    a, h, x, sybils = relay_net
    for rnd in range(base_round() + 500, base_round() + 503):
        assert x.call(op="sybil_junk", round=rnd, size=10)["ok"]
        honest = h.call(op="publish_packet", round=rnd)
        res = a.gather(rnd, deadline_s=10, expect_peers=1, max_peers=4)
        assert [(p.peer_id, sha(p.data)) for p in res.packets] == [(h.peer_id, honest["sha"])], rnd
        assert set(res.rejected_by_peer) <= set(sybils)
        assert all(r == {"bad_magic": 1} for r in res.rejected_by_peer.values()), res.rejected_by_peer


# ---------------------------------------------------------------------------- through the daemon
def _config(tmp_path, name: str) -> NodeConfig:
    return NodeConfig(
        name=name,
        data_dir=tmp_path / name,
        model="tiny-s",
        task="toy",
        prompts_per_round=2,
        group_size=4,
        max_tokens=8,
        seed=0 if name == "victim" else 1,
        swarm_id="relays",
        gather_seconds=0.0,
        api_port=None,
        threads=1,
    )


def test_relayers_and_junk_senders_are_quarantined_and_the_honest_peer_is_admitted(tmp_path):
    """Real nodes on the in-process exchange (the daemon's gather, admission and trust): 3
    relayers and 3 junk senders every round. The honest peer's groups are admitted in every
    round, and every attacker is quarantined after its 2nd round (`quarantine_after`)."""
    hub = ExchangeHub("relays")
    victim = Node(_config(tmp_path, "victim"), exchange=hub.endpoint("victim")).setup()
    honest = Node(_config(tmp_path, "honest"), exchange=hub.endpoint("honest")).setup()
    relayers = [hub.endpoint(f"relay{i}") for i in range(3)]
    junk = [hub.endpoint(f"junk{i}") for i in range(3)]
    attackers = [e.peer_id for e in relayers + junk]
    try:
        admitted = []
        for r in range(4):
            opened = victim.begin_round(r), honest.begin_round(r)
            packet = hub.published(r)[honest.swarm.peer_id]
            for e in relayers:
                e.publish(r, packet)
            for e in junk:
                e.publish(r, b"\x00" * 10)
            assert victim.finish_round(r, opened[0]) is not None
            assert honest.finish_round(r, opened[1]) is not None
            peers = victim.status.snapshot()["peers"]
            admitted.append(peers[honest.swarm.peer_id]["groups_admitted"])
            states = {p: victim.trust.get(p).state for p in attackers}
            if r >= 1:
                assert set(states.values()) == {"quarantined"}, (r, states)
        assert admitted == [2, 4, 6, 8]  # both of its groups, every round
        rejected = victim.status.snapshot()["peers"]
        assert all(rejected[e.peer_id]["rejected"].get("relayed") == 2 for e in relayers)
        assert all(rejected[e.peer_id]["rejected"].get("bad_magic") == 2 for e in junk)
        assert victim.trust.get(honest.swarm.peer_id).state != "quarantined"
    finally:
        victim.close()
        honest.close()
