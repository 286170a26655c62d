"""How long a node waits for its peers' packets, and what it reads: the gather benchmark.

For each swarm size N, N real Swarm nodes join a fresh swarm on 127.0.0.1, each with its
own hivemind DHT process and p2pd, hosted by a few publisher processes
(`node.bench.gather_peers`, `per_process` nodes each). Each round every node publishes a
real encoded packet of random tokens (8 groups x 12 completions x 200 tokens, about
80 KB); then every node starts its gather at the same moment, and its figure is the time
until it holds min(k, N-1) peers' packets (k = max_peers_per_round). Medians are over
nodes and rounds.

    ftis-node bench gather --peers 8,16,32 --json
    ftis-node bench gather --simulate 1000 --json        (adds the model of gather_sim.py)

Per N: gather_s_median / p90, peers_seen (median), bytes_read_per_node (headers as
received plus bodies, `GatherResult.bytes_read`), dht_rpc_bytes_per_node (every DHT RPC
answer and request the node's DHT made during the gather, counted inside its DHT
process: the real read cost, with replication and lookups), memory_per_peer_mib (PSS of
the publisher processes, their DHT processes and p2pd, divided by N).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["format_gather_bench", "run_gather_bench"]

_READY_TIMEOUT_S = 300.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Publisher:
    """One `gather_peers` process: send a command, read its one-line JSON answer."""

    def __init__(self, config_json: str, nodes: int, log) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node.bench.gather_peers", config_json, str(nodes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict[str, Any] = {}

    def _pump(self) -> None:
        assert self.proc.stdout is not None, "started with stdout=PIPE"
        for line in self.proc.stdout:
            self._lines.put(line)

    def read(self, timeout: float) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise RuntimeError(f"a gather publisher (pid {self.proc.pid}) did not answer in {timeout:.0f} s") from None

    def ready(self) -> dict[str, Any]:
        self.info = self.read(_READY_TIMEOUT_S)
        if self.info.get("event") != "ready":
            raise RuntimeError(f"a gather publisher failed to start: {self.info.get('message', self.info)}")
        return self.info

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None, "started with stdin=PIPE"
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


def _swarm_config(swarm_id: str, k: int, initial_peers: list[str]) -> str:
    """SwarmConfig fields as JSON; built by hand so this process never imports hivemind (and torch)."""
    return json.dumps(
        {
            "swarm_id": swarm_id,
            "host": "127.0.0.1",
            "port": 0,
            "initial_peers": initial_peers,
            "max_peers_per_round": k,
            "startup_timeout": 120,
            "bootstrap_attempts": 5,
        }
    )


def _bench_swarm(n: int, rounds: int, k: int, deadline_s: float, per_process: int, log_dir: str) -> dict[str, Any]:
    swarm_id = f"bench-{n}-{secrets.token_hex(3)}"
    started = time.monotonic()
    log = open(os.path.join(log_dir, f"publishers-{n}.log"), "w")
    publishers: list[_Publisher] = []
    try:
        first = _Publisher(_swarm_config(swarm_id, k, []), min(n, per_process), log)  # the bootstrap and others
        publishers.append(first)
        addrs = first.ready()["addrs"]
        rest = n - min(n, per_process)
        sizes = [per_process] * (rest // per_process) + ([rest % per_process] if rest % per_process else [])
        publishers += [_Publisher(_swarm_config(swarm_id, k, addrs), m, log) for m in sizes]
        for p in publishers[1:]:
            p.ready()
        start_s = time.monotonic() - started

        expect = min(k, n - 1)
        per_gather: list[dict[str, Any]] = []  # one node gathering at a time
        all_at_once: list[dict[str, Any]] = []  # every node at the same moment, sharing this machine's cores
        cpu_s = 0.0
        publish_s: list[float] = []
        publish_failed = 0
        packet_bytes = 0
        base = int(time.time() // 30)  # the default 30 s rounds; gaps of 2 so stale reads see nothing old
        for r in range(rounds):
            for phase, rnd in (("one", base + 4 * r + 10), ("all", base + 4 * r + 12)):
                for p in publishers:
                    p.send(op="publish", round=rnd)
                for p in publishers:
                    answer = p.read(180)
                    publish_s += answer["publish_s"]
                    publish_failed += answer["ok"].count(False)
                    packet_bytes = answer["size"]
                if phase == "one":
                    for p in publishers:
                        p.send(op="gather", round=rnd, sequential=True, deadline=deadline_s, expect=expect)
                        per_gather += p.read(len(p.info["peers"]) * (deadline_s + 60))["results"]
                    continue
                at = time.time() + 1.0
                cpu_before = _tree_cpu_s()
                for p in publishers:
                    p.send(op="gather", round=rnd, at=at, deadline=deadline_s, expect=expect)
                for p in publishers:
                    all_at_once += p.read(deadline_s + 120)["results"]
                cpu_s += _tree_cpu_s() - cpu_before
        memory = {"pss": 0, "rss": 0}
        for p in publishers:
            p.send(op="stats")
            stats = p.read(60)
            memory = {key: memory[key] + stats["memory"][key] for key in memory}
    finally:
        for p in publishers:
            p.close()
        log.close()

    complete = [g["elapsed_s"] for g in per_gather if g["peers"] >= expect]
    complete_all = [g["elapsed_s"] for g in all_at_once if g["peers"] >= expect]

    def median_of(key: str) -> float:
        return statistics.median(g[key] for g in per_gather) if per_gather else 0.0

    def timing(values: list[float], q: float | None = None) -> float | None:
        if not values:
            return None
        return round(statistics.median(values) if q is None else _percentile(values, q), 4)

    return {
        "nodes": n,
        "expect_peers": expect,
        "packet_bytes": packet_bytes,
        "start_s": round(start_s, 2),
        "gather_s_median": timing(complete),
        "gather_s_p90": timing(complete, 0.9),
        "gather_s_max": timing(complete, 1.0),
        "gather_all_at_once_s_median": timing(complete_all),
        "gather_all_at_once_s_p90": timing(complete_all, 0.9),
        "cpu_s_per_gather": round(cpu_s / max(len(all_at_once), 1), 4),
        "publish_s_median": round(statistics.median(publish_s), 4) if publish_s else None,
        "publish_failed": publish_failed,
        "peers_seen": median_of("peers"),
        "bytes_read_per_node": int(median_of("bytes_read")),
        "header_bytes_per_node": int(median_of("bytes_read") - median_of("body_bytes")),
        "headers_read_per_node": median_of("headers_read"),
        "dht_rpc_bytes_per_node": int(median_of("rpc_in") + median_of("rpc_out")),
        "dht_rpc_in_per_node": int(median_of("rpc_in")),
        "dht_rpc_out_per_node": int(median_of("rpc_out")),
        "dht_rpc_calls_per_node": median_of("rpc_calls"),
        "dht_reads_per_node": median_of("reads"),
        "fetches_per_node": median_of("fetches"),
        "memory_per_peer_mib": round(memory["pss"] / n / 2**20, 1),
        "rss_per_peer_mib": round(memory["rss"] / n / 2**20, 1),
        "incomplete_gathers": len(per_gather) - len(complete),
        "incomplete_all_at_once": len(all_at_once) - len(complete_all),
        "gathers": len(per_gather),
        "rejected": sum(sum(g["rejected"].values()) for g in per_gather + all_at_once),
    }


def _tree_cpu_s() -> float:
    """CPU seconds used so far by this process's descendants (publishers, DHT processes, p2pd)."""
    try:
        import psutil
    except ImportError:  # the figure is left out, nothing else
        return 0.0
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def run_gather_bench(
    peers: Sequence[int] = (8, 16, 32),
    rounds: int = 5,
    deadline_s: float = 10.0,
    max_peers: int = 8,
    per_process: int = 4,
    simulate: int | None = None,
) -> dict[str, Any]:
    """Gather latency and read volume per swarm size; with `simulate`, the modelled volume up to that size.

    A gather that holds fewer than min(k, N-1) packets at its deadline counts in
    `incomplete_gathers` and not in the timings.
    """
    if not peers or any(n < 2 for n in peers):
        raise ValueError(f"peers must be swarm sizes >= 2, got {list(peers)}")
    if rounds < 1 or deadline_s <= 0 or max_peers < 1 or per_process < 1:
        raise ValueError("rounds, max_peers and per_process must be >= 1 and deadline_s > 0")
    log_dir = tempfile.mkdtemp(prefix="ftis-bench-gather-")  # the publishers' stderr, kept for a post-mortem
    per_size = {str(n): _bench_swarm(n, rounds, max_peers, deadline_s, per_process, log_dir) for n in peers}
    out: dict[str, Any] = {
        "rounds": rounds,
        "max_peers_per_round": max_peers,
        "logs": log_dir,
        "gather_s_median": {n: r["gather_s_median"] for n, r in per_size.items()},
        "gather_s_p90": {n: r["gather_s_p90"] for n, r in per_size.items()},
        "gather_all_at_once_s_median": {n: r["gather_all_at_once_s_median"] for n, r in per_size.items()},
        "cpu_s_per_gather": {n: r["cpu_s_per_gather"] for n, r in per_size.items()},
        "bytes_read_per_node": {n: r["bytes_read_per_node"] for n, r in per_size.items()},
        "peers_seen": {n: r["peers_seen"] for n, r in per_size.items()},
        "memory_per_peer_mib": {n: r["memory_per_peer_mib"] for n, r in per_size.items()},
        "by_size": per_size,
    }
    sizes = sorted(per_size, key=int)
    if len(sizes) > 1 and per_size[sizes[0]]["bytes_read_per_node"]:
        out["bytes_read_ratio"] = round(
            per_size[sizes[-1]]["bytes_read_per_node"] / per_size[sizes[0]]["bytes_read_per_node"], 3
        )
    if simulate:
        from node.bench.gather_sim import simulate_volume

        out["simulation"] = simulate_volume(per_size[sizes[-1]], max_nodes=simulate, k=max_peers)
    return out


def format_gather_bench(result: dict) -> str:
    """One line per swarm size (and the simulation's, if any)."""
    lines = [
        f"gather, {n} nodes: median {r.get('gather_s_median')} s, p90 {r.get('gather_s_p90')} s, "
        f"peers {r.get('peers_seen')}, read {r.get('bytes_read_per_node', 0) / 1024:.0f} KiB/node "
        f"(DHT RPC {r.get('dht_rpc_bytes_per_node', 0) / 1024:.0f} KiB), {r.get('memory_per_peer_mib')} MiB/peer, "
        f"incomplete {r.get('incomplete_gathers')}/{r.get('gathers')}"
        for n, r in (result.get("by_size") or {}).items()
    ]
    for row in (result.get("simulation") or {}).get("rows", []):
        lines.append(
            f"model, {row['nodes']} nodes: read {row['read_bytes_per_node'] / 1024:.0f} KiB/node/round "
            f"(one key for all: {row['single_key_read_bytes_per_node'] / 1024:.0f} KiB), "
            f"write {row['write_bytes_per_node'] / 1024:.0f} KiB/node/round"
        )
    return "\n".join(lines)
