"""Run inside a WanNet namespace by tests/test_wan.py: a slow but live peer's body arrives late, not lost.

    python tests/wan_late_fetch.py <a node port> <a proxy port> <b node port> <b proxy port>

A (gatherer) and B (publisher) are real Swarms, each behind its delay proxy. B publishes a
body; A gathers with a deadline too short for the fetch over the slow link, then gathers the
next round. Prints one JSON line: what each of the two gathers returned.
"""

from __future__ import annotations

import json
import random
import sys

from node.swarm import Swarm, SwarmConfig
from protocol.keys import round_at


def main() -> None:
    a_port, a_proxy, b_port, b_proxy = (int(x) for x in sys.argv[1:5])

    def config(port: int, proxy: int, **extra) -> SwarmConfig:
        base = dict(swarm_id="late", host="127.0.0.1", port=port, announce_maddrs=[f"/ip4/127.0.0.1/tcp/{proxy}"])
        return SwarmConfig(**base, startup_timeout=60, rpc_timeout_s=6, **extra)

    out: list[dict] = []
    with Swarm(config(a_port, a_proxy)).start() as a:
        boot = [m for m in a.join_addrs() if f"/tcp/{a_proxy}/" in m]
        with Swarm(config(b_port, b_proxy, initial_peers=boot)).start() as b:
            base = round_at(a.dht_time(), 30) + 1000
            body = random.Random(1).randbytes(256 << 10)  # fetched, not inline
            # Longer deadlines until one gather ends with the header read and the fetch still running.
            for r, deadline in zip(range(base, base + 10, 2), (1.5, 2.5, 3.5, 4.5, 6.0)):
                assert b.publish(r, body)
                first = a.gather(r, deadline_s=deadline, expect_peers=1, stale_rounds=2)
                second = a.gather(r + 1, deadline_s=15, expect_peers=1, stale_rounds=2)
                out.append(
                    {
                        "first": {"packets": len(first.packets), "carried": first.carried, "rejected": first.rejected},
                        "second": {
                            "packets": [(p.peer_id == b.peer_id, p.round - r, p.data == body) for p in second.packets],
                            "late": second.late,
                            "rejected": second.rejected,
                        },
                    }
                )
                if first.carried:
                    break
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
