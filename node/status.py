"""What a node knows about itself: written by the round loop, read by the API.

The loop replaces whole snapshots under a lock and the API copies them out, so a reader
never sees a half-updated round.
"""

from __future__ import annotations

import json
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
    # From the newest packet's header (network data: shown escaped, never trusted).
    model: str | None = None
    adapter_version: str | None = None
    reward_mean: float | None = None  # its admitted samples of the last round, as re-scored here
    rejected: dict[str, int] = Field(default_factory=dict)
    # Trust (node/trust.py): samples held against the peer by reason, its state and why,
    # and the first round it is heard again when quarantined.
    screened: dict[str, int] = Field(default_factory=dict)
    trust: str = "probation"
    trust_reason: str = ""
    quarantined_until: int | None = None
    # Off-policy diagnostics of the last round this peer's samples were trained on.
    offpolicy: dict[str, Any] = Field(default_factory=dict)


class PeerRound(BaseModel):
    """One peer's part in one round, as this node saw it."""

    admitted: int = 0  # samples admitted
    used: int = 0  # samples trained on
    rejected: int = 0  # things rejected (records, groups, completions), all reasons
    reward_mean: float | None = None  # its admitted samples, re-scored here
    # The off-policy diagnostics of its samples in this round's step (is_weight_mean, frac_capped, ...).
    offpolicy: dict[str, float] = Field(default_factory=dict)


class RoundRecord(BaseModel):
    """One line of the per-round history."""

    round: int  # the DHT time bucket (or the local round number when solo)
    started_at: float
    seconds: float
    reward_mean: float
    own_samples: int
    peer_samples: int
    peers_answered: int
    metrics: dict[str, float] = Field(default_factory=dict)
    # Filled by NodeStatus.record_round from what was noted during the round.
    round_in_run: int | None = None  # 1 for the first round this process played
    gather_seconds: float | None = None
    bytes_published: int = 0
    bytes_read: int = 0
    dht_errors: int = 0
    rejected: dict[str, int] = Field(default_factory=dict)  # by reason
    peers: dict[str, PeerRound] = Field(default_factory=dict)


# The per-peer off-policy diagnostics kept in each round's record (scalars only: no histograms).
ROUND_OFFPOLICY_KEYS = (
    "is_weight_mean",
    "frac_capped",
    "ess",
    "frac_filtered",
    "mean_abs_delta",
    "kl_p10",
    "kl_p50",
    "kl_p90",
)


class _RoundNotes:
    """What the loop noted during the round in progress; drained into its RoundRecord."""

    def __init__(self) -> None:
        self.gather_seconds: float | None = None
        self.bytes_published = 0
        self.bytes_read = 0
        self.dht_errors = 0
        self.rejected: Counter[str] = Counter()
        self.peers: dict[str, PeerRound] = {}
        self.reward_sums: dict[str, tuple[float, int]] = {}

    def peer(self, peer_id: str) -> PeerRound:
        return self.peers.setdefault(peer_id, PeerRound())


class NodeStatus:
    """Thread-safe holder of the node's live state."""

    def __init__(self, *, name: str, model: str, task: str, loss: str, history: int = 500) -> None:
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.info: dict[str, Any] = {"name": name, "model": model, "task": task, "loss": loss}
        self.phase = "starting"
        self.round: int | None = None
        # Where the loop is inside its phase (e.g. {"done": 3, "total": 8} while generating),
        # since when, and which round of this run it is (1, 2, ...; `round` is the DHT bucket).
        self.phase_detail: dict[str, Any] = {}
        self.phase_since = time.time()
        self.round_in_run: int | None = None
        self.adapter_version: str | None = None
        self.history: deque[RoundRecord] = deque(maxlen=history)
        # Each record as JSON, made once when it is appended: the status file is rewritten every
        # round, and re-serialising up to `history` records each time cost ~30 ms at 500.
        self._history_json: deque[str] = deque(maxlen=history)
        self.peers: dict[str, PeerStats] = {}
        self.rejected: Counter[str] = Counter()
        self.rejected_examples: dict[str, str] = {}
        self.swarm_errors: Counter[str] = Counter()  # our own DHT trouble (timeouts, pipe errors)
        self.swarm_peers: list[dict[str, Any]] = []  # every peer the swarm layer knows of (GET /swarm)
        self.swarm_peers_at: float | None = None
        self.totals: Counter[str] = Counter()  # run totals: own samples, packet bytes published / read
        self._rounds_done = 0  # the history deque is bounded; this is not
        self._notes = _RoundNotes()

    def set(self, **info: Any) -> None:
        with self._lock:
            self.info.update(info)

    def set_phase(
        self, phase: str, round_: int | None = None, *, round_in_run: int | None = None, **detail: Any
    ) -> None:
        """Enter (or update) a phase; `detail` replaces the phase's progress detail."""
        with self._lock:
            if phase != self.phase or (round_ is not None and round_ != self.round):
                self.phase_since = time.time()
            self.phase = phase
            self.phase_detail = detail
            if round_ is not None:
                self.round = round_
            if round_in_run is not None:
                self.round_in_run = round_in_run

    def phase_view(self) -> dict[str, Any]:
        """The few fields a progress line needs, without copying peers and history."""
        with self._lock:
            return {
                "phase": self.phase,
                "round": self.round,
                "round_in_run": self.round_in_run,
                "phase_detail": dict(self.phase_detail),
                "phase_since": self.phase_since,
            }

    def reject(self, peer_id: str | None, reason: str, detail: str = "", count: int = 1) -> None:
        """Count rejected things by reason (and by peer when known); keep one example per reason."""
        with self._lock:
            self.rejected[reason] += count
            self._notes.rejected[reason] += count
            if detail and reason not in self.rejected_examples:
                self.rejected_examples[reason] = detail[:300]
            if peer_id is not None:
                peer = self._peer(peer_id)
                peer.rejected[reason] = peer.rejected.get(reason, 0) + count
                self._notes.peer(peer_id).rejected += count

    def swarm_error(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self.swarm_errors[kind] += count
            self._notes.dht_errors += count

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
            notes = self._notes.peer(peer_id)
            notes.admitted += fields.get("samples_admitted", 0)
            notes.used += fields.get("samples_used", 0)
            if isinstance(fields.get("offpolicy"), dict):
                offpolicy = fields["offpolicy"]
                notes.offpolicy = {k: float(offpolicy[k]) for k in ROUND_OFFPOLICY_KEYS if k in offpolicy}

    def peer_rewards(self, peer_id: str, rewards: list[float]) -> None:
        """Rewards of a peer's admitted samples, as this node's verifier scored them."""
        if not rewards:
            return
        with self._lock:
            total, n = self._notes.reward_sums.get(peer_id, (0.0, 0))
            total, n = total + float(sum(rewards)), n + len(rewards)
            self._notes.reward_sums[peer_id] = (total, n)
            self._notes.peer(peer_id).reward_mean = self._peer(peer_id).reward_mean = total / n

    def round_io(self, *, bytes_published: int = 0, bytes_read: int = 0, gather_seconds: float | None = None) -> None:
        """Note the round's traffic: packet bytes published and read, time spent gathering."""
        with self._lock:
            self._notes.bytes_published += bytes_published
            self._notes.bytes_read += bytes_read
            self.totals["bytes_published"] += bytes_published
            self.totals["bytes_read"] += bytes_read
            if gather_seconds is not None:
                self._notes.gather_seconds = (self._notes.gather_seconds or 0.0) + gather_seconds

    def set_swarm_peers(self, peers: list[dict[str, Any]]) -> None:
        """The swarm layer's list of every peer it knows of (from the DHT records)."""
        with self._lock:
            self.swarm_peers = [dict(p) for p in peers]
            self.swarm_peers_at = time.time()

    def record_round(self, record: RoundRecord, adapter_version: str | None) -> None:
        """Append a finished round, with what was noted during it (traffic, per-peer counts)."""
        with self._lock:
            notes, self._notes = self._notes, _RoundNotes()
            self._rounds_done += 1
            self.totals["own_samples"] += record.own_samples
            noted = {
                "round_in_run": self._rounds_done,
                "gather_seconds": notes.gather_seconds,
                "bytes_published": notes.bytes_published,
                "bytes_read": notes.bytes_read,
                "dht_errors": notes.dht_errors,
                "rejected": dict(notes.rejected),
                "peers": notes.peers,
            }
            # Fields the caller set explicitly win over what was noted.
            record = record.model_copy(update={k: v for k, v in noted.items() if k not in record.model_fields_set})
            self.history.append(record)
            self._history_json.append(record.model_dump_json())
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
                "phase_detail": dict(self.phase_detail),
                "phase_since": self.phase_since,
                "round": self.round,
                "round_in_run": self.round_in_run,
                "adapter_version": self.adapter_version,
                "uptime_s": round(time.time() - self.started_at, 1),
                "rounds_done": self._rounds_done,
                "last_round": last,
                "rejected": dict(self.rejected),
                "rejected_examples": dict(self.rejected_examples),
                "swarm_errors": dict(self.swarm_errors),
                "peers": {pid: p.model_dump() for pid, p in self.peers.items()},
                **self._observed(),
            }

    def _observed(self) -> dict[str, Any]:
        """Run totals and the clock, for /metrics, the dashboard's countdown and `ftis-node status`."""
        return {
            "totals": {k: self.totals.get(k, 0) for k in ("own_samples", "bytes_published", "bytes_read")},
            "swarm_size": len(self.swarm_peers),
            "server_time": time.time(),
        }

    def swarm_dump(self) -> dict[str, Any]:
        """What GET /swarm returns: the swarm layer's peers, or those heard from when it lists none."""
        with self._lock:
            if self.swarm_peers_at is not None:
                return {
                    "source": "dht",
                    "updated_at": self.swarm_peers_at,
                    "peers": [dict(p) for p in self.swarm_peers],
                }
            heard = [
                {
                    "peer_id": p.peer_id,
                    "model": p.model,
                    "adapter_version": p.adapter_version,
                    "round": p.last_round,
                    "size": None,
                    "last_seen": p.last_seen,
                }
                for p in self.peers.values()
                if p.last_seen is not None
            ]
            return {"source": "gathered", "updated_at": None, "peers": heard}

    def history_dump(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.model_dump() for r in self.history]

    def file_text(self) -> str:
        """The status file: the snapshot and the history, one round per line (records serialised once)."""
        head = json.dumps(self.snapshot(), indent=1, default=str)
        with self._lock:
            rounds = ",\n  ".join(self._history_json)
        return f'{head[:-2]},\n "history": [\n  {rounds}\n ]\n}}\n' if rounds else f'{head[:-2]},\n "history": []\n}}\n'
