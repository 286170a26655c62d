"""Rounds as time buckets of the DHT clock (`protocol.keys.round_at`): when the next one
starts, and how long a node that has played its last round keeps serving it. No coordinator
and no barrier; every wait sleeps in slices so that a stop is seen within a quarter second."""

from __future__ import annotations

import time
from collections.abc import Callable

from protocol.keys import STALE_ROUNDS, round_at, round_start


def current_round(dht_time: float, round_seconds: float, round_done: int | None) -> int:
    """The round to play: the current bucket, or the one after the last played while that
    bucket is still running (it starts at `round_start(r)`)."""
    r = round_at(dht_time, round_seconds)
    return round_done + 1 if round_done is not None and r <= round_done else r


def last_packet_wait(r: int, dht_time: float, round_seconds: float) -> float:
    """How long round r's body must stay fetchable after the node's last round (--rounds).

    Peers read round r in their gathers of rounds r .. r + STALE_ROUNDS; the last of those
    ends with bucket r + STALE_ROUNDS. So: until then, at most (1 + STALE_ROUNDS) round
    lengths, less if the last round ran late."""
    return min(round_start(r + 1 + STALE_ROUNDS, round_seconds) - dht_time, (1 + STALE_ROUNDS) * round_seconds)


def sleep_until(remaining: Callable[[], float], stopping: Callable[[], bool]) -> None:
    """Sleep until `remaining()` (seconds left) is up, in slices of at most a quarter second
    so that `stopping()` is seen quickly."""
    while not stopping():
        left = remaining()
        if left <= 0:
            return
        time.sleep(min(left, 0.25))
