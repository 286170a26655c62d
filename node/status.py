"""What a node knows about itself: written by the round loop, read by the API.

The loop replaces whole snapshots under a lock and the API copies them out, so a reader
never sees a half-updated round.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

from pydantic import BaseModel, Field


class PeerStats(BaseModel):
    """Running totals for one peer, as this node saw it."""

    peer_id: str
    packets: int = 0
    groups_admitted: int = 0
    samples_admitted: int = 0
    samples_used: int = 0
    last_round: int | None = None
    last_seen: float | None = None
    rejected: dict[str, int] = Field(default_factory=dict)
    # Trust (node/trust.py): samples held against the peer by reason, its state and why,
    # and the first round it is heard again when quarantined.
    screened: dict[str, int] = Field(default_factory=dict)
    trust: str = "probation"
    trust_reason: str = ""
    quarantined_until: int | None = None
    # Off-policy diagnostics of the last round this peer's samples were trained on.
    offpolicy: dict[str, Any] = Field(default_factory=dict)


class RoundRecord(BaseModel):
    """One line of the per-round history."""

    round: int
    started_at: float
    seconds: float
    reward_mean: float
    own_samples: int
    peer_samples: int
    peers_answered: int
    metrics: dict[str, float] = Field(default_factory=dict)


class NodeStatus:
    """Thread-safe holder of the node's live state."""

    def __init__(self, *, name: str, model: str, task: str, loss: str, history: int = 500) -> None:
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.info: dict[str, Any] = {"name": name, "model": model, "task": task, "loss": loss}
        self.phase = "starting"
        self.round: int | None = None
        self.adapter_version: str | None = None
        self.history: deque[RoundRecord] = deque(maxlen=history)
        self.peers: dict[str, PeerStats] = {}
        self.rejected: Counter[str] = Counter()
        self.rejected_examples: dict[str, str] = {}
        self.swarm_errors: Counter[str] = Counter()  # our own DHT trouble (timeouts, pipe errors)

    def set(self, **info: Any) -> None:
        with self._lock:
            self.info.update(info)

    def set_phase(self, phase: str, round_: int | None = None) -> None:
        with self._lock:
            self.phase = phase
            if round_ is not None:
                self.round = round_

    def reject(self, peer_id: str | None, reason: str, detail: str = "", count: int = 1) -> None:
        """Count rejected things by reason (and by peer when known); keep one example per reason."""
        with self._lock:
            self.rejected[reason] += count
            if detail and reason not in self.rejected_examples:
                self.rejected_examples[reason] = detail[:300]
            if peer_id is not None:
                peer = self._peer(peer_id)
                peer.rejected[reason] = peer.rejected.get(reason, 0) + count

    def swarm_error(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self.swarm_errors[kind] += count

    def peer_update(self, peer_id: str, **fields: Any) -> None:
        """Add to a peer's counters (ints are added, other values replaced)."""
        with self._lock:
            peer = self._peer(peer_id)
            for key, value in fields.items():
                current = getattr(peer, key)
                if isinstance(value, int) and isinstance(current, int) and key != "last_round":
                    setattr(peer, key, current + value)
                else:
                    setattr(peer, key, value)

    def record_round(self, record: RoundRecord, adapter_version: str | None) -> None:
        with self._lock:
            self.history.append(record)
            self.adapter_version = adapter_version

    def _peer(self, peer_id: str) -> PeerStats:
        if peer_id not in self.peers:
            self.peers[peer_id] = PeerStats(peer_id=peer_id)
        return self.peers[peer_id]

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy of everything (what GET /status returns)."""
        with self._lock:
            last = self.history[-1].model_dump() if self.history else None
            return {
                **self.info,
                "phase": self.phase,
                "round": self.round,
                "adapter_version": self.adapter_version,
                "uptime_s": round(time.time() - self.started_at, 1),
                "rounds_done": len(self.history),
                "last_round": last,
                "rejected": dict(self.rejected),
                "rejected_examples": dict(self.rejected_examples),
                "swarm_errors": dict(self.swarm_errors),
                "peers": {pid: p.model_dump() for pid, p in self.peers.items()},
            }

    def history_dump(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.model_dump() for r in self.history]
