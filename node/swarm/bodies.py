"""Packet bodies: served by their sender over libp2p, fetched by sha256.

Headers in the DHT are small; a body (tens to hundreds of KiB) goes from the sender's
`BodyStore` to the one receiver that asked, over a libp2p stream to the sender's peer id
(connections are authenticated by the peer's identity key, the key that signed the header).

This code runs inside the DHT process, registered on the DHT's own P2P instance with
`DHT.run_coroutine`: one p2pd and one event loop per node, and the daemon stays plain
synchronous code. A body crosses the DHT pipe once each way (the pipe fix in `dht.py`
makes that safe).
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

from hivemind.p2p import P2P, PeerID

from node.swarm.record import RejectReason

__all__ = ["BODY_HANDLER", "BodyStore", "fetch_body", "install_body_service", "offer_body"]

logger = logging.getLogger(__name__)

BODY_HANDLER = "ftis.body.v1"
_BODY_OK, _BODY_MISSING = b"\x00", b"\x01"
_LEN_BYTES = 8  # the length prefix of hivemind's P2P.send_raw_data
_SERVE_TIMEOUT_S = 60.0  # a reader slower than this loses the stream
_FETCH_RETRY_S = 0.1  # pause before the one retry of a failed body fetch


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


# The coroutines below are sent to the DHT process (`DHT.run_coroutine(fn(dht, node))`).


async def install_body_service(dht, node, keep_rounds: int, max_bytes: int) -> None:
    dht.ftis_bodies = BodyStore(keep_rounds, max_bytes)
    await node.p2p.add_binary_stream_handler(BODY_HANDLER, partial(_serve_body, dht.ftis_bodies))


async def offer_body(dht, _node, digest: bytes, round: int, body: bytes) -> None:
    dht.ftis_bodies.put(digest, round, body)


async def fetch_body(
    _dht, node, peer: str, digest: bytes, size: int, timeout: float
) -> tuple[bytes | None, str, float]:
    """(body, "", seconds) or (None, reason, seconds) for a body of the announced `size`.

    The sha256 is checked by the caller. `seconds` is the fetch's own duration, timed here
    (the caller may look at the result much later: a fetch can outlive the gather that
    started it). Failures are returned, not raised: hivemind logs raised ones loudly.
    """

    async def fetch() -> tuple[bytes | None, str]:
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), BODY_HANDLER)
        try:
            await P2P.send_raw_data(digest, writer)
            status = await reader.readexactly(1)
            length = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
            if status != _BODY_OK:
                return None, RejectReason.BODY_NOT_FOUND
            if length != size:  # never read more than the header announced
                return None, RejectReason.SIZE_MISMATCH
            return await reader.readexactly(length), ""
        finally:
            writer.close()

    async def fetch_with_retry() -> tuple[bytes | None, str]:
        # A dial or stream open can fail transiently on a loaded host (p2pd answers ControlFailure):
        # one retry inside the same time budget, so a busy moment does not reject a packet.
        try:
            return await fetch()
        except Exception as e:  # TimeoutError is the budget's own: it cancels us, never lands here
            logger.debug("body fetch from %s failed, retrying once: %r", peer, e)
        await asyncio.sleep(_FETCH_RETRY_S)
        return await fetch()

    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            body, reason = await fetch_with_retry()
    except TimeoutError:
        body, reason = None, RejectReason.FETCH_TIMEOUT
    except Exception as e:  # unreachable peer, reset stream, bad peer id: all the sender's problem
        logger.debug("body fetch from %s failed: %r", peer, e)
        body, reason = None, RejectReason.FETCH_FAILED
    return body, reason, time.monotonic() - started
