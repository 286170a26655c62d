"""A swarm node in its own process, driven by the tests over stdin/stdout (one JSON object per line).

    python tests/swarm_peer.py '<SwarmConfig as JSON>'

Prints {"event": "ready", ...} or {"event": "error", "message": ...}, then answers
commands: publish, gather, known, descendants, exit, and the dishonest ones the tests
need: tamper (serve a body that does not match its header), impersonate (sign a header
that names another peer's id), relay (re-publish another peer's bytes as our own),
stall (accept body requests and never answer), sybils (start more nodes in this process,
each a real Swarm with its own key, whose bodies stall unless `stall` is false),
sybil_publish (their headers announce bodies of a chosen size that never come),
sybil_relay (they re-publish another peer's packet bytes) and sybil_junk (they publish
bodies that are no packet); publish_packet publishes a well-formed packet of our own. SIGTERM goes through the swarm's
`install_sigterm_handler` (a clean exit that shuts the DHT down); the daemon has its own
handlers instead (`node.daemon.install_stop_handlers`: stop after the current phase).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys


def payload(seed: int, size: int) -> bytes:
    """The deterministic packet bytes both the peers and the tests derive from (seed, size)."""
    return random.Random(seed).randbytes(size)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def real_packet(sender: str, swarm_id: str, rnd: int) -> bytes:
    """A well-formed rollout packet that names `sender` (about 20 kB)."""
    from node.bench.gather_peers import synthetic_packet

    return synthetic_packet(swarm_id, rnd, sender, groups=2, completions=8, tokens=300, seed=rnd)


async def _stall_bodies(_dht, node) -> None:
    """Runs inside the DHT process: answer every body request by holding the stream open, silently."""
    from node.swarm.bodies import BODY_HANDLER

    async def stall(_info, reader, writer) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            writer.close()

    await node.p2p.remove_binary_stream_handler(BODY_HANDLER)
    await node.p2p.add_binary_stream_handler(BODY_HANDLER, stall)


def main() -> None:
    # Our replies own the real stdout; anything libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(**message) -> None:
        out.write(json.dumps(message) + "\n")

    import psutil

    from node.swarm import Swarm, SwarmConfig, SwarmStartError, install_sigterm_handler
    from node.swarm.client import RecordClient
    from node.swarm.dht import dht_time
    from node.swarm.record import HeaderRecord
    from node.swarm.shards import shard_key, shard_of

    config = SwarmConfig.model_validate_json(sys.argv[1])
    try:
        swarm = Swarm(config).start()
    except SwarmStartError as e:
        reply(event="error", message=str(e))
        return
    install_sigterm_handler(swarm.shutdown)
    client = RecordClient(swarm.dht)
    reply(
        event="ready",
        peer_id=swarm.peer_id,
        addrs=swarm.join_addrs(),
        owner=swarm.owner_subkey.hex(),
        pid=os.getpid(),
    )

    def store_header(rnd: int, record: HeaderRecord, shard: int, node=None) -> bool:
        """Write `record` into the signed slot of `node` (default: ours) in `shard`, whatever it says."""
        node = node or swarm
        key = shard_key(config.swarm_id, rnd, shard)
        c = RecordClient(node.dht)
        return bool(c.store(key, record.to_wire(), dht_time() + 60, node.owner_subkey).result(timeout=10))

    sybils: list = []

    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "publish":
                data = payload(cmd["seed"], cmd["size"])
                reply(ok=swarm.publish(cmd["round"], data, model=cmd.get("model", "")), sha=sha(data))
            elif op == "gather":
                res = swarm.gather(
                    cmd["round"],
                    deadline_s=cmd["deadline"],
                    expect_peers=cmd.get("expect"),
                    stale_rounds=cmd.get("stale"),
                    max_peers=cmd.get("max_peers"),
                    max_total_bytes=cmd.get("max_total_bytes"),
                    exclude_peers=cmd.get("exclude", ()),
                )
                reply(
                    packets=[[p.peer_id, p.round, len(p.data), sha(p.data)] for p in res.packets],
                    rejected=res.rejected,
                    by_peer=res.rejected_by_peer,
                    errors=res.errors,
                    elapsed=res.elapsed_s,
                    bytes_read=res.bytes_read,
                    reads=res.reads,
                    fetches=res.fetches,
                    shards_read=res.shards_read,
                    skipped=res.skipped,
                    unselected=res.unselected,
                )
            elif op == "known":
                reply(peers=swarm.known_peers())
            elif op == "tamper":
                # The header names the sha256 of one body, the server sends another.
                claimed, served = payload(cmd["seed"], cmd["size"]), payload(cmd["seed"] + 1, cmd["size"])
                digest = hashlib.sha256(claimed).digest()
                client.offer_body(digest, cmd["round"], served).result(timeout=10)
                record = HeaderRecord(
                    round=cmd["round"],
                    peer=swarm.peer_id,
                    shards=swarm.shards_for(cmd["round"]),
                    size=len(claimed),
                    sha256=digest,
                )
                reply(ok=store_header(cmd["round"], record, shard_of(swarm.peer_id, swarm.shards_for(cmd["round"]))))
            elif op == "impersonate":
                # Our own slot, our own signature, a header that names another peer (`claim`).
                data = payload(cmd["seed"], cmd["size"])
                digest = hashlib.sha256(data).digest()
                client.offer_body(digest, cmd["round"], data).result(timeout=10)
                body = data if len(data) <= config.inline_max_bytes else None
                record = HeaderRecord(
                    round=cmd["round"],
                    peer=cmd["claim"],
                    shards=swarm.shards_for(cmd["round"]),
                    size=len(data),
                    sha256=digest,
                    body=body,
                )
                shard = shard_of(cmd["claim"], record.shards)  # where readers of the claimed peer look
                reply(ok=store_header(cmd["round"], record, shard), sha=sha(data))
            elif op == "publish_packet":
                data = real_packet(swarm.peer_id, config.swarm_id, cmd["round"])
                reply(ok=swarm.publish(cmd["round"], data), sha=sha(data), data=data.hex())
            elif op == "sybil_relay":
                # Each Sybil re-publishes another peer's packet bytes (`data`) under its own key.
                data = bytes.fromhex(cmd["data"])
                reply(ok=all(sybils[i].publish(cmd["round"], data) for i in cmd.get("which", range(len(sybils)))))
            elif op == "sybil_junk":
                # Each Sybil publishes a body of `size` bytes that is no packet at all.
                which = cmd.get("which", range(len(sybils)))
                reply(ok=all(sybils[i].publish(cmd["round"], os.urandom(cmd.get("size", 10))) for i in which))
            elif op == "relay":
                # Another peer's bytes under our own (honest) header: the same content twice in a round.
                data = payload(cmd["seed"], cmd["size"])
                reply(ok=swarm.publish(cmd["round"], data), sha=sha(data))
            elif op == "stall":
                client.run(_stall_bodies).result(timeout=10)
                reply(ok=True)
            elif op == "sybils":
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=4) as pool:
                    sybils += list(pool.map(lambda _: Swarm(config).start(), range(cmd["count"])))
                for node in sybils if cmd.get("stall", True) else ():
                    RecordClient(node.dht).run(_stall_bodies).result(timeout=10)
                reply(peer_ids=[n.peer_id for n in sybils])
            elif op == "sybil_publish":
                rnd, ok = cmd["round"], []
                for i in cmd.get("which", range(len(sybils))):
                    node = sybils[i]
                    record = HeaderRecord(
                        round=rnd,
                        peer=node.peer_id,
                        shards=node.shards_for(rnd),
                        size=cmd["size"],
                        sha256=hashlib.sha256(f"{node.peer_id}/{rnd}".encode()).digest(),
                    )
                    ok.append(store_header(rnd, record, shard_of(node.peer_id, record.shards), node))
                reply(ok=all(ok))
            elif op == "descendants":
                children = psutil.Process().children(recursive=True)
                reply(pids=[p.pid for p in children], names=[p.name() for p in children])
            elif op == "exit":
                reply(ok=True)
                break
            else:
                reply(error=f"unknown op {op!r}")
    finally:
        for node in sybils:
            node.shutdown()
        swarm.shutdown()


if __name__ == "__main__":
    main()
