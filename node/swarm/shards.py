"""Shard keys: where a peer's header goes, which shards a node reads, how big the swarm is.

A round's headers are spread over S shard keys, `ftis/<swarm>/<round>/<shard>`, with
shard = hash(peer id) mod S and S a power of two. Powers of two nest (h mod S/2 is
(h mod S) mod S/2), so nodes whose S differ still agree on most placements; a reader
tolerates writers with another S: it only needs enough headers, not all of them.

S comes from a setting (`SwarmConfig.shards`) or, with 0 there, from the swarm-size
estimate of this node's last gathers (`SizeEstimate`): S = the largest power of two
<= N / shard_target, so a shard holds about shard_target headers whatever N is. A small
swarm has S = 1: everyone reads the one key and sees everyone.
"""

from __future__ import annotations

import hashlib
import random
import statistics
from collections import deque
from collections.abc import Iterable

from protocol.keys import round_key

__all__ = ["MAX_SHARDS", "SizeEstimate", "read_order", "shard_count", "shard_key", "shard_of"]

MAX_SHARDS = 1 << 12  # bounds the key space a reader may be sent to, and HeaderRecord.shards


def shard_key(swarm_id: str, round: int, shard: int) -> str:
    """The DHT key of one shard of one round."""
    return f"{round_key(swarm_id, round)}/{shard}"


def _peer_hash(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")


def shard_of(peer_id: str, shards: int) -> int:
    """The shard a peer's header goes to when the swarm uses `shards` shards."""
    if shards < 1 or shards & (shards - 1):
        raise ValueError(f"shards must be a power of two >= 1, got {shards}")
    return _peer_hash(peer_id) % shards


def shard_count(swarm_size: float, shard_target: int, max_shards: int = MAX_SHARDS) -> int:
    """The power of two S with about `shard_target` peers per shard for a swarm of `swarm_size`."""
    s = 1
    while s * 2 <= min(swarm_size / max(shard_target, 1), max_shards):
        s *= 2
    return s


def read_order(peer_id: str, round: int, shards: int) -> list[int]:
    """The shards a node reads for a round, in order: its own first, then the others shuffled.

    The shuffle is seeded by (peer, round): different nodes sample different shards, and
    one node samples different ones each round, so views mix across the swarm.
    """
    own = shard_of(peer_id, shards)
    others = [s for s in range(shards) if s != own]
    random.Random(f"{peer_id}/{round}").shuffle(others)
    return [own, *others]


class SizeEstimate:
    """How many peers the swarm has, from the headers a node saw in the shards it read.

    A header from a writer that used S shards stands for S writers spread over S shards,
    of which this node read `n` (those below S): it counts S / n (the Horvitz-Thompson
    estimate). The median of the last few gathers smooths single-round noise.
    """

    def __init__(self, window: int = 5) -> None:
        self._recent: deque[float] = deque(maxlen=window)

    def add(self, shards_read: Iterable[int], writer_shards: Iterable[int]) -> float:
        """Record one gather: the shard indices read, and each seen header's declared S; returns the estimate."""
        read = sorted(set(shards_read))
        total = 1.0  # this node
        for s in writer_shards:
            n = sum(1 for i in read if i < s)
            if n:
                total += s / n
        self._recent.append(total)
        return total

    @property
    def value(self) -> float:
        recent = list(self._recent)  # one C-level copy: safe against an add() in another thread
        return statistics.median(recent) if recent else 1.0
