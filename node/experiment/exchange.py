"""An in-process packet exchange: the `Swarm` packet API without a DHT.

`ftis-node experiment` plays many short runs of two nodes in one process. Starting two
hivemind DHTs per run would cost seconds each and add nothing to the comparison, so the
nodes of a run share an `ExchangeHub` instead, a bulletin board of packet bytes keyed by
round and sender. Each node gets its own `InProcessExchange` endpoint, which the daemon
uses exactly like a `node.swarm.Swarm` (`Node(cfg, exchange=endpoint)`).

What stays real: packets are the encoded BYTES the daemon publishes, and the receiver
decodes, validates and re-scores them through the same admission path as packets that
came over the DHT. The semantics follow `Swarm.gather`: a gather for round r returns the
packets of round r (and `stale_rounds` before it) that this endpoint has not received
yet, never its own, and returns as soon as `expect_peers` peers answered or the
deadline passed.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time

from node.swarm.records import GatheredPacket, GatherResult

__all__ = ["ExchangeHub", "InProcessExchange"]

# A packet over this is refused at publish, like Swarm's default max_packet_bytes.
MAX_PACKET_BYTES = 16 << 20


class ExchangeHub:
    """The shared board of one run: round -> sender -> packet bytes (thread-safe)."""

    def __init__(self, swarm_id: str = "ftis") -> None:
        self.swarm_id = swarm_id
        self._board: dict[int, dict[str, bytes]] = {}
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
    def _put(self, round: int, peer_id: str, packet: bytes) -> None:
        with self._changed:
            self._board.setdefault(round, {})[peer_id] = packet  # a second publish replaces the first
            self._changed.notify_all()

    def _snapshot(self, rounds: list[int]) -> list[tuple[int, str, bytes]]:
        return [(r, peer, data) for r in rounds for peer, data in sorted(self._board.get(r, {}).items())]

    def published(self, round: int) -> dict[str, bytes]:
        """A copy of what was published for `round`, by sender (for tests and reports)."""
        with self._changed:
            return dict(self._board.get(round, {}))


class InProcessExchange:
    """One node's view of an `ExchangeHub`, with the methods the daemon calls on a `Swarm`."""

    def __init__(self, hub: ExchangeHub, peer_id: str) -> None:
        self.hub = hub
        self._peer_id = peer_id
        self._delivered: dict[int, set[tuple[str, bytes]]] = {}  # round -> (sender, sha256) handed out
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

    def publish(self, round: int, packet: bytes) -> bool:
        """Put this node's packet for `round` on the board (bytes only, as on the wire)."""
        self._check_open()
        if not isinstance(packet, (bytes, bytearray, memoryview)):
            raise TypeError(f"packet must be bytes, got {type(packet).__name__}")
        if not isinstance(round, int) or round < 0:
            raise ValueError(f"round must be an integer >= 0, got {round!r}")
        packet = bytes(packet)
        if len(packet) > MAX_PACKET_BYTES:
            raise ValueError(f"packet has {len(packet)} bytes, over the limit of {MAX_PACKET_BYTES}")
        self.hub._put(round, self._peer_id, packet)
        self.published_bytes += len(packet)
        return True

    def gather(
        self,
        round: int,
        *,
        deadline_s: float,
        expect_peers: int | None = None,
        stale_rounds: int = 1,
        **_limits: object,  # Swarm's byte limits; nothing here is large enough to need them
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
        for old in [r for r in self._delivered if r < round - stale_rounds - 2]:
            del self._delivered[old]  # those rounds can no longer be asked for
        with self.hub._changed:
            while True:
                result.polls += 1
                for r, sender, data in self.hub._snapshot(rounds):
                    key = (sender, hashlib.sha256(data).digest())
                    seen = self._delivered.setdefault(r, set())
                    if sender == self._peer_id or key in seen:
                        continue
                    seen.add(key)
                    result.packets.append(GatheredPacket(sender, r, data))
                enough = expect_peers is not None and len(result.peers) >= expect_peers
                left = deadline - time.monotonic()
                if enough or left <= 0:
                    break
                self.hub._changed.wait(timeout=left)  # woken by the next publish
        result.elapsed_s = time.monotonic() - started
        return result

    def shutdown(self) -> None:
        """Leave the hub; safe to call twice (the daemon's close() calls it)."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"exchange endpoint {self._peer_id} was shut down")
