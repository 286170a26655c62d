"""An in-process packet exchange: the `Swarm` packet API without a DHT.

`ftis-node experiment` plays many short runs of two nodes in one process. Starting two
hivemind DHTs per run would cost seconds each and add nothing to the comparison, so the
nodes of a run share an `ExchangeHub` instead, a bulletin board of packet bytes keyed by
round and sender. Each node gets its own `InProcessExchange` endpoint, which the daemon
uses exactly like a `node.swarm.Swarm` (`Node(cfg, exchange=endpoint)`).

What stays real: packets are the encoded BYTES the daemon publishes, and the receiver
decodes, validates and re-scores them through the same admission path as packets that
came over the DHT. The semantics follow `Swarm.gather`, through the same `GatherLedger`:
a gather for round r returns the packets of round r (and `stale_rounds` before it) that
this endpoint has not received yet, never its own; a peer's second, different packet for
a round is rejected `duplicate` and bytes already delivered under another peer
`duplicate_content`; a body is judged by its own header first (`body_check`, the same
`body_verdict` a node's `Swarm` uses: junk and relayed copies are rejected, the latter
`relayed`); it returns as soon as `expect_peers` peers answered or the deadline passed.
What it does not model: shards and the per-gather cap on peers (every member reads the
whole board), fetch failures, byte budgets.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from typing import Any

from node.swarm.gather import BodyCheck, GatheredPacket, GatherResult
from node.swarm.ledger import GatherLedger, KnownPeers, body_verdict
from protocol.codec import Limits
from protocol.keys import STALE_ROUNDS

__all__ = ["ExchangeHub", "InProcessExchange"]

# A packet over this is refused at publish, like Swarm's default max_packet_bytes.
MAX_PACKET_BYTES = Limits().max_bytes


class ExchangeHub:
    """The shared board of one run: round -> sender -> packet bytes (thread-safe)."""

    def __init__(self, swarm_id: str = "ftis", *, body_check: BodyCheck | None = body_verdict) -> None:
        """`body_check`: as `Swarm`'s; None makes packets opaque bytes (tests of the board alone)."""
        self.swarm_id = swarm_id
        self.body_check = body_check
        self._board: dict[int, dict[str, tuple[bytes, str, str]]] = {}  # round -> sender -> (bytes, model, adapter)
        self._changed = threading.Condition()
        self._names: set[str] = set()

    def endpoint(self, name: str) -> InProcessExchange:
        """A new member called `name` (its peer id is `inproc-<name>`; names are unique)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"an endpoint needs a non-empty name, got {name!r}")
        with self._changed:
            if name in self._names:
                raise ValueError(f"endpoint name {name!r} is taken on this hub")
            self._names.add(name)
        return InProcessExchange(self, f"inproc-{name}")

    # The endpoints call these; they hold the condition's lock while reading or writing.
    def _put(self, round: int, peer_id: str, packet: bytes, model: str, adapter: str) -> None:
        with self._changed:
            self._board.setdefault(round, {})[peer_id] = (packet, model, adapter)  # a second publish replaces it
            self._changed.notify_all()

    def _snapshot(self, rounds: list[int]) -> list[tuple[int, str, tuple[bytes, str, str]]]:
        return [(r, peer, entry) for r in rounds for peer, entry in sorted(self._board.get(r, {}).items())]

    def published(self, round: int) -> dict[str, bytes]:
        """A copy of what was published for `round`, by sender (for tests and reports)."""
        with self._changed:
            return {peer: entry[0] for peer, entry in self._board.get(round, {}).items()}


class InProcessExchange:
    """One node's view of an `ExchangeHub`, with the methods the daemon calls on a `Swarm`."""

    def __init__(self, hub: ExchangeHub, peer_id: str) -> None:
        self.hub = hub
        self._peer_id = peer_id
        self.ledger = GatherLedger()  # the swarm's duplicate rules
        self.known = KnownPeers()
        self._closed = False
        self.published_bytes = 0  # what this node sent, for reports

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def join_addrs(self) -> list[str]:
        """No network address: peers of an in-process run are found through the hub."""
        return [f"inproc://{self.hub.swarm_id}/{self._peer_id}"]

    @staticmethod
    def dht_time() -> float:
        return time.time()

    def publish(self, round: int, packet: bytes, *, model: str = "", adapter_version: str = "") -> bool:
        """Put this node's packet for `round` on the board (bytes only, as on the wire)."""
        self._check_open()
        if not isinstance(packet, (bytes, bytearray, memoryview)):
            raise TypeError(f"packet must be bytes, got {type(packet).__name__}")
        if not isinstance(round, int) or round < 0:
            raise ValueError(f"round must be an integer >= 0, got {round!r}")
        packet = bytes(packet)
        if len(packet) > MAX_PACKET_BYTES:
            raise ValueError(f"packet has {len(packet)} bytes, over the limit of {MAX_PACKET_BYTES}")
        self.hub._put(round, self._peer_id, packet, model, adapter_version)
        self.published_bytes += len(packet)
        return True

    def gather(
        self,
        round: int,
        *,
        deadline_s: float,
        expect_peers: int | None = None,
        stale_rounds: int = STALE_ROUNDS,
        exclude_peers: Collection[str] = (),
        on_progress: Callable[[int], None] | None = None,
        **_limits: object,  # Swarm's byte, peer and fetch-order limits: here every packet is read
    ) -> GatherResult:
        """Peers' packets for `round` (and `stale_rounds` before) not yet handed to this node."""
        self._check_open()
        if not (isinstance(deadline_s, (int, float)) and math.isfinite(deadline_s) and deadline_s >= 0):
            raise ValueError(f"deadline_s must be a finite number >= 0, got {deadline_s!r}")
        if expect_peers is not None and expect_peers < 0:
            raise ValueError(f"expect_peers must be >= 0 or None, got {expect_peers}")
        if stale_rounds < 0:
            raise ValueError(f"stale_rounds must be >= 0, got {stale_rounds}")
        rounds = list(range(round, max(round - stale_rounds, 0) - 1, -1))
        started = time.monotonic()
        deadline = started + deadline_s
        result = GatherResult()
        rejected: dict[str, Counter[str]] = defaultdict(Counter)
        skipped: set[tuple[int, str]] = set()
        self.ledger.forget_before(round - stale_rounds - 2)  # those rounds can no longer be asked for
        reported = 0
        with self.hub._changed:
            while True:
                result.polls += 1
                for r, sender, (data, model, adapter) in self.hub._snapshot(rounds):
                    content = hashlib.sha256(data).digest()
                    if sender == self._peer_id or self.ledger.judged(r, sender, content):
                        continue
                    self.known.saw(sender, round=r, model=model, adapter_version=adapter, size=len(data))
                    if sender in exclude_peers:  # as the swarm: still in the view, not delivered
                        skipped.add((r, sender))
                        continue
                    reason: str | None = self.ledger.verdict(
                        r, sender, content, bodies_checked=self.hub.body_check is not None
                    )
                    if reason is None and self.hub.body_check is not None:
                        reason = self.hub.body_check(sender, data)
                    if reason is not None:
                        self.ledger.reject(r, sender, content)
                        rejected[sender][reason] += 1
                        continue
                    self.ledger.deliver(r, sender, content)
                    result.packets.append(GatheredPacket(sender, r, data))
                    result.bytes_read += len(data)
                if on_progress is not None and len(result.peers) != reported:
                    reported = len(result.peers)
                    on_progress(reported)
                enough = expect_peers is not None and len(result.peers) >= expect_peers
                left = deadline - time.monotonic()
                if enough or left <= 0:
                    break
                self.hub._changed.wait(timeout=left)  # woken by the next publish
        result.rejected_by_peer = {peer: dict(c) for peer, c in rejected.items()}
        result.rejected = dict(sum(rejected.values(), Counter()))
        result.skipped = len(skipped)
        result.elapsed_s = time.monotonic() - started
        return result

    def known_peers(self) -> list[dict[str, Any]]:
        """Peers seen on the board, most recent first (the `Swarm.known_peers` view)."""
        return self.known.view()

    def shutdown(self) -> None:
        """Leave the hub; safe to call twice (the daemon's close() calls it)."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"exchange endpoint {self._peer_id} was shut down")
