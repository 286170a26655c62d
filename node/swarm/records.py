"""Packet records in the DHT: publish, serve large bodies, gather.

Packets are opaque bytes here. A node's packet for round r lives at

    key    = round_key(swarm_id, r)                      "ftis/<swarm>/<r>"
    subkey = b"[owner:<ssh-rsa public key>]"             the sender's record key

Every node installs hivemind's `RSASignatureValidator` (signs our own stores, checks
everyone's), so only the holder of a key can write its slot, plus `PacketRecordValidator`,
which bounds a record's size and schema and refuses unsigned slots.

The value is a small msgpack map, `PacketRecord`: round, sender peer id, size, sha256
and, for packets up to `inline_max_bytes`, the body itself. A larger body stays out
of the DHT (a key's whole answer must fit one libp2p message): the record is then a
header only, and receivers fetch the body from the sender over a libp2p stream by its
sha256 and check it against the header.

The body service runs inside the DHT process, registered on the DHT's own P2P
instance with `DHT.run_coroutine`: one p2pd and one event loop per node, and the
daemon stays plain synchronous code with no second asyncio loop of its own. A body
crosses the DHT pipe once each way, which the pipe fix in `dht.py` makes safe.

Gathering polls `get(key, latest=True)` for the round and up to `stale_rounds`
before it, until a deadline or until `expect_peers` peers answered. Each (peer, round,
content) is judged once per node: accepted records are never delivered twice, and a
rejection is counted once, by reason, never raised. There is no barrier.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any, Literal, NamedTuple

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MPFuture, MSGPackSerializer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from node.swarm.dht import MAX_RECORD_BYTES, SwarmConfig, SwarmDHT, dht_time
from node.swarm.errors import DHTUnavailableError
from protocol.keys import round_key

__all__ = [
    "BODY_HANDLER",
    "BodyStore",
    "GatherResult",
    "GatheredPacket",
    "PacketExchange",
    "PacketRecord",
    "PacketRecordValidator",
    "RecordClient",
    "RejectReason",
]

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
BODY_HANDLER = "ftis.body.v1"
# RSASignatureValidator finds signatures by this marker anywhere in a value; a body
# that happens to contain it could not be stored inline, so it is sent as a reference.
_SIGNATURE_MARK = b"[signature:"
_OWNER_PREFIX, _OWNER_SUFFIX = b"[owner:", b"]"
_BODY_OK, _BODY_MISSING = b"\x00", b"\x01"
_LEN_BYTES = 8  # the length prefix of hivemind's P2P.send_raw_data
_SERVE_TIMEOUT_S = 60.0  # a reader slower than this loses the stream
_FETCH_SLACK_S = 0.25  # how long past the deadline a gather waits for a fetch to report its own timeout


class RejectReason(StrEnum):
    """Why a peer's record was not delivered."""

    BAD_RECORD = "bad_record"  # not a PacketRecord
    ROUND_MISMATCH = "round_mismatch"  # stored under another round's key
    TOO_LARGE = "too_large"  # over this node's max_packet_bytes
    DUPLICATE = "duplicate"  # a second, different packet of one peer for one round
    OVER_BUDGET = "over_budget"  # the gather's max_total_bytes is used up
    HASH_MISMATCH = "hash_mismatch"  # body does not match the header's sha256
    SIZE_MISMATCH = "size_mismatch"  # fetched body has another length than the header says
    BODY_NOT_FOUND = "body_not_found"  # the sender no longer serves that body
    FETCH_TIMEOUT = "fetch_timeout"
    FETCH_FAILED = "fetch_failed"  # sender unreachable or the stream broke


# ---------------------------------------------------------------- the record


class PacketRecord(BaseModel):
    """The DHT value under (round key, owner subkey). `body` is None for a reference."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: Literal[1] = RECORD_VERSION
    round: int = Field(ge=0)
    peer: str = Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")  # base58 peer id
    size: int = Field(ge=0)
    sha256: bytes = Field(min_length=32, max_length=32)
    body: bytes | None = None

    @model_validator(mode="after")
    def _inline_body_has_its_size(self) -> PacketRecord:
        if self.body is not None and len(self.body) != self.size:
            raise ValueError(f"inline body has {len(self.body)} bytes, header says {self.size}")
        return self

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_wire(cls, value: Any) -> PacketRecord:
        if not isinstance(value, dict):
            raise ValueError(f"record must be a map, got {type(value).__name__}")
        return cls.model_validate(value)


def is_owner_subkey(subkey: Any) -> bool:
    return isinstance(subkey, bytes) and subkey.startswith(_OWNER_PREFIX) and subkey.endswith(_OWNER_SUFFIX)


class PacketRecordValidator(RecordValidatorBase):
    """Every record in the swarm's DHT must be a signed-slot `PacketRecord` of bounded size.

    Runs after RSASignatureValidator (lower priority), so it sees the value with the
    signature stripped. The bounds are protocol constants, the same on every node: a
    node that stored records its peers consider invalid would make hivemind drop the
    whole answer for that key.
    """

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES:
            return False
        try:
            if not is_owner_subkey(MSGPackSerializer.loads(record.subkey)):
                return False
            PacketRecord.from_wire(MSGPackSerializer.loads(record.value))
        except Exception:  # network data: any failure to parse means "invalid"
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PacketRecordValidator)


# ---------------------------------------------------------------- serving bodies (DHT process)


class BodyStore:
    """Bodies this node serves, by sha256: only the newest `keep_rounds` rounds, at most `max_bytes`."""

    def __init__(self, keep_rounds: int, max_bytes: int) -> None:
        if keep_rounds < 1 or max_bytes < 1:
            raise ValueError("keep_rounds and max_bytes must be >= 1")
        self.keep_rounds, self.max_bytes = keep_rounds, max_bytes
        self._bodies: dict[bytes, tuple[int, bytes]] = {}  # insertion order = age
        self.total_bytes = 0

    def put(self, digest: bytes, round: int, body: bytes) -> None:
        self._drop(digest)
        self._bodies[digest] = (round, body)
        self.total_bytes += len(body)
        newest = max(r for r, _ in self._bodies.values())
        for old in [d for d, (r, _) in self._bodies.items() if r <= newest - self.keep_rounds]:
            self._drop(old)
        while self.total_bytes > self.max_bytes:
            self._drop(min(self._bodies, key=lambda d: self._bodies[d][0]))  # oldest round, oldest first

    def get(self, digest: bytes) -> bytes | None:
        entry = self._bodies.get(digest)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._bodies)

    def _drop(self, digest: bytes) -> None:
        entry = self._bodies.pop(digest, None)
        if entry is not None:
            self.total_bytes -= len(entry[1])


async def _serve_body(store: BodyStore, _stream_info, reader, writer) -> None:
    """Request: a 32-byte sha256 (length-prefixed). Answer: status byte + length-prefixed body."""
    try:
        async with asyncio.timeout(_SERVE_TIMEOUT_S):
            if int.from_bytes(await reader.readexactly(_LEN_BYTES), "big") != 32:
                return  # not our protocol: drop the stream without reading an attacker-chosen length
            body = store.get(await reader.readexactly(32))
            writer.write(_BODY_MISSING if body is None else _BODY_OK)
            await P2P.send_raw_data(b"" if body is None else body, writer)
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        pass  # the reader went away or stalled; nothing to report on this side
    finally:
        writer.close()


async def _install_body_service(dht: SwarmDHT, node, keep_rounds: int, max_bytes: int) -> None:
    dht.ftis_bodies = BodyStore(keep_rounds, max_bytes)
    await node.p2p.add_binary_stream_handler(BODY_HANDLER, partial(_serve_body, dht.ftis_bodies))


async def _offer_body(dht: SwarmDHT, _node, digest: bytes, round: int, body: bytes) -> None:
    dht.ftis_bodies.put(digest, round, body)


async def _fetch_body(
    _dht: SwarmDHT, node, peer: str, digest: bytes, max_bytes: int, timeout: float
) -> tuple[bytes | None, str]:
    """(body, "") or (None, reason). Failures are returned, not raised: hivemind logs raised ones loudly."""

    async def fetch() -> tuple[bytes | None, str]:
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), BODY_HANDLER)
        try:
            await P2P.send_raw_data(digest, writer)
            status = await reader.readexactly(1)
            length = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
            if status != _BODY_OK:
                return None, RejectReason.BODY_NOT_FOUND
            if length > max_bytes:
                return None, RejectReason.TOO_LARGE
            return await reader.readexactly(length), ""
        finally:
            writer.close()

    try:
        async with asyncio.timeout(timeout):
            return await fetch()
    except TimeoutError:
        return None, RejectReason.FETCH_TIMEOUT
    except Exception as e:  # unreachable peer, reset stream, bad peer id: all the sender's problem
        logger.debug("body fetch from %s failed: %r", peer, e)
        return None, RejectReason.FETCH_FAILED


# ---------------------------------------------------------------- the node side


class RecordClient:
    """Calls into the DHT process from any thread of the node.

    hivemind writes every call to one pipe without a lock, and a large message is two
    writes, so concurrent callers would interleave; the lock serialises the writes
    (not the calls: each returns a future at once). A dead DHT process would leave its
    pipe open in forked siblings, so a write could block forever once the pipe fills:
    each call checks that the process is alive first and raises DHTUnavailableError.
    """

    def __init__(self, dht: SwarmDHT) -> None:
        self.dht = dht
        self._lock = threading.Lock()

    def _alive(self) -> None:
        if not self.dht.is_alive():
            raise DHTUnavailableError(f"the DHT process (pid {self.dht.pid}) is gone")

    def get(self, key: str) -> MPFuture:
        with self._lock:
            self._alive()
            return self.dht.get(key, latest=True, return_future=True)

    def store(self, key: str, value: Any, expiration_time: float, subkey: bytes) -> MPFuture:
        with self._lock:
            self._alive()
            return self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True)

    def run(self, coro) -> MPFuture:
        with self._lock:
            self._alive()
            return self.dht.run_coroutine(coro, return_future=True)

    def install_body_service(self, keep_rounds: int, max_bytes: int) -> MPFuture:
        return self.run(partial(_install_body_service, keep_rounds=keep_rounds, max_bytes=max_bytes))

    def offer_body(self, digest: bytes, round: int, body: bytes) -> MPFuture:
        """Serve `body` to peers that ask for `digest` (the caller vouches that it is its sha256)."""
        return self.run(partial(_offer_body, digest=digest, round=round, body=body))

    def fetch_body(self, peer: str, digest: bytes, max_bytes: int, timeout: float) -> MPFuture:
        """Future of (body, "") or (None, reason); the body is not checked here."""
        return self.run(partial(_fetch_body, peer=peer, digest=digest, max_bytes=max_bytes, timeout=timeout))

    def shutdown(self) -> None:
        with self._lock:
            self.dht.shutdown()


class GatheredPacket(NamedTuple):
    """One accepted packet: unpacks as `peer_id, round, data`."""

    peer_id: str  # as the sender's signed record states it
    round: int
    data: bytes


@dataclass
class GatherResult:
    packets: list[GatheredPacket] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    rejected_by_peer: dict[str, dict[str, int]] = field(default_factory=dict)  # peer -> reason -> count
    errors: dict[str, int] = field(default_factory=dict)  # our own DHT trouble: dht_timeout, dht_error, dht_down
    polls: int = 0
    elapsed_s: float = 0.0

    @property
    def peers(self) -> set[str]:
        return {p.peer_id for p in self.packets}

    @property
    def total_bytes(self) -> int:
        return sum(len(p.data) for p in self.packets)


@dataclass
class _Pending:
    future: MPFuture
    owner: bytes
    record: PacketRecord


def _label(owner: bytes, record: PacketRecord | None) -> str:
    if record is not None:
        return record.peer
    return "owner:" + hashlib.sha256(owner).hexdigest()[:12]  # no trustworthy peer id in a bad record


class PacketExchange:
    """Publishing and gathering one node's packets; used through `node.swarm.Swarm`."""

    def __init__(self, client: RecordClient, config: SwarmConfig, peer_id: str, owner_subkey: bytes) -> None:
        self.client, self.config = client, config
        self.peer_id, self.owner_subkey = peer_id, owner_subkey
        self._state_lock = threading.Lock()
        # Per round: owner -> sha256 of the packet delivered; (owner, content id) judged and rejected.
        self._delivered: dict[int, dict[bytes, bytes]] = defaultdict(dict)
        self._rejected: dict[int, set[tuple[bytes, bytes]]] = defaultdict(set)
        self._logged: set[str] = set()

    # ------------------------------------------------------------ start-up

    def install(self) -> None:
        cfg = self.config
        installing = self.client.install_body_service(cfg.body_keep_rounds, cfg.body_store_max_bytes)
        installing.result(timeout=cfg.startup_timeout)

    # ------------------------------------------------------------ publish

    def publish(self, round: int, packet: bytes) -> bool:
        """Store this node's packet for `round`; False (logged) if the DHT did not take it."""
        if not isinstance(packet, (bytes, bytearray, memoryview)):
            raise TypeError(f"packet must be bytes, got {type(packet).__name__}")
        packet = bytes(packet)
        cfg = self.config
        if len(packet) > cfg.max_packet_bytes:
            raise ValueError(f"packet has {len(packet)} bytes, over max_packet_bytes={cfg.max_packet_bytes}")
        key = round_key(cfg.swarm_id, round)
        digest = hashlib.sha256(packet).digest()
        record = PacketRecord(round=round, peer=self.peer_id, size=len(packet), sha256=digest, body=packet)
        value = record.to_wire()
        inline = len(packet) <= cfg.inline_max_bytes and _SIGNATURE_MARK not in MSGPackSerializer.dumps(value)
        try:
            if not inline:
                self.client.offer_body(digest, round, packet).result(timeout=self._call_timeout)
                value = record.model_copy(update={"body": None}).to_wire()
            expiration = dht_time() + cfg.ttl_rounds * cfg.round_seconds
            stored = self.client.store(key, value, expiration, self.owner_subkey).result(timeout=self._call_timeout)
        except TimeoutError:
            self._log_once("publish_timeout", "publishing round %d timed out; is the DHT process alive?", round)
            return False
        except Exception as e:  # a broken pipe, or whatever failed inside the DHT process
            self._log_once("publish_error", "publishing round %d failed: %r", round, e)
            return False
        if not stored:
            self._log_once("publish_refused", "no DHT peer stored our record for round %d", round)
        return bool(stored)

    @property
    def _call_timeout(self) -> float:
        return max(10.0, 4 * self.config.rpc_timeout_s)

    # ------------------------------------------------------------ gather

    def gather(
        self,
        round: int,
        *,
        deadline_s: float,
        expect_peers: int | None = None,
        max_packet_bytes: int | None = None,
        max_total_bytes: int | None = None,
        stale_rounds: int | None = None,
    ) -> GatherResult:
        """Peers' packets for `round` (and up to `stale_rounds` before it) that this node has not seen yet.

        Returns when `expect_peers` distinct peers delivered a packet or after `deadline_s`,
        whichever is first. Nothing from the network raises: it is counted in the result.
        """
        cfg = self.config
        if not (isinstance(deadline_s, (int, float)) and math.isfinite(deadline_s) and deadline_s >= 0):
            raise ValueError(f"deadline_s must be a finite number >= 0, got {deadline_s!r}")
        if expect_peers is not None and expect_peers < 0:
            raise ValueError(f"expect_peers must be >= 0 or None, got {expect_peers}")
        stale = cfg.stale_rounds if stale_rounds is None else stale_rounds
        if stale < 0:
            raise ValueError(f"stale_rounds must be >= 0, got {stale}")
        keys = {r: round_key(cfg.swarm_id, r) for r in range(round, max(round - stale, 0) - 1, -1)}
        run = _GatherRun(
            self,
            keys,
            deadline=time.monotonic() + deadline_s,
            expect_peers=expect_peers,
            max_packet_bytes=cfg.max_packet_bytes if max_packet_bytes is None else max_packet_bytes,
            max_total_bytes=cfg.max_total_bytes if max_total_bytes is None else max_total_bytes,
        )
        with self._state_lock:
            self._forget_before(round - stale - 2)
            return run.run()

    def _forget_before(self, round: int) -> None:
        for table in (self._delivered, self._rejected):
            for r in [r for r in table if r < round]:
                del table[r]

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning(message + " (logged once)", *args)


class _GatherRun:
    """The state of one `gather` call."""

    def __init__(
        self,
        exchange: PacketExchange,
        keys: dict[int, str],
        *,
        deadline: float,
        expect_peers: int | None,
        max_packet_bytes: int,
        max_total_bytes: int,
    ) -> None:
        self.x, self.keys, self.deadline = exchange, keys, deadline
        self.expect_peers, self.max_packet_bytes, self.max_total_bytes = expect_peers, max_packet_bytes, max_total_bytes
        self.started = time.monotonic()
        self.result = GatherResult()
        self.rejected: Counter[str] = Counter()
        self.by_peer: dict[str, Counter[str]] = defaultdict(Counter)
        self.errors: Counter[str] = Counter()
        self.answered: set[bytes] = set()
        self.reserved_bytes = 0  # accepted plus in-flight fetches
        self.gets: dict[int, tuple[MPFuture, float]] = {}  # round -> (read in flight, when it was sent)
        self.fetches: list[_Pending] = []
        self.in_flight: set[tuple[int, bytes]] = set()
        self.dht_down = False  # nothing more can arrive: end the gather now

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def done(self) -> bool:
        enough = self.expect_peers is not None and len(self.answered) >= self.expect_peers
        return enough or self.dht_down or self.remaining() <= 0

    def run(self) -> GatherResult:
        # One pass per poll interval: send reads for rounds with none in flight, take what has
        # arrived by the end of the interval (reads, then body fetches), stop once done.
        while True:
            until = time.monotonic() + min(self.remaining(), self.x.config.poll_interval_s)
            self._send_reads()
            self._collect_reads(until)
            self._collect_fetches(until)
            if self.done():
                break
            time.sleep(max(0.0, until - time.monotonic()))
        self._settle_unfinished()
        # A read sent just before the deadline is no fault; one older than a DHT request timeout is.
        stuck = [sent for _, sent in self.gets.values() if time.monotonic() - sent > self.x.config.rpc_timeout_s]
        if stuck:
            self.errors["dht_timeout"] += len(stuck)
            self.x._log_once("dht_timeout", "DHT reads got no answer within %.1f s", self.x.config.rpc_timeout_s)
        res = self.result
        res.rejected = dict(self.rejected)
        res.rejected_by_peer = {peer: dict(c) for peer, c in self.by_peer.items()}
        res.errors = dict(self.errors)
        res.elapsed_s = time.monotonic() - self.started
        return res

    # -- reading the DHT

    def _send_reads(self) -> None:
        sent = False
        for r, key in self.keys.items():
            if r not in self.gets:  # a read still in flight is waited for, not doubled
                try:
                    self.gets[r] = (self.x.client.get(key), time.monotonic())
                    sent = True
                except (DHTUnavailableError, OSError, EOFError, ValueError) as e:  # no DHT process to ask
                    self._down(e)
                    return
        self.result.polls += sent

    def _collect_reads(self, until: float) -> None:
        for r, (future, _) in list(self.gets.items()):
            if self.dht_down:
                return
            try:
                found = future.result(timeout=max(0.0, until - time.monotonic()))
            except TimeoutError:
                continue
            except Exception as e:  # hivemind re-raises whatever failed inside the DHT process
                del self.gets[r]
                self.errors["dht_error"] += 1
                self.x._log_once("dht_error", "a DHT read failed: %r", e)
                continue
            del self.gets[r]
            self._judge_entries(r, found)

    def _judge_entries(self, r: int, found: Any) -> None:
        entries = getattr(found, "value", None)
        if found is None or not isinstance(entries, dict):
            return  # nobody published yet (or a regular value, which validators never let through)
        for owner, item in entries.items():
            if owner == self.x.owner_subkey or not isinstance(owner, bytes):
                continue
            self._judge(r, owner, getattr(item, "value", None))

    def _judge(self, r: int, owner: bytes, value: Any) -> None:
        try:
            record = PacketRecord.from_wire(value)
        except (ValidationError, ValueError):
            try:
                content = hashlib.sha256(MSGPackSerializer.dumps(value)).digest()
            except Exception:  # not even re-serialisable: judge it by owner alone
                content = b""
            if self._first_look(r, owner, content):
                self._reject(r, owner, content, None, RejectReason.BAD_RECORD)
            return
        content = record.sha256
        if not self._first_look(r, owner, content):
            return
        delivered = self.x._delivered[r].get(owner)
        if record.round != r:
            self._reject(r, owner, content, record, RejectReason.ROUND_MISMATCH)
        elif delivered is not None:  # a different packet from a peer already delivered for r
            self._reject(r, owner, content, record, RejectReason.DUPLICATE)
        elif record.size > self.max_packet_bytes:
            self._reject(r, owner, content, record, RejectReason.TOO_LARGE)
        elif self.reserved_bytes + record.size > self.max_total_bytes:
            self._reject(r, owner, content, record, RejectReason.OVER_BUDGET)
        elif record.body is not None:
            self._accept_inline(r, owner, record)
        else:
            self._start_fetch(r, owner, record)

    def _first_look(self, r: int, owner: bytes, content: bytes) -> bool:
        if (r, owner) in self.in_flight or (owner, content) in self.x._rejected[r]:
            return False
        return self.x._delivered[r].get(owner) != content

    def _down(self, error: BaseException) -> None:
        self.dht_down = True
        self.errors["dht_down"] += 1
        self.x._log_once("dht_down", "cannot reach the DHT process: %r", error)

    # -- bodies

    def _start_fetch(self, r: int, owner: bytes, record: PacketRecord) -> None:
        cfg = self.x.config
        timeout = max(0.05, min(cfg.fetch_timeout_s, self.remaining()))
        try:
            future = self.x.client.fetch_body(record.peer, record.sha256, record.size, timeout)
        except (DHTUnavailableError, OSError, EOFError, ValueError) as e:
            self._down(e)
            return
        self.reserved_bytes += record.size
        self.in_flight.add((r, owner))
        self.fetches.append(_Pending(future, owner, record))

    def _collect_fetches(self, until: float) -> None:
        still: list[_Pending] = []
        for p in self.fetches:
            if self.done():  # enough peers, or out of time: the rest is settled in run()
                still.append(p)
                continue
            try:
                body, reason = p.future.result(timeout=max(0.0, until - time.monotonic()))
            except TimeoutError:
                still.append(p)
                continue
            except Exception as e:
                self.x._log_once("fetch_error", "a body fetch failed inside the DHT process: %r", e)
                body, reason = None, RejectReason.FETCH_FAILED
            self._settle_fetch(p, body, reason)
        self.fetches = still

    def _settle_fetch(self, p: _Pending, body: bytes | None, reason: str) -> None:
        r = p.record.round
        self.in_flight.discard((r, p.owner))
        reason = reason or self._check_body(p.record, body)
        if reason:
            self.reserved_bytes -= p.record.size
            self._reject(r, p.owner, p.record.sha256, p.record, reason)
        else:
            self._accept(r, p.owner, p.record, body)

    def _settle_unfinished(self) -> None:
        """Fetches still running when the gather ends.

        At the deadline they have timed out (the DHT process gives up by then on its own;
        it gets a moment to say so). Otherwise (enough peers, DHT gone) they are left
        unjudged, for a later gather.
        """
        if self.remaining() <= 0 and not self.dht_down:
            for p in self.fetches:
                try:
                    body, reason = p.future.result(timeout=_FETCH_SLACK_S)
                except Exception:  # TimeoutError or a failure inside the DHT process
                    body, reason = None, RejectReason.FETCH_TIMEOUT
                self._settle_fetch(p, body, reason)
        self.fetches = []

    # -- verdicts

    @staticmethod
    def _check_body(record: PacketRecord, body: bytes | None) -> str:
        if body is None or len(body) != record.size:
            return RejectReason.SIZE_MISMATCH
        if hashlib.sha256(body).digest() != record.sha256:
            return RejectReason.HASH_MISMATCH
        return ""

    def _accept_inline(self, r: int, owner: bytes, record: PacketRecord) -> None:
        reason = self._check_body(record, record.body)
        if reason:
            self._reject(r, owner, record.sha256, record, reason)
        else:
            self.reserved_bytes += record.size
            self._accept(r, owner, record, record.body)

    def _accept(self, r: int, owner: bytes, record: PacketRecord, body: bytes) -> None:
        self.x._delivered[r][owner] = record.sha256
        self.answered.add(owner)
        self.result.packets.append(GatheredPacket(record.peer, r, body))

    def _reject(self, r: int, owner: bytes, content: bytes, record: PacketRecord | None, reason: str) -> None:
        self.x._rejected[r].add((owner, content))
        self.rejected[reason] += 1
        self.by_peer[_label(owner, record)][reason] += 1
        self.x._log_once(f"reject:{reason}", "rejected a peer's record: %s", reason)
