"""Free identities against one honest peer: relayed copies and tiny junk bodies, measured.

Keys cost nothing, so an attacker can run many peers. Two ways they could starve an honest
peer, each played for `rounds` rounds over real hivemind DHTs on 127.0.0.1 (every Swarm has its
own DHT process and p2pd; all live in this process, as `bench gather`'s publishers do):

- relay race: `relayers` Sybils re-publish the honest peer's packet bytes under their own keys
  each round. Figure: the share of rounds in which the receiver's gather delivered the honest
  copy (and not a relayer's in its place).
- tiny junk: `junk` Sybils publish 10-byte bodies that are no packet, more of them than the
  receiver's fetch slots (`max_peers`). Figure: the share of gathers that delivered the honest
  packet.

Then both attacks through the daemon (gather, admission and trust of a real `Node`, on the
in-process exchange): the round at which every attacker is quarantined, and the rounds in which
the honest peer's groups were admitted.

    ftis-node bench attack --json      (the `free_identities` entry)
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["format_free_identities", "run_free_identities_bench"]


def _gather_rounds(*, rounds: int, relayers: int, junk: int, max_peers: int, deadline_s: float, say) -> dict[str, Any]:
    from node.bench.gather_peers import synthetic_packet
    from node.swarm import Swarm, SwarmConfig, dht_time, round_at
    from node.swarm.ledger import body_verdict

    def config(**kw: Any) -> SwarmConfig:
        return SwarmConfig(swarm_id="free-ids-bench", host="127.0.0.1", port=0, startup_timeout=60, **kw)

    a = Swarm(config(), body_check=body_verdict).start()
    started: list[Swarm] = [a]
    try:
        join = config(initial_peers=a.join_addrs())
        with ThreadPoolExecutor(max_workers=4) as pool:
            started += list(pool.map(lambda _: Swarm(join).start(), range(1 + max(relayers, junk))))
        honest, sybils = started[1], started[2:]
        first = round_at(dht_time(), 30) + 1000  # far from any round a live node plays
        relay: dict[str, float] = {"delivered": 0, "relayed_rejections": 0, "rounds": rounds, "relayers": relayers}
        for i in range(rounds):
            rnd = first + i
            data = synthetic_packet("free-ids-bench", rnd, honest.peer_id, groups=2, completions=8, tokens=300, seed=i)
            honest.publish(rnd, data)
            for s in sybils[:relayers]:
                s.publish(rnd, data)
            res = a.gather(rnd, deadline_s=deadline_s, max_peers=max_peers)  # the whole window: every copy judged
            digest = hashlib.sha256(data).hexdigest()
            relay["delivered"] += any(
                p.peer_id == honest.peer_id and hashlib.sha256(p.data).hexdigest() == digest for p in res.packets
            )
            relay["relayed_rejections"] += sum(r.get("relayed", 0) for r in res.rejected_by_peer.values())
            if say:
                say(f"relay race round {i + 1}/{rounds}: delivered {relay['delivered']}")
        tiny: dict[str, float] = {
            "delivered": 0,
            "junk_rejections": 0,
            "gathers": rounds,
            "junk_keys": junk,
            "max_peers": max_peers,
        }
        for i in range(rounds):
            rnd = first + rounds + i
            for s in sybils[:junk]:
                s.publish(rnd, b"\x00" * 10)
            data = synthetic_packet("free-ids-bench", rnd, honest.peer_id, groups=2, completions=8, tokens=300, seed=i)
            honest.publish(rnd, data)
            res = a.gather(rnd, deadline_s=deadline_s, expect_peers=1, max_peers=max_peers)
            tiny["delivered"] += any(p.peer_id == honest.peer_id for p in res.packets)
            tiny["junk_rejections"] += sum(sum(r.values()) for p, r in res.rejected_by_peer.items())
            if say:
                say(f"tiny junk gather {i + 1}/{rounds}: delivered {tiny['delivered']}")
        relay["delivered_share"] = relay["delivered"] / rounds
        tiny["delivered_share"] = tiny["delivered"] / rounds
        return {"relay_race": relay, "tiny_junk": tiny}
    finally:
        for s in reversed(started):
            s.shutdown()


def _through_the_daemon(*, rounds: int, relayers: int, junk: int) -> dict[str, Any]:
    from node.config import NodeConfig
    from node.daemon import Node
    from node.experiment.exchange import ExchangeHub

    with tempfile.TemporaryDirectory() as tmp:

        def node(name: str, seed: int) -> Node:
            cfg = NodeConfig(
                name=name,
                data_dir=Path(tmp) / name,
                model="tiny-s",
                task="toy",
                prompts_per_round=2,
                group_size=4,
                max_tokens=8,
                seed=seed,
                swarm_id="free-ids-bench",
                gather_seconds=0.0,
                api_port=None,
                threads=1,
            )
            return Node(cfg, exchange=hub.endpoint(name)).setup()

        hub = ExchangeHub("free-ids-bench")
        victim, honest = node("victim", 0), node("honest", 1)
        relay_ends = [hub.endpoint(f"relay{i}") for i in range(relayers)]
        junk_ends = [hub.endpoint(f"junk{i}") for i in range(junk)]
        attackers = [e.peer_id for e in relay_ends + junk_ends]
        quarantined_at: dict[str, int] = {}
        honest_admitted_rounds = 0
        try:
            for r in range(rounds):
                opened = victim.begin_round(r), honest.begin_round(r)
                packet = hub.published(r)[honest.swarm.peer_id]
                for e in relay_ends:
                    e.publish(r, packet)
                for e in junk_ends:
                    e.publish(r, b"\x00" * 10)
                before = victim.status.snapshot()["peers"].get(honest.swarm.peer_id, {}).get("groups_admitted", 0)
                victim.finish_round(r, opened[0])
                honest.finish_round(r, opened[1])
                after = victim.status.snapshot()["peers"][honest.swarm.peer_id]["groups_admitted"]
                honest_admitted_rounds += after > before
                for p in attackers:
                    if p not in quarantined_at and victim.trust.get(p).state == "quarantined":
                        quarantined_at[p] = r + 1  # rounds played when it was quarantined
        finally:
            victim.close()
            honest.close()
    every = len(quarantined_at) == len(attackers)
    return {
        "rounds": rounds,
        "relayers": relayers,
        "junk_senders": junk,
        "honest_admitted_share": honest_admitted_rounds / rounds,
        "attackers_quarantined": len(quarantined_at),
        "all_quarantined_after_rounds": max(quarantined_at.values()) if every else None,
    }


def run_free_identities_bench(
    *,
    rounds: int = 20,
    relayers: int = 3,
    junk: int = 16,
    max_peers: int = 4,
    deadline_s: float = 6.0,
    daemon_rounds: int = 6,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    started = time.perf_counter()
    out = _gather_rounds(
        rounds=rounds, relayers=relayers, junk=junk, max_peers=max_peers, deadline_s=deadline_s, say=progress
    )
    if daemon_rounds:
        out["through_the_daemon"] = _through_the_daemon(rounds=daemon_rounds, relayers=relayers, junk=junk)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def format_free_identities(r: dict[str, Any]) -> str:
    relay, tiny = r["relay_race"], r["tiny_junk"]
    lines = [
        f"free identities over real DHTs ({relay['rounds']} rounds each):",
        f"  relay race, {relay['relayers']} relayers: honest copy delivered in {relay['delivered']} of "
        f"{relay['rounds']} rounds ({relay['delivered_share']:.0%}), "
        f"{relay['relayed_rejections']} copies rejected relayed",
        f"  tiny junk, {tiny['junk_keys']} keys vs {tiny['max_peers']} fetch slots: honest packet delivered in "
        f"{tiny['delivered']} of {tiny['gathers']} gathers ({tiny['delivered_share']:.0%})",
    ]
    d = r.get("through_the_daemon")
    if d:
        lines.append(
            f"  through the daemon, {d['relayers']} relayers + {d['junk_senders']} junk senders, {d['rounds']} rounds: "
            f"honest groups admitted in {d['honest_admitted_share']:.0%} of rounds, {d['attackers_quarantined']} of "
            f"{d['relayers'] + d['junk_senders']} attackers quarantined"
            + (f" (all after round {d['all_quarantined_after_rounds']})" if d["all_quarantined_after_rounds"] else "")
        )
    lines.append(f"  {r['seconds']:.0f} s")
    return "\n".join(lines)
