"""One gather: read a few shard keys, judge the headers, fetch at most k bodies, until a deadline.

The state machine, one pass per poll interval:

    read shard keys ─▶ judge headers ─▶ candidates ─▶ fetch (≤ k slots, byte budget) ─▶ deliver
         ▲                                  │  a failed fetch frees its slot and budget,   │
         └── more shards while too few ◀────┘  the next candidate gets them              │
                                                                                         ▼
                                                       done: k delivered, expect_peers, or the deadline

A fetch still running at the deadline is not given up: it keeps its own time budget
(`FetchBudget`: from how long that peer's fetches took, not from what is left of the
window) and the next gather collects it ("late"), so a slow but live peer's packet joins
the next round's mix (one round stale, which admission accepts) instead of being dropped.
Late fetches hold none of the new gather's slots or bytes (the gather that started them
paid for them), so a peer that never answers costs the next round nothing but a look.
A gather that ends early (enough peers) leaves its unfinished fetches unjudged instead:
the next gather judges those headers afresh.

What a node reads per round does not grow with the swarm: its own shard plus a bounded
random sample of others (`GatherPlan.order`), re-read only while fetch slots are free,
and at most `max_peers` bodies. Nothing from the network raises: it is counted in the
`GatherResult`, each rejection under the peer id its signing key proves.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hivemind.utils import MPFuture, MSGPackSerializer
from pydantic import ValidationError

from node.swarm.client import RecordClient
from node.swarm.dht import SwarmConfig
from node.swarm.errors import DHTUnavailableError
from node.swarm.ledger import GatherLedger, KnownPeers
from node.swarm.record import HeaderRecord, RejectReason, owner_label, peer_id_of_owner
from node.swarm.shards import shard_key, shard_of

__all__ = ["BodyCheck", "FetchBudget", "GatherPlan", "GatherResult", "GatherRun", "GatheredPacket"]

logger = logging.getLogger(__name__)

#: (signer, body) -> a reason to refuse the body before it is delivered, or None.
BodyCheck = Callable[[str, bytes], str | None]

#: Bodies up to this size are one size class in the fetch order (a fetch of well under a second).
SIZE_CLASS_FLOOR = 1 << 20
SIGNATURE_BYTES = 356  # "[signature:<base64 of an RSA-2048 signature>]", stripped before we see a value
_DOWN = (DHTUnavailableError, OSError, EOFError, ValueError)  # no DHT process to ask


class GatheredPacket(NamedTuple):
    """One accepted packet: unpacks as `peer_id, round, data`."""

    peer_id: str  # proven by the key that signed its slot
    round: int
    data: bytes


@dataclass
class GatherResult:
    packets: list[GatheredPacket] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    rejected_by_peer: dict[str, dict[str, int]] = field(default_factory=dict)  # peer -> reason -> count
    errors: dict[str, int] = field(default_factory=dict)  # our own DHT trouble: dht_timeout, dht_error, dht_down
    skipped: int = 0  # headers of excluded (quarantined) peers, neither fetched nor judged
    unselected: int = 0  # valid headers left unfetched because max_peers bodies were taken
    bytes_read: int = 0  # DHT values (headers as received) plus bodies fetched, this gather
    headers_read: int = 0  # DHT entries received (one header counts again each time a poll re-reads it)
    reads: int = 0  # DHT gets sent
    fetches: int = 0  # body fetches started
    carried: int = 0  # fetches still running at the deadline, left to the next gather (not failures)
    late: int = 0  # packets delivered by fetches an earlier gather started (their round may be older)
    shards_read: list[int] = field(default_factory=list)  # shard indices of the round that answered
    polls: int = 0
    elapsed_s: float = 0.0

    @property
    def peers(self) -> set[str]:
        return {p.peer_id for p in self.packets}

    @property
    def total_bytes(self) -> int:
        return sum(len(p.data) for p in self.packets)


@dataclass(frozen=True)
class GatherPlan:
    """What one gather reads and how much it may take."""

    round: int
    stale: tuple[int, ...]  # earlier rounds, read once at the start
    order: tuple[int, ...]  # shard indices in read order, own shard first
    first_reads: int  # shards read from the start (own + sample)
    max_reads: int  # at most this many shards per round, however few headers they hold
    deadline: float  # time.monotonic() at which the gather ends
    expect_peers: int | None
    max_peers: int  # k: bodies fetched at most
    max_packet_bytes: int
    max_total_bytes: int
    exclude: frozenset[str] = frozenset()
    trusted: frozenset[str] = frozenset()  # fetched first, and `trusted_slots` of k are kept for them

    def trusted_slots(self) -> int:
        """Slots new identities cannot take: a quarter of k, while any peer is trusted."""
        return min(max(1, self.max_peers // 4), len(self.trusted))


@dataclass
class _Candidate:
    round: int
    peer: str
    record: HeaderRecord
    order: tuple[Any, ...]  # sort key: recent fetch failures last, trusted first, big last, then a per-node shuffle


@dataclass
class _Fetch:
    future: MPFuture
    candidate: _Candidate
    gather: int = 0  # which gather started it (GatherRun.serial)


class FetchBudget:
    """How long a body fetch from a peer may take: TCP's retransmission-timeout rule, per peer.

    From the durations of that peer's fetches (timed in the DHT process): srtt + 4 * rttvar,
    at least the static `base_s + size / min_rate`, at most `max_s`. Each timeout doubles the
    peer's budget until a fetch succeeds (a far peer's first fetch may need several tries,
    each from a later gather). Not cut to the gather window: a fetch outlives its gather.
    """

    def __init__(self, base_s: float, min_rate: float, max_s: float, max_peers: int = 1024) -> None:
        self.base_s, self.min_rate, self.max_s, self.max_peers = base_s, min_rate, max_s, max_peers
        self._peers: dict[str, tuple[float, float, int]] = {}  # peer -> (srtt, rttvar, timeouts in a row)

    def budget(self, peer: str, size: int) -> float:
        floor = self.base_s + size / self.min_rate
        srtt, rttvar, timeouts = self._peers.get(peer, (0.0, 0.0, 0))
        return min(self.max_s, max(floor, srtt + 4 * rttvar) * 2**timeouts)

    def observe(self, peer: str, seconds: float, timed_out: bool) -> None:
        srtt, rttvar, timeouts = self._peers.pop(peer, (0.0, 0.0, 0))
        if timed_out:
            self._peers[peer] = (srtt, rttvar, min(timeouts + 1, 8))
        elif srtt == 0.0:
            self._peers[peer] = (seconds, seconds / 2, 0)
        else:  # RFC 6298's gains
            rttvar = 0.75 * rttvar + 0.25 * abs(srtt - seconds)
            self._peers[peer] = (0.875 * srtt + 0.125 * seconds, rttvar, 0)
        while len(self._peers) > self.max_peers:  # least recently used first
            del self._peers[next(iter(self._peers))]

    def __contains__(self, peer: str) -> bool:
        return peer in self._peers


class GatherRun:
    """The state of one `gather` call; `run()` once."""

    def __init__(
        self,
        client: RecordClient,
        config: SwarmConfig,
        swarm_id: str,
        self_peer: str,
        plan: GatherPlan,
        ledger: GatherLedger,
        known: KnownPeers,
        log_once: Callable[..., None],
        on_progress: Callable[[int], None] | None = None,
        *,
        budget: FetchBudget | None = None,
        carried: list[_Fetch] | None = None,
        serial: int = 0,
        body_check: BodyCheck | None = None,
    ) -> None:
        """`on_progress(n)`: called when the number of peers delivered so far changes (a live view).

        `carried`: fetches an earlier gather left running; after `run()`, `self.carry` holds
        those this one leaves to the next. `serial` numbers the gathers.
        """
        self.client, self.cfg, self.swarm_id, self.me, self.plan = client, config, swarm_id, self_peer, plan
        self.on_progress, self._reported = on_progress, 0
        self.ledger, self.known, self.log_once = ledger, known, log_once
        self.started = time.monotonic()
        self.result = GatherResult()
        self.rejected: Counter[str] = Counter()
        self.by_peer: dict[str, Counter[str]] = defaultdict(Counter)
        self.errors: Counter[str] = Counter()
        self.reading = list(plan.order[: plan.first_reads])  # shards of plan.round polled each pass
        self.gets: dict[str, tuple[MPFuture, float, int, int]] = {}  # key -> (future, sent at, round, shard)
        self.answered: set[tuple[int, int]] = set()  # (round, shard) with at least one answer
        self.stale_sent = False
        self.candidates: dict[tuple[int, str], _Candidate] = {}
        self.budget = budget or FetchBudget(config.fetch_base_s, config.fetch_min_bytes_per_s, config.fetch_timeout_s)
        self.serial = serial
        self.body_check = body_check
        self.fetches: list[_Fetch] = []
        self.delivered: set[str] = set()
        self.reserved_bytes = 0  # accepted plus in-flight fetches
        self.skipped: set[tuple[int, str]] = set()
        self.writer_shards: dict[str, int] = {}  # peer -> S it declared, headers of plan.round (for the estimate)
        self.dht_down = False  # nothing more can arrive: end the gather now
        oldest = plan.round - len(plan.stale)  # an older round has left the window: admission would refuse it
        self.late = [f for f in carried or () if f.candidate.round >= oldest]
        self.carry: list[_Fetch] = []

    # ------------------------------------------------------------ the loop

    def remaining(self) -> float:
        return max(0.0, self.plan.deadline - time.monotonic())

    def slots(self) -> int:
        return self.plan.max_peers - len(self.delivered) - len(self.fetches)

    def untrusted_slots(self) -> int:
        """Free slots a peer not yet trusted may take: k less the trusted peers' reserve."""
        trusted = self.plan.trusted
        holders = [*self.delivered, *(f.candidate.peer for f in self.fetches)]
        held = sum(p not in trusted for p in holders)
        return min(self.slots(), self.plan.max_peers - self.plan.trusted_slots() - held)

    def done(self) -> bool:
        p = self.plan
        enough = p.expect_peers is not None and len(self.delivered) >= min(p.expect_peers, p.max_peers)
        return enough or len(self.delivered) >= p.max_peers or self.dht_down or self.remaining() <= 0

    def run(self) -> GatherResult:
        while True:
            until = time.monotonic() + min(self.remaining(), self.cfg.poll_interval_s)
            if self.slots() > 0:  # every slot busy: nothing a read could add yet
                self._send_reads()
            self._collect_reads(until)
            self._schedule()
            self._collect_fetches(until)
            self._schedule()
            self._widen()
            if self.on_progress is not None and len(self.delivered) != self._reported:
                self._reported = len(self.delivered)
                self.on_progress(self._reported)
            if self.done():
                break
            time.sleep(max(0.0, until - time.monotonic()))
        self._settle_unfinished()
        return self._finish()

    def _finish(self) -> GatherResult:
        # A read sent just before the deadline is no fault; one older than a DHT request timeout is.
        now = time.monotonic()
        stuck = [sent for _, sent, _, _ in self.gets.values() if now - sent > self.cfg.rpc_timeout_s]
        if stuck:
            self.errors["dht_timeout"] += len(stuck)
            self.log_once("dht_timeout", "DHT reads got no answer within %.1f s", self.cfg.rpc_timeout_s)
        # Out of time with a candidate still waiting for budget: counted, but not final (a later
        # gather judges it again). Ended early (enough peers): the rest was simply not needed.
        timed_out = self.remaining() <= 0 and not self.dht_down
        waiting = [c for c in self.candidates.values() if timed_out and self._fits(c) is False]
        for c in waiting:
            self._count(c.peer, RejectReason.OVER_BUDGET)
        res = self.result
        res.unselected = len(self.candidates) - len(waiting)
        res.skipped = len(self.skipped)
        res.shards_read = sorted(s for r, s in self.answered if r == self.plan.round)
        res.rejected = dict(self.rejected)
        res.rejected_by_peer = {peer: dict(c) for peer, c in self.by_peer.items()}
        res.errors = dict(self.errors)
        res.elapsed_s = now - self.started
        return res

    # ------------------------------------------------------------ reading the DHT

    def _keys_to_read(self) -> list[tuple[str, int, int]]:
        p = self.plan
        keys = [(shard_key(self.swarm_id, p.round, s), p.round, s) for s in self.reading]
        if not self.stale_sent:  # a late packet of an earlier round: looked for once, not every pass
            self.stale_sent = True
            first = p.order[: p.first_reads]
            keys += [(shard_key(self.swarm_id, r, s), r, s) for r in p.stale for s in first]
        return keys

    def _send_reads(self) -> None:
        sent = False
        for key, r, s in self._keys_to_read():
            if key in self.gets:  # a read still in flight is waited for, not doubled
                continue
            try:
                self.gets[key] = (self.client.get(key), time.monotonic(), r, s)
            except _DOWN as e:
                self._down(e)
                return
            self.result.reads += 1
            sent = True
        self.result.polls += sent

    def _collect_reads(self, until: float) -> None:
        for key, (future, _, r, s) in list(self.gets.items()):
            if self.dht_down:
                return
            try:
                found = future.result(timeout=max(0.0, until - time.monotonic()))
            except TimeoutError:
                continue
            except Exception as e:  # hivemind re-raises whatever failed inside the DHT process
                del self.gets[key]
                self.errors["dht_error"] += 1
                self.log_once("dht_error", "a DHT read failed: %r", e)
                continue
            del self.gets[key]
            self.answered.add((r, s))
            entries = getattr(found, "value", None)
            if found is None or not isinstance(entries, dict):
                continue  # nobody published there yet (regular values never pass the validators)
            for owner, item in entries.items():
                if not isinstance(owner, bytes):
                    continue
                value = getattr(item, "value", None)
                self.result.headers_read += 1
                self.result.bytes_read += _entry_bytes(owner, value)  # our own header was read too
                if peer_id_of_owner(owner) != self.me:
                    self._judge(r, s, owner, value)

    def _widen(self) -> None:
        """Too few candidates in the shards read so far: read more (up to max_reads).

        Shards hold about shard_target headers each when S follows the swarm size, so this
        only happens in a swarm smaller than k or one whose S is set too high for it; its
        shards are then (nearly) empty and cheap to read.
        """
        p = self.plan
        if any(r == p.round for _, _, r, _ in self.gets.values()):
            return  # wait for this pass's answers first
        if not all((p.round, s) in self.answered for s in self.reading):
            return
        have = len(self.candidates) + len(self.fetches) + len(self.delivered)
        limit = min(p.max_reads, len(p.order))
        if have < p.max_peers and len(self.reading) < limit:  # doubling: a sparse swarm is covered in a few passes
            self.reading = list(p.order[: min(2 * len(self.reading), limit)])

    # ------------------------------------------------------------ judging headers

    def _judge(self, r: int, shard: int, owner: bytes, value: Any) -> None:
        peer = owner_label(owner)
        try:
            record = HeaderRecord.from_wire(value)
        except (ValidationError, ValueError):
            try:
                content = hashlib.sha256(MSGPackSerializer.dumps(value)).digest()
            except Exception:  # not even re-serialisable: judge it by owner alone
                content = b""
            if not self.ledger.judged(r, peer, content):
                self._reject(r, peer, content, RejectReason.BAD_RECORD)
            return
        content = record.sha256
        if (r, peer) in self.candidates or (r, peer) in self._in_flight():
            return  # already waiting for a slot or in flight
        if self.ledger.judged(r, peer, content):
            return
        if record.peer != peer:  # signed by one key, claims another peer's id
            self._reject(r, peer, content, RejectReason.IMPERSONATION)
        elif record.round != r:
            self._reject(r, peer, content, RejectReason.ROUND_MISMATCH)
        elif shard_of(peer, record.shards) != shard:
            self._reject(r, peer, content, RejectReason.WRONG_SHARD)
        else:
            # A quarantined peer is still in the swarm view; its packet is just not fetched.
            self.known.saw(peer, round=r, model=record.model, adapter_version=record.adapter, size=record.size)
            if peer in self.plan.exclude:
                self.skipped.add((r, peer))
                return
            if r == self.plan.round:
                self.writer_shards[peer] = record.shards
            reason = self.ledger.verdict(r, peer, content, bodies_checked=self.body_check is not None)
            if reason is not None:
                self._reject(r, peer, content, reason)
            elif record.size > self.plan.max_packet_bytes:
                self._reject(r, peer, content, RejectReason.OVER_PACKET_LIMIT)
            else:
                tiebreak = hashlib.sha256(f"{self.me}/{r}/{peer}".encode()).digest()
                failed = self.known.failed_recently(peer, self.plan.round)
                # Big bodies last (they hold budget and a slot for long); below SIZE_CLASS_FLOOR one
                # class, so that tiny bodies (Sybils' junk) do not win the slots by being tiny.
                size_class = max(record.size, SIZE_CLASS_FLOOR).bit_length()
                order = (failed, peer not in self.plan.trusted, size_class, tiebreak)
                self.candidates[(r, peer)] = _Candidate(r, peer, record, order)

    def _in_flight(self) -> set[tuple[int, str]]:
        return {(f.candidate.round, f.candidate.peer) for f in self.fetches + self.late}

    def _fits(self, c: _Candidate) -> bool | None:
        """True: may start now; False: waits for budget; None: waits for an identical body in flight."""
        if any(f.candidate.record.sha256 == c.record.sha256 for f in self.fetches + self.late):
            return None
        return self.reserved_bytes + c.record.size <= self.plan.max_total_bytes

    def _schedule(self) -> None:
        """Give free slots to the best candidates that fit the byte budget."""
        if self.dht_down or self.remaining() <= 0:
            return
        for c in sorted(self.candidates.values(), key=lambda c: c.order):
            if self.slots() <= 0:
                return
            if c.peer not in self.plan.trusted and self.untrusted_slots() <= 0:
                continue  # the rest of the slots are the trusted peers'
            reason = self.ledger.verdict(c.round, c.peer, c.record.sha256, bodies_checked=self.body_check is not None)
            if reason is not None:  # another peer delivered these bytes meanwhile
                del self.candidates[(c.round, c.peer)]
                self._reject(c.round, c.peer, c.record.sha256, reason)
            elif self._fits(c):
                del self.candidates[(c.round, c.peer)]
                if c.record.body is not None:
                    self.reserved_bytes += c.record.size
                    self._settle(c, c.record.body, "")
                else:
                    self._start_fetch(c)

    # ------------------------------------------------------------ bodies

    def _start_fetch(self, c: _Candidate) -> None:
        timeout = self.budget.budget(c.peer, c.record.size)
        try:
            future = self.client.fetch_body(c.peer, c.record.sha256, c.record.size, timeout)
        except _DOWN as e:
            self._down(e)
            return
        self.reserved_bytes += c.record.size
        self.result.fetches += 1
        self.fetches.append(_Fetch(future, c, self.serial))

    def _collect_fetches(self, until: float) -> None:
        for f in [f for f in self.late if f.future.done()]:  # never waited for
            self.late.remove(f)
            self._collect(f, 0.0, reserved=False)
        for f in list(self.fetches):
            if self.done():  # enough peers, or out of time: the rest is settled in run()
                return
            if self._collect(f, max(0.0, until - time.monotonic()), reserved=True):
                self.fetches.remove(f)

    def _collect(self, f: _Fetch, wait: float, *, reserved: bool) -> bool:
        """Judge a fetch's outcome if it has one within `wait` seconds; False if it is still running."""
        try:
            body, reason, seconds = f.future.result(timeout=wait)
        except TimeoutError:
            return False
        except Exception as e:
            self.log_once("fetch_error", "a body fetch failed inside the DHT process: %r", e)
            body, reason, seconds = None, RejectReason.FETCH_FAILED, None
        if seconds is not None and reason in ("", RejectReason.FETCH_TIMEOUT):
            self.budget.observe(f.candidate.peer, seconds, timed_out=bool(reason))
        if body is not None and not reason and f.gather != self.serial:
            self.result.late += 1
        self._settle(f.candidate, body, reason, reserved=reserved)
        return True

    def _settle(self, c: _Candidate, body: bytes | None, reason: str, *, reserved: bool = True) -> None:
        """Deliver or reject a body; `reserved`: its bytes count against this gather's budget."""
        if body is not None:
            self.result.bytes_read += len(body) if c.record.body is None else 0  # inline ones were counted
        reason = reason or _check_body(c.record, body)
        if not reason and body is not None and self.body_check is not None:  # before its content counts as delivered
            reason = self.body_check(c.peer, body) or ""
        if reason:
            self.reserved_bytes -= c.record.size if reserved else 0  # the budget goes back to the next candidate
            if reason in (RejectReason.FETCH_FAILED, RejectReason.FETCH_TIMEOUT, RejectReason.BODY_NOT_FOUND):
                self.known.fetch_failed(c.peer, self.plan.round)
            self._reject(c.round, c.peer, c.record.sha256, reason)
            return
        assert body is not None, "_check_body rejects a missing body"
        self.ledger.deliver(c.round, c.peer, c.record.sha256)
        if reserved:  # a late packet is extra: it neither fills a slot nor ends this gather
            self.delivered.add(c.peer)
        self.result.packets.append(GatheredPacket(c.peer, c.round, body))

    def _settle_unfinished(self) -> None:
        """Fetches still running when the gather ends.

        At the deadline they go on, each under its own budget in the DHT process (which
        reports its own timeout), and the next gather judges them: `self.carry`. A gather
        that ended early (enough peers) leaves its own unjudged instead, for a later gather
        to judge the header afresh. A dead DHT process ends them all (they will not report).
        """
        if not self.dht_down:
            at_deadline = self.remaining() <= 0
            self.carry = self.late + (self.fetches if at_deadline else [])
        self.result.carried = len(self.carry)
        self.fetches = []

    # ------------------------------------------------------------ verdicts

    def _reject(self, r: int, peer: str, content: bytes, reason: str) -> None:
        self.ledger.reject(r, peer, content)
        self._count(peer, reason)

    def _count(self, peer: str, reason: str) -> None:
        self.rejected[reason] += 1
        self.by_peer[peer][reason] += 1
        self.log_once(f"reject:{reason}", "rejected a peer's record: %s", reason)

    def _down(self, error: BaseException) -> None:
        self.dht_down = True
        self.errors["dht_down"] += 1
        self.log_once("dht_down", "cannot reach the DHT process: %r", error)


def _check_body(record: HeaderRecord, body: bytes | None) -> str:
    if body is None or len(body) != record.size:
        return RejectReason.SIZE_MISMATCH
    if hashlib.sha256(body).digest() != record.sha256:
        return RejectReason.HASH_MISMATCH
    return ""


def _entry_bytes(owner: bytes, value: Any) -> int:
    """What one entry of a DHT answer weighs: subkey, value and the signature the validator stripped."""
    try:
        return len(owner) + len(MSGPackSerializer.dumps(value)) + SIGNATURE_BYTES
    except Exception:
        return len(owner) + SIGNATURE_BYTES
