"""A node's default seed comes from its identity: one seed on every node would make a swarm
of copies (the same prompts, the same samples). The identity key lives in the data dir, so
a resumed node goes on with the stream it had; a solo node makes and keeps a key there too.
`--seed` pins it (the experiment, tests and benches do)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path


def seed_of_peer(peer_id: str) -> int:
    """31 bits of sha256(peer id), the same in every process."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") >> 1


def identity_seed(swarm, node_dir: Path) -> tuple[int, str]:
    """The seed and the peer id it comes from: the swarm's, or (solo) the data dir's key."""
    if swarm is not None:
        peer_id = swarm.peer_id
    else:
        from node.swarm.identity import NodeIdentity

        node_dir.mkdir(parents=True, exist_ok=True)
        identity = NodeIdentity.acquire(node_dir / "identity.key")
        try:
            peer_id = identity.peer_id
        finally:
            identity.release()
    return seed_of_peer(peer_id), peer_id


def round_rng(seed: int | None, purpose: str, r: int) -> random.Random:
    """A generator that depends only on (seed, purpose, round): a resumed node draws what it
    would have drawn, and a node that mixes in peers' samples draws the same prompts as one
    that trains alone (str seeds hash with SHA-512, stable across processes)."""
    return random.Random(f"{seed}/{purpose}/{r}")
