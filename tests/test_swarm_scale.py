"""The sharded gather: a small swarm still sees everyone; a larger one reads O(k), not O(N).

The swarm tests here run N real hivemind DHT processes (each with its own p2pd) on
127.0.0.1; their synchronous front-ends share the test process, as in `bench gather`.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest
from swarm_peer import payload, sha

from node.swarm import Swarm, SwarmConfig
from node.swarm.gather import SIGNATURE_BYTES
from node.swarm.shards import SizeEstimate, read_order, shard_count, shard_of
from protocol.keys import round_at

PACKET = 80 << 10  # a realistic packet: 8 groups x 12 completions x 200 tokens at ~4 bytes a token


def start_swarm(n: int, **overrides) -> list[Swarm]:
    base = dict(
        swarm_id=f"scale-{secrets.token_hex(3)}", host="127.0.0.1", port=0, startup_timeout=60, bootstrap_attempts=3
    )
    first = Swarm(SwarmConfig(**base, **overrides)).start()
    nodes = [first]
    try:
        cfg = SwarmConfig(**base, **overrides, initial_peers=first.join_addrs())
        with ThreadPoolExecutor(max_workers=4) as pool:
            for node in pool.map(lambda _: Swarm(cfg).start(), range(n - 1)):
                nodes.append(node)
    except BaseException:
        for node in nodes:
            node.shutdown()
        raise
    return nodes


def publish_all(nodes: list[Swarm], rnd: int, size: int) -> dict[str, bytes]:
    packets = {node.peer_id: payload(secrets.randbits(32), size) for node in nodes}
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        assert all(pool.map(lambda node: node.publish(rnd, packets[node.peer_id]), nodes))
    return packets


def gather_all(nodes: list[Swarm], rnd: int, **kwargs):
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        return list(pool.map(lambda node: node.gather(rnd, **kwargs), nodes))


# ---------------------------------------------------------------- the arithmetic, no DHT


def test_shards_nest_and_the_count_follows_the_swarm_size():
    ids = [f"Qm{secrets.token_hex(8)}" for _ in range(200)]
    for peer in ids:  # halving S keeps a peer in the shard its index reduces to
        assert shard_of(peer, 8) % 4 == shard_of(peer, 4) and shard_of(peer, 1) == 0
    assert [shard_count(n, 16) for n in (1, 3, 31, 32, 100, 1000)] == [1, 1, 1, 2, 4, 32]
    assert shard_count(10**9, 16) == 4096
    order = read_order(ids[0], 7, 8)
    assert order[0] == shard_of(ids[0], 8) and sorted(order) == list(range(8))
    assert read_order(ids[0], 8, 8) != order or read_order(ids[1], 7, 8) != order  # shuffled per (peer, round)
    with pytest.raises(ValueError, match="power of two"):
        shard_of(ids[0], 3)


def test_size_estimate_counts_each_header_for_the_shards_it_could_be_in():
    est = SizeEstimate(window=3)
    # 1000 peers in 32 shards; a node read 2 of them (~31 headers each, all writers on S=32)
    assert est.add([5, 9], [32] * 62) == pytest.approx(1 + 62 * 16)
    # writers on S=1 all sit in shard 0; one read of shard 0 sees all of them
    assert est.add([0], [1] * 9) == 10
    assert est.add([0, 3], [1] * 9 + [4] * 2) == 1 + 9 + 2 * 2
    assert est.value == 14  # the median of the window (993, 10, 14)


# ---------------------------------------------------------------- real DHTs


def test_a_three_node_swarm_sees_everyone_whatever_the_shard_count():
    nodes = start_swarm(3, shards=8)  # more shards than peers: most are empty
    try:
        rnd = round_at(nodes[0].dht_time(), 30)
        packets = publish_all(nodes, rnd, 4 << 10)
        for node, res in zip(nodes, gather_all(nodes, rnd, deadline_s=20, expect_peers=2)):
            want = {(peer, sha(data)) for peer, data in packets.items() if peer != node.peer_id}
            assert {(p.peer_id, sha(p.data)) for p in res.packets} == want
            assert res.rejected == {} and len(res.shards_read) <= node.config.max_shard_reads
    finally:
        for node in nodes:
            node.shutdown()


def test_a_twelve_node_swarm_with_k4_reads_only_its_shards_and_four_bodies():
    k, shards = 4, 4
    nodes = start_swarm(12, shards=shards, max_peers_per_round=k, sample_shards=1, max_shard_reads=4)
    try:
        rnd = round_at(nodes[0].dht_time(), 30) + 5  # no stale round holds anything
        packets = publish_all(nodes, rnd, PACKET)
        results = gather_all(nodes, rnd, deadline_s=30, expect_peers=k)
        ids = [n.peer_id for n in nodes]
        for node, res in zip(nodes, results):
            me = node.peer_id
            assert len(res.packets) == k and res.fetches == k and res.rejected == {}, res
            assert all(packets[p.peer_id] == p.data for p in res.packets)
            # The shards it read: its own plus one sample, twice as many only while they held fewer than k peers.
            order = read_order(me, rnd, shards)
            needed = 2
            while needed < shards and sum(shard_of(p, shards) in order[:needed] for p in ids if p != me) < k:
                needed = min(2 * needed, shards)
            assert res.shards_read == sorted(order[:needed]), (res.shards_read, order, needed)
            # Bytes: k bodies plus the headers of the shards it read (each read returns at most all 12).
            headers = res.bytes_read - k * PACKET
            assert 0 < headers <= res.reads * 12 * (len(node.owner_subkey) + 300 + SIGNATURE_BYTES)
            assert res.bytes_read < 0.5 * 11 * PACKET  # what reading every peer's packet would cost
    finally:
        for node in nodes:
            node.shutdown()
