"""A swarm node in its own process, driven by the tests over stdin/stdout (one JSON object per line).

    python tests/swarm_peer.py '<SwarmConfig as JSON>'

Prints {"event": "ready", ...} or {"event": "error", "message": ...}, then answers
commands: publish, gather, tamper (serve a body that does not match its header),
descendants (pids of the DHT process and p2pd), exit. SIGTERM goes through
`install_sigterm_handler`, as in the daemon.
"""

from __future__ import annotations

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


def main() -> None:
    # Our replies own the real stdout; anything libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(**message) -> None:
        out.write(json.dumps(message) + "\n")

    import psutil

    from node.swarm import Swarm, SwarmConfig, SwarmStartError, install_sigterm_handler
    from node.swarm.dht import dht_time
    from node.swarm.records import PacketRecord, RecordClient
    from protocol.keys import round_key

    config = SwarmConfig.model_validate_json(sys.argv[1])
    try:
        swarm = Swarm(config).start()
    except SwarmStartError as e:
        reply(event="error", message=str(e))
        return
    install_sigterm_handler(swarm.shutdown)
    reply(
        event="ready",
        peer_id=swarm.peer_id,
        addrs=swarm.join_addrs(),
        owner=swarm.owner_subkey.hex(),
        pid=os.getpid(),
    )
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "publish":
                data = payload(cmd["seed"], cmd["size"])
                reply(ok=swarm.publish(cmd["round"], data), sha=sha(data))
            elif op == "gather":
                res = swarm.gather(
                    cmd["round"],
                    deadline_s=cmd["deadline"],
                    expect_peers=cmd.get("expect"),
                    stale_rounds=cmd.get("stale"),
                )
                reply(
                    packets=[[p.peer_id, p.round, len(p.data), sha(p.data)] for p in res.packets],
                    rejected=res.rejected,
                    by_peer=res.rejected_by_peer,
                    errors=res.errors,
                    elapsed=res.elapsed_s,
                )
            elif op == "tamper":
                # A dishonest sender: the header names the sha256 of one body, the server sends another.
                claimed, served = payload(cmd["seed"], cmd["size"]), payload(cmd["seed"] + 1, cmd["size"])
                digest = hashlib.sha256(claimed).digest()
                client = RecordClient(swarm.dht)
                client.offer_body(digest, cmd["round"], served).result(timeout=10)
                record = PacketRecord(round=cmd["round"], peer=swarm.peer_id, size=len(claimed), sha256=digest)
                key = round_key(config.swarm_id, cmd["round"])
                ok = client.store(key, record.to_wire(), dht_time() + 60, swarm.owner_subkey).result(timeout=10)
                reply(ok=bool(ok))
            elif op == "descendants":
                children = psutil.Process().children(recursive=True)
                reply(pids=[p.pid for p in children], names=[p.name() for p in children])
            elif op == "exit":
                reply(ok=True)
                break
            else:
                reply(error=f"unknown op {op!r}")
    finally:
        swarm.shutdown()


if __name__ == "__main__":
    main()
