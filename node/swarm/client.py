"""Calls into the DHT process from any thread of the node (the pipe client)."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

from hivemind.utils import MPFuture

from node.swarm import bodies
from node.swarm.dht import SwarmDHT
from node.swarm.errors import DHTUnavailableError

__all__ = ["RecordClient"]


class RecordClient:
    """Every call the swarm makes to its DHT process, each returning a future at once.

    hivemind writes every call to one pipe without a lock, and a large message is two
    writes, so concurrent callers would interleave; the lock serialises the writes
    (not the calls). A dead DHT process would leave its pipe open in forked siblings,
    so a write could block forever once the pipe fills: each call checks that the
    process is alive first and raises DHTUnavailableError.
    """

    def __init__(self, dht: SwarmDHT, read_beam: int | None = None) -> None:
        """`read_beam`: nodes a get walks to (None: hivemind's default, its bucket size, 20)."""
        self.dht = dht
        self.read_beam = read_beam
        self._lock = threading.Lock()

    def _alive(self) -> None:
        if not self.dht.is_alive():
            raise DHTUnavailableError(f"the DHT process (pid {self.dht.pid}) is gone")

    def get(self, key: str) -> MPFuture:
        """The newest value of `key` (all owners' subkeys), merged over the nodes that hold it."""
        extra = {} if self.read_beam is None else {"beam_size": self.read_beam}
        with self._lock:
            self._alive()
            return self.dht.get(key, latest=True, return_future=True, **extra)

    def store(self, key: str, value: Any, expiration_time: float, subkey: bytes) -> MPFuture:
        with self._lock:
            self._alive()
            return self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True)

    def run(self, coro) -> MPFuture:
        """Run `coro(dht, node)` inside the DHT process."""
        with self._lock:
            self._alive()
            return self.dht.run_coroutine(coro, return_future=True)

    def install_body_service(self, keep_rounds: int, max_bytes: int) -> MPFuture:
        return self.run(partial(bodies.install_body_service, keep_rounds=keep_rounds, max_bytes=max_bytes))

    def offer_body(self, digest: bytes, round: int, body: bytes) -> MPFuture:
        """Serve `body` to peers that ask for `digest` (the caller vouches that it is its sha256)."""
        return self.run(partial(bodies.offer_body, digest=digest, round=round, body=body))

    def fetch_body(self, peer: str, digest: bytes, size: int, timeout: float) -> MPFuture:
        """Future of (body, "", seconds) or (None, reason, seconds); the sha256 is not checked here."""
        return self.run(partial(bodies.fetch_body, peer=peer, digest=digest, size=size, timeout=timeout))

    def shutdown(self) -> None:
        with self._lock:
            self.dht.shutdown()
