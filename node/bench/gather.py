"""How long a node waits for its peers' packets: the gather benchmark.

For each swarm size N, N nodes join a fresh swarm on 127.0.0.1, each a real hivemind
DHT process with its own p2pd (their synchronous front-ends share this process, which
keeps the benchmark to one torch import). Each round every node publishes a packet;
once all publishes returned, all nodes start gathering at the same moment, and a
node's figure is the time from starting its gather until it holds all N-1 peers'
packets. Medians are over nodes and rounds.

    ftis-node bench gather --peers 2 --peers 4 --peers 8 --json
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from node.swarm import Swarm, SwarmConfig
from protocol.keys import round_at

__all__ = ["run_gather_bench"]

DEFAULT_PACKET_BYTES = 48 << 10  # about one round of a small model's completions, inline in the record


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _bench_swarm(n: int, rounds: int, packet_bytes: int, deadline_s: float) -> dict[str, Any]:
    swarm_id = f"bench-{n}-{secrets.token_hex(3)}"
    started = time.monotonic()
    nodes: list[Swarm] = []
    try:
        first = Swarm(SwarmConfig(swarm_id=swarm_id, host="127.0.0.1", port=0)).start()
        nodes.append(first)
        for _ in range(n - 1):
            cfg = SwarmConfig(swarm_id=swarm_id, host="127.0.0.1", port=0, initial_peers=first.join_addrs())
            nodes.append(Swarm(cfg).start())
        start_s = time.monotonic() - started

        gather_s: list[float] = []
        publish_s: list[float] = []
        incomplete = 0
        base = round_at(nodes[0].dht_time(), nodes[0].config.round_seconds)
        with ThreadPoolExecutor(max_workers=n) as pool:
            for k in range(rounds):
                rnd = base + 2 * k  # a gap, so that stale-round reads see nothing of the last round
                packets = [secrets.token_bytes(packet_bytes) for _ in nodes]

                def publish(i: int) -> float:
                    t = time.monotonic()
                    if not nodes[i].publish(rnd, packets[i]):
                        raise RuntimeError(f"node {i} could not publish round {rnd}")
                    return time.monotonic() - t

                publish_s += list(pool.map(publish, range(n)))
                barrier = threading.Barrier(n)

                def gather(i: int):
                    barrier.wait()
                    return nodes[i].gather(rnd, deadline_s=deadline_s, expect_peers=n - 1)

                for i, res in enumerate(pool.map(gather, range(n))):
                    expected = {bytes(p) for j, p in enumerate(packets) if j != i}
                    if {p.data for p in res.packets} == expected:
                        gather_s.append(res.elapsed_s)
                    else:
                        incomplete += 1
    finally:
        for node in nodes:
            node.shutdown()
    return {
        "nodes": n,
        "start_s": round(start_s, 3),
        "gather_s_median": round(statistics.median(gather_s), 4) if gather_s else None,
        "gather_s_p90": round(_percentile(gather_s, 0.9), 4) if gather_s else None,
        "gather_s_max": round(max(gather_s), 4) if gather_s else None,
        "publish_s_median": round(statistics.median(publish_s), 4),
        "incomplete_gathers": incomplete,
        "gathers": len(gather_s) + incomplete,
    }


def run_gather_bench(
    peers: Sequence[int] = (2, 4, 8),
    rounds: int = 5,
    packet_bytes: int = DEFAULT_PACKET_BYTES,
    deadline_s: float = 10.0,
) -> dict[str, Any]:
    """Gather latency per swarm size. `gather_s_median[N]` is the headline figure (goal: <= 0.5 s at 8).

    A gather that misses a peer's packet by its deadline counts in `incomplete_gathers`
    and not in the timings.
    """
    if not peers or any(n < 2 for n in peers):
        raise ValueError(f"peers must be swarm sizes >= 2, got {list(peers)}")
    if rounds < 1 or packet_bytes < 1 or deadline_s <= 0:
        raise ValueError("rounds and packet_bytes must be >= 1 and deadline_s > 0")
    per_size = {str(n): _bench_swarm(n, rounds, packet_bytes, deadline_s) for n in peers}
    return {
        "rounds": rounds,
        "packet_bytes": packet_bytes,
        "gather_s_median": {n: r["gather_s_median"] for n, r in per_size.items()},
        "by_size": per_size,
    }


def format_gather_bench(result: dict) -> str:
    """One line per swarm size."""
    return "\n".join(
        f"gather, {n} nodes: median {r.get('gather_s_median')} s, p90 {r.get('gather_s_p90')} s, "
        f"incomplete {r.get('incomplete_gathers')}/{r.get('gathers')}"
        for n, r in (result.get("by_size") or {}).items()
    )
