"""What a node knows about itself: written by the round loop, read by the API.

The loop replaces whole snapshots under a lock and the API copies them out, so a reader
never sees a half-updated round.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict, deque
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

# Failures of the network (a fetch or DHT call that did not complete), as opposed to content a
# peer sent that was judged and refused: the first say "check the link", the second "check the peer".
NETWORK_FAILURES = frozenset(
    {"fetch_timeout", "fetch_failed", "body_not_found", "dht_timeout", "dht_error", "dht_down"}
)
# A peer with no header in this many recent rounds no longer counts as part of the swarm.
ACTIVE_ROUNDS = 3


class PeerStats(BaseModel):
    """Running totals for one peer, as this node saw it."""

    peer_id: str
    packets: int = 0
    groups_admitted: int = 0
    samples_admitted: int = 0
    samples_used: int = 0
    tail_tokens_cut: int = 0  # tokens after its answers' closing tags, not trained on (node/defence/admission.py)
    last_round: int | None = None
    last_seen: float | None = None
    # From the newest packet's header (network data: shown escaped, never trusted).
    name: str | None = None  # its --name: a label it chose, not an identity
    model: str | None = None
    adapter_version: str | None = None
    reward_mean: float | None = None  # its admitted samples of the last round, as re-scored here
    rejected: dict[str, int] = Field(default_factory=dict)
    # Trust (node/defence/trust.py): samples held against the peer by reason, its state and why,
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
    rejected: dict[str, int] = Field(default_factory=dict)  # by reason (network failures of fetches too)
    network_failures: dict[str, int] = Field(default_factory=dict)  # by kind: fetches and DHT calls
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
        self.network: Counter[str] = Counter()
        self.phase_seconds: defaultdict[str, float] = defaultdict(float)  # time spent in each phase of the round
        self.peers: dict[str, PeerRound] = {}
        self.reward_sums: dict[str, tuple[float, int]] = {}

    def peer(self, peer_id: str) -> PeerRound:
        return self.peers.setdefault(peer_id, PeerRound())


class NodeStatus:
    """Thread-safe holder of the node's live state."""

    def __init__(self, *, name: str, model: str, task: str, loss: str, history: int = 500) -> None:
        self._lock = threading.Lock()
        self.started_at = time.time()
        # pid and process start: a reader of status.json can tell a node that died from a live one.
        self.info: dict[str, Any] = {"name": name, "model": model, "task": task, "loss": loss, **process_marker()}
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
        self.network: Counter[str] = Counter()  # every network failure by kind (fetches and DHT calls)
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
                now = time.time()
                self._notes.phase_seconds[self.phase] += now - self.phase_since
                self.phase_since = now
            self.phase = phase
            self.phase_detail = detail
            if round_ is not None:
                self.round = round_
            if round_in_run is not None:
                self.round_in_run = round_in_run

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each phase since the last recorded round, the current phase included."""
        with self._lock:
            spent = defaultdict(float, self._notes.phase_seconds)
            spent[self.phase] += time.time() - self.phase_since
            return dict(spent)

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
            if reason in NETWORK_FAILURES:
                self.network[reason] += count
                self._notes.network[reason] += count
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
            self.network[kind] += count
            self._notes.network[kind] += count

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

    def set_swarm_peers(self, peers: list[dict[str, Any]], current_round: int | None = None) -> None:
        """The swarm layer's list of every peer it knows of (from the DHT records). With
        `current_round`, each is marked `active` if it published in the last ACTIVE_ROUNDS rounds."""
        with self._lock:
            self.swarm_peers = [
                dict(p)
                | (
                    {"active": isinstance(p.get("round"), int) and p["round"] > current_round - ACTIVE_ROUNDS}
                    if current_round is not None
                    else {}
                )
                for p in peers
            ]
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
                "network_failures": dict(notes.network),
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
                "failures": self._failures(),
                "peers": {pid: p.model_dump() for pid, p in self.peers.items()},
                **self._observed(),
            }

    def _failures(self) -> dict[str, Any]:
        """Network failures and content rejections apart, each by kind: run totals and per-round rates."""
        rounds = max(self._rounds_done, 1)
        content = {k: v for k, v in self.rejected.items() if k not in NETWORK_FAILURES}
        return {
            "network": dict(self.network),
            "content": content,
            "network_per_round": {k: round(v / rounds, 3) for k, v in self.network.items()},
            "content_per_round": {k: round(v / rounds, 3) for k, v in content.items()},
        }

    def failure_lines(self) -> list[str]:
        """For the console after each round: the kinds that failed in the round just recorded,
        with how many this round, the run total and the rate per round."""
        with self._lock:
            if not self.history:
                return []
            last, rounds = self.history[-1], max(self._rounds_done, 1)
            content_now = {k: v for k, v in last.rejected.items() if k not in NETWORK_FAILURES}
            lines = []
            for title, now, totals in (
                ("network failures", last.network_failures, self.network),
                ("rejected", content_now, self.rejected),
            ):
                if now:
                    parts = [
                        f"{k} {n} (run {totals[k]}, {totals[k] / rounds:.2g}/round)" for k, n in sorted(now.items())
                    ]
                    lines.append(f"{title}: " + ", ".join(parts))
            return lines

    def _observed(self) -> dict[str, Any]:
        """Run totals and the clock, for /metrics, the dashboard's countdown and `ftis-node status`."""
        return {
            "totals": {k: self.totals.get(k, 0) for k in ("own_samples", "bytes_published", "bytes_read")},
            # Peers still publishing (a peer that stopped drops out after ACTIVE_ROUNDS rounds).
            "swarm_size": sum(1 for p in self.swarm_peers if p.get("active", True)),
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
                    "name": p.name,
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

    def write_file(self, path: Path) -> None:
        """`file_text` to `path`, atomically (a reader never sees half a file)."""
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.file_text())
        os.replace(tmp, path)

    def file_text(self) -> str:
        """The status file: the snapshot and the history, one round per line (records serialised once)."""
        head = json.dumps(self.snapshot() | {"written_at": time.time()}, indent=1, default=str)
        with self._lock:
            rounds = ",\n  ".join(self._history_json)
        return f'{head[:-2]},\n "history": [\n  {rounds}\n ]\n}}\n' if rounds else f'{head[:-2]},\n "history": []\n}}\n'


# ---------------------------------------------------------------- status.json of a node that may be gone


def _start_ticks(pid: int) -> int | None:
    """When a process started (clock ticks since boot), so a reused pid is not taken for the node."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_marker() -> dict[str, Any]:
    return {"pid": os.getpid(), "pid_started": _start_ticks(os.getpid())}


def process_alive(pid: Any, started: Any) -> bool:
    """The process that wrote a status file still runs (same pid, same start time where known)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    now = _start_ticks(pid)
    if now is not None:
        return started is None or now == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def read_status_file(path: Path) -> dict[str, Any]:
    """A node's `status.json` as what is true now: if the node that wrote it no longer runs,
    its phase is "stopped" (`running` False, `phase_at_exit` the phase it was in when it died).

    Raises OSError or ValueError if the file cannot be read as a JSON object.
    """
    status = json.loads(Path(path).read_text())
    if not isinstance(status, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    running = process_alive(status.get("pid"), status.get("pid_started"))
    status["running"] = running
    if not running and status.get("phase") != "stopped":
        status["phase_at_exit"] = status.get("phase")
        status["phase"] = "stopped"
        status["phase_detail"] = {"note": "not running: the node was killed or crashed"}
    return status
