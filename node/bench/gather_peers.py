"""A publisher process of `bench gather`: a few real `Swarm` nodes with synthetic packets.

    python -m node.bench.gather_peers '<SwarmConfig JSON>' <nodes>

Driven over stdin/stdout, one JSON object per line: prints {"event": "ready", ...}, then
answers publish / gather / stats / exit. Each node is a real Swarm (its own DHT process
and p2pd) publishing a real encoded `RolloutPacket` of a realistic size, made from
random tokens (no model). Several nodes share one process to keep the Python (and
torch, which hivemind imports) overhead per node small; memory is reported per node.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from protocol import PacketHeader, RolloutPacket, encode
from protocol.packet import Completion, Group, SamplingParams

__all__ = ["synthetic_packet"]


def synthetic_packet(
    swarm_id: str,
    round: int,
    peer_id: str,
    *,
    groups: int = 8,
    completions: int = 12,
    tokens: int = 200,
    vocab: int = 49152,
    seed: int = 0,
) -> bytes:
    """An encoded packet of random tokens in the shape a node sends (8 groups x 12 x 200 by default)."""
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens)
    body = [
        Group.of(
            f"bench/{round}/{g}",
            "bench-model",
            sampling,
            [
                Completion.of(
                    rng.integers(0, vocab, tokens, dtype=np.uint32),
                    -rng.exponential(1.5, tokens).astype(np.float32),
                )
                for _ in range(completions)
            ],
        )
        for g in range(groups)
    ]
    header = PacketHeader.create(
        swarm_id=swarm_id,
        round=round,
        sender_peer_id=peer_id,
        base_model_id="bench-model",
        tokenizer_fingerprint="bench",
        vocab_size=vocab,
    )
    return encode(RolloutPacket(header=header, groups=body))


async def _count_rpc_bytes(dht, node) -> None:
    """Inside the DHT process: count the bytes of every DHT RPC this node makes (requests out, answers in)."""
    p2p = node.p2p
    plain = p2p.call_protobuf_handler
    dht.ftis_rpc = {"rpc_in": 0, "rpc_out": 0, "rpc_calls": 0}

    async def counted(peer_id, name, input, output_type):
        out = await plain(peer_id, name, input, output_type)
        dht.ftis_rpc["rpc_calls"] += 1
        dht.ftis_rpc["rpc_out"] += input.ByteSize() if hasattr(input, "ByteSize") else 0
        dht.ftis_rpc["rpc_in"] += out.ByteSize() if hasattr(out, "ByteSize") else 0
        return out

    p2p.call_protobuf_handler = counted


async def _rpc_counters(dht, _node) -> dict[str, int]:
    return dict(dht.ftis_rpc)


def _memory(pids: list[int]) -> dict[str, int]:
    import psutil

    pss = rss = 0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except (psutil.Error, OSError):
            continue
        pss += getattr(info, "pss", info.rss)
        rss += info.rss
    return {"pss": pss, "rss": rss}


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)  # replies own stdout; library noise goes to stderr
    os.dup2(2, 1)

    def reply(**message: Any) -> None:
        out.write(json.dumps(message) + "\n")

    import psutil

    from node.swarm import Swarm, SwarmConfig, SwarmStartError
    from node.swarm.client import RecordClient

    config = SwarmConfig.model_validate_json(sys.argv[1])
    count = int(sys.argv[2])
    nodes: list[Swarm] = []
    try:
        if not config.initial_peers:  # this process holds the swarm's first node; the others join it
            nodes.append(Swarm(config).start())
            config = config.model_copy(update={"initial_peers": nodes[0].join_addrs()})
        with ThreadPoolExecutor(max_workers=count) as pool:
            nodes += list(pool.map(lambda _: Swarm(config).start(), range(count - len(nodes))))
    except SwarmStartError as e:
        reply(event="error", message=str(e))
        for node in nodes:
            node.shutdown()
        return
    clients = [RecordClient(n.dht) for n in nodes]
    for c in clients:
        c.run(_count_rpc_bytes).result(timeout=30)
    reply(event="ready", peers=[n.peer_id for n in nodes], addrs=nodes[0].join_addrs(), pid=os.getpid())
    packets: dict[int, list[bytes]] = {}
    try:
        with ThreadPoolExecutor(max_workers=max(count, 1)) as pool:
            for line in sys.stdin:
                cmd = json.loads(line)
                op = cmd["op"]
                if op == "publish":
                    rnd = cmd["round"]
                    packets = {rnd: [synthetic_packet(config.swarm_id, rnd, n.peer_id, seed=rnd) for n in nodes]}

                    def publish(i: int, rnd: int = rnd) -> tuple[bool, float]:
                        t = time.monotonic()
                        ok = nodes[i].publish(rnd, packets[rnd][i], model="bench-model")
                        return ok, time.monotonic() - t

                    done = list(pool.map(publish, range(count)))
                    reply(ok=[ok for ok, _ in done], publish_s=[s for _, s in done], size=len(packets[rnd][0]))
                elif op == "gather":  # all nodes at once from `at`, or (sequential) one after another
                    start_at = cmd.get("at", 0.0)
                    before = [c.run(_rpc_counters).result(timeout=30) for c in clients]

                    def gather(i: int) -> dict[str, Any]:
                        time.sleep(max(0.0, start_at - time.time()))  # every process starts together
                        res = nodes[i].gather(cmd["round"], deadline_s=cmd["deadline"], expect_peers=cmd["expect"])
                        return {
                            "elapsed_s": res.elapsed_s,
                            "peers": len(res.peers),
                            "bytes_read": res.bytes_read,
                            "headers_read": res.headers_read,
                            "body_bytes": sum(len(p.data) for p in res.packets),
                            "reads": res.reads,
                            "fetches": res.fetches,
                            "rejected": res.rejected,
                            "errors": res.errors,
                        }

                    if cmd.get("sequential"):
                        results = [gather(i) for i in range(count)]
                    else:
                        results = list(pool.map(gather, range(count)))
                    after = [c.run(_rpc_counters).result(timeout=30) for c in clients]
                    for res, b, a in zip(results, before, after):
                        res.update({k: a[k] - b[k] for k in a})
                    reply(results=results)
                elif op == "stats":
                    tree = [os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]
                    reply(memory=_memory(tree), processes=len(tree), threads=threading.active_count())
                elif op == "exit":
                    reply(ok=True)
                    break
    finally:
        for node in nodes:
            node.shutdown()


if __name__ == "__main__":
    main()
