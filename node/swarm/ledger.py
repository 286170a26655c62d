"""What a node remembers between gathers: what it judged, and which peers it has seen.

`GatherLedger` is the "seen / judged" state of the gather rules, kept apart from the
gather run so the in-process exchange of `ftis-node experiment` applies the same rules:

* one packet per (peer, round): a second, different packet of a peer already delivered
  for that round is rejected `duplicate`, never delivered again;
* a body is judged by its own header before its content counts as delivered
  (`body_verdict`): junk is rejected with the protocol's code (`bad_magic`, ...) and a
  packet whose header names another sender than the record's signer `relayed`, so a
  relayer's copy never uses up the true sender's delivery;
* one delivery per content: bytes already delivered this round under another peer are
  rejected `duplicate_content` (`relayed` where bodies are checked: they name their sender);
* a rejection is final for that (peer, content): judged once, counted once.

`KnownPeers` is a bounded view of every peer with a valid header in recent rounds, for
the dashboard's swarm view and for the order in which bodies are fetched (a peer whose
fetch failed recently goes last).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from typing import Any

from node.swarm.record import RejectReason
from protocol.codec import peek_header
from protocol.errors import ProtocolError

__all__ = ["GatherLedger", "KnownPeers", "body_verdict"]


def body_verdict(peer: str, body: bytes) -> str | None:
    """What a fetched body's own header says before it may be delivered under `peer` (the
    record's verified signer): a protocol error code for junk, `relayed` for another sender's
    packet, None for a packet of its own. Only the header is read (`peek_header`)."""
    try:
        header = peek_header(body)
    except ProtocolError as err:
        return str(err.code)
    if header.sender_peer_id != peer:
        return RejectReason.RELAYED
    return None


class GatherLedger:
    """Per round: peer -> content delivered, contents delivered, (peer, content) rejected for good."""

    def __init__(self) -> None:
        self._delivered: dict[int, dict[str, bytes]] = defaultdict(dict)
        self._contents: dict[int, set[bytes]] = defaultdict(set)
        self._rejected: dict[int, set[tuple[str, bytes]]] = defaultdict(set)

    def judged(self, round: int, peer: str, content: bytes) -> bool:
        """True if this exact (peer, content) was delivered or rejected already: nothing to do."""
        return self._delivered[round].get(peer) == content or (peer, content) in self._rejected[round]

    def verdict(self, round: int, peer: str, content: bytes, *, bodies_checked: bool = False) -> RejectReason | None:
        """The duplicate rules for a not-yet-judged (peer, content); None if it may be delivered.

        `bodies_checked`: every delivered body passed `body_verdict`, so it names the peer it
        was delivered under, and the same bytes under another key are a relayed copy."""
        if peer in self._delivered[round]:
            return RejectReason.DUPLICATE
        if content in self._contents[round]:
            return RejectReason.RELAYED if bodies_checked else RejectReason.DUPLICATE_CONTENT
        return None

    def deliver(self, round: int, peer: str, content: bytes) -> None:
        self._delivered[round][peer] = content
        self._contents[round].add(content)

    def reject(self, round: int, peer: str, content: bytes) -> None:
        self._rejected[round].add((peer, content))

    def forget_before(self, round: int) -> None:
        """Drop rounds that can no longer be asked for (bounded memory)."""
        for table in (self._delivered, self._contents, self._rejected):
            for r in [r for r in table if r < round]:
                del table[r]


class KnownPeers:
    """Peers seen with a valid header recently: at most `max_peers`, none older than `keep_rounds` rounds."""

    def __init__(self, max_peers: int = 1024, keep_rounds: int = 10) -> None:
        self.max_peers, self.keep_rounds = max_peers, keep_rounds
        self._peers: OrderedDict[str, dict[str, Any]] = OrderedDict()  # least recently seen first
        self._failed: dict[str, int] = {}  # peer -> last round a fetch from it failed
        self._lock = threading.Lock()

    def saw(self, peer_id: str, *, round: int, model: str, adapter_version: str, size: int) -> None:
        with self._lock:
            old = self._peers.pop(peer_id, None)
            if old is not None and old["round"] > round:  # a stale round's header says less than a newer one
                self._peers[peer_id] = old
                return
            self._peers[peer_id] = {
                "peer_id": peer_id,
                "model": model,
                "adapter_version": adapter_version,
                "round": round,
                "size": size,
                "last_seen": time.time(),
            }
            while len(self._peers) > self.max_peers:
                gone, _ = self._peers.popitem(last=False)
                self._failed.pop(gone, None)

    def fetch_failed(self, peer_id: str, round: int) -> None:
        with self._lock:
            self._failed[peer_id] = max(round, self._failed.get(peer_id, -1))
            if len(self._failed) > self.max_peers:
                self._failed.pop(next(iter(self._failed)))

    def failed_recently(self, peer_id: str, round: int, window: int = 3) -> bool:
        with self._lock:
            last = self._failed.get(peer_id)
        return last is not None and round - last <= window

    def prune(self, current_round: int) -> None:
        with self._lock:
            for peer in [p for p, info in self._peers.items() if info["round"] < current_round - self.keep_rounds]:
                del self._peers[peer]
            for peer in [p for p, r in self._failed.items() if r < current_round - self.keep_rounds]:
                del self._failed[peer]

    def view(self) -> list[dict[str, Any]]:
        """Every known peer, most recently seen first (copies)."""
        with self._lock:
            return [dict(info) for info in reversed(self._peers.values())]

    def __len__(self) -> int:
        return len(self._peers)
