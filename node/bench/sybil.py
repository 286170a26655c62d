"""Share capture: what many clean identities take of a node's peer samples (docs/security.md).

Free identities that send clean samples are not caught by the screen: what limits them is
how a batch is shared out (`mix_groups`: trusted peers first, all peers on probation
together within `probation_share`) and how a peer earns trust (`TrustBook`: clean rounds
AND groups trained on). This plays those two, the node's own, round by round at a node's
default batch: the victim's own groups, one honest trusted peer and `sybils` new
identities that each offer as many clean groups as the victim makes. The samples are
clean by construction (no model runs): the screen is not what is measured here.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np

from node.defence.trust import TrustBook, TrustConfig
from node.groups import SELF, ScoredGroup, ScoredSequence, mix_groups

__all__ = ["measure_share_capture"]


def _groups(source: str, n: int, size: int, round_: int) -> list[ScoredGroup]:
    def seq(i: int) -> ScoredSequence:
        return ScoredSequence([3 + i], np.zeros(1, np.float32), float(i % 2))

    return [
        ScoredGroup(source, f"r{round_}-{source}-{k}", "m", [1], 1.0, 0, 1.0, [seq(i) for i in range(size)])
        for k in range(n)
    ]


def measure_share_capture(
    *,
    rounds: int = 20,
    sybils: int = 5,
    own_groups: int = 8,
    honest_groups: int = 8,
    group_size: int = 12,
    peer_share: float = 0.5,
    probation_share: float | None = None,
    trust: TrustConfig | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Share of the victim's peer samples the Sybils took, per round and over `rounds`."""
    from node.config import NodeConfig

    defaults = NodeConfig()
    book = TrustBook(trust or defaults.trust_config)
    share = defaults.probation_share if probation_share is None else probation_share
    rng = random.Random(seed)
    honest = "honest"
    book.credit(honest, book.cfg.trust_groups)  # an old member of the swarm: trusted before the Sybils come
    for r in range(-book.cfg.probation_rounds, 0):
        book.observe(honest, r, 1, Counter())
        book.end_round(r)
    names = [f"sybil{i}" for i in range(sybils)]
    by_round: list[float] = []
    trusted_at: dict[str, int] = {}
    sybil_total, peer_total = 0, 0
    for r in range(rounds):
        peers = _groups(honest, honest_groups, group_size, r)
        for name in names:
            peers += _groups(name, own_groups, group_size, r)
            book.observe(name, r, own_groups * group_size, Counter())  # every sample clean
        book.observe(honest, r, honest_groups * group_size, Counter())
        used, _ = mix_groups(
            _groups(SELF, own_groups, group_size, r),
            peers,
            peer_share,
            rng,
            trusted=book.trusted(),
            probation_share=share,
            served=book.served(),
        )
        taken = Counter(g.source for g in used if g.source != SELF)
        for source, n in taken.items():
            book.credit(source, n)
        book.end_round(r)
        seqs = {s: n * group_size for s, n in taken.items()}
        from_sybils = sum(v for s, v in seqs.items() if s != honest)
        by_round.append(round(from_sybils / max(sum(seqs.values()), 1), 4))
        sybil_total += from_sybils
        peer_total += sum(seqs.values())
        trusted_at |= {n: r for n in names if n not in trusted_at and book.get(n).state == "trusted"}
    return {
        "rounds": rounds,
        "sybils": sybils,
        "sybil_share_of_peer_samples": round(sybil_total / max(peer_total, 1), 4),
        "sybil_share_by_round": by_round,
        "sybils_trusted_at_round": min(trusted_at.values()) if trusted_at else None,
        "settings": {
            "own_groups": own_groups,
            "honest_groups": honest_groups,
            "group_size": group_size,
            "peer_share": peer_share,
            "probation_share": share,
            "probation_rounds": book.cfg.probation_rounds,
            "trust_groups": book.cfg.trust_groups,
        },
    }
