"""DHT naming and round arithmetic.

Rounds are time buckets, not coordinator-driven: `round = floor(dht_time / round_seconds)`.
Every node computes the same bucket from (roughly) the same DHT clock, so a late node
just publishes into the current bucket. One DHT key per (swarm, round):

    ftis/<swarm_id>/<round>

with the sender's public key as the subkey (set by the swarm layer, not here).
"""

from __future__ import annotations

import math
import re

from protocol.errors import ErrorCode, ProtocolError

__all__ = [
    "KEY_PREFIX",
    "MAX_SWARM_ID_CHARS",
    "STALE_ROUNDS",
    "parse_round_key",
    "round_at",
    "round_key",
    "round_start",
    "validate_swarm_id",
]

KEY_PREFIX = "ftis"
MAX_SWARM_ID_CHARS = 64
# A node reads (and admits) packets of the current round and this many rounds before it: a
# peer whose round ran long still counts once. The gather and admission use the same window.
STALE_ROUNDS = 1
# Lower-case so that two spellings never name two swarms; must start alphanumeric so a
# swarm id can never look like an option ("-x") or a hidden name ("_x").
_SWARM_ID_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")
_ROUND_RE = re.compile(r"0|[1-9][0-9]*")


def validate_swarm_id(swarm_id: str) -> str:
    """Return `swarm_id` unchanged if it is 1-64 chars of [a-z0-9_-], starting with [a-z0-9]."""
    if not isinstance(swarm_id, str):
        raise ProtocolError(f"swarm id must be a str, got {type(swarm_id).__name__}", code=ErrorCode.BAD_SWARM_ID)
    if not 1 <= len(swarm_id) <= MAX_SWARM_ID_CHARS:
        raise ProtocolError(
            f"swarm id must be 1-{MAX_SWARM_ID_CHARS} characters, got {len(swarm_id)}",
            code=ErrorCode.BAD_SWARM_ID,
        )
    if not _SWARM_ID_RE.fullmatch(swarm_id):
        raise ProtocolError(
            f"swarm id {swarm_id!r} may only contain a-z, 0-9, '-' and '_' and must start with a letter or digit",
            code=ErrorCode.BAD_SWARM_ID,
        )
    return swarm_id


def _check_round(round: int) -> int:
    # bool is an int subclass; True as a round number is always a bug.
    if not isinstance(round, int) or isinstance(round, bool):
        raise ProtocolError(f"round must be an int, got {type(round).__name__}", code=ErrorCode.BAD_ROUND)
    if round < 0:
        raise ProtocolError(f"round must be >= 0, got {round}", code=ErrorCode.BAD_ROUND)
    return round


def _check_round_seconds(round_seconds: float) -> float:
    if not isinstance(round_seconds, (int, float)) or isinstance(round_seconds, bool):
        raise ValueError(f"round_seconds must be a number, got {type(round_seconds).__name__}")
    if not (math.isfinite(round_seconds) and round_seconds > 0):
        raise ValueError(f"round_seconds must be a positive finite number, got {round_seconds}")
    return float(round_seconds)


def round_key(swarm_id: str, round: int) -> str:
    """The DHT key under which every node of `swarm_id` publishes its packet for `round`."""
    return f"{KEY_PREFIX}/{validate_swarm_id(swarm_id)}/{_check_round(round)}"


def parse_round_key(key: str) -> tuple[str, int]:
    """Inverse of `round_key`: `"ftis/demo/12"` -> `("demo", 12)`."""
    if not isinstance(key, str):
        raise ProtocolError(f"key must be a str, got {type(key).__name__}", code=ErrorCode.BAD_ROUND)
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != KEY_PREFIX:
        raise ProtocolError(f"key {key!r} is not of the form '{KEY_PREFIX}/<swarm>/<round>'", code=ErrorCode.BAD_ROUND)
    swarm_id = validate_swarm_id(parts[1])
    if not _ROUND_RE.fullmatch(parts[2]):
        raise ProtocolError(f"round {parts[2]!r} in key {key!r} is not a decimal integer", code=ErrorCode.BAD_ROUND)
    return swarm_id, int(parts[2])


def round_start(round: int, round_seconds: float) -> float:
    """DHT time (seconds) at which `round` begins."""
    return _check_round(round) * _check_round_seconds(round_seconds)


def round_at(dht_time: float, round_seconds: float) -> int:
    """The round that contains `dht_time`: the largest r with `round_start(r) <= dht_time`.

    Plain `floor(t / s)` can be off by one at bucket edges in floating point (e.g. it
    may put `round_start(r)` itself in round r - 1); the fix-up below makes the two
    functions exact inverses at every boundary.
    """
    seconds = _check_round_seconds(round_seconds)
    if not isinstance(dht_time, (int, float)) or isinstance(dht_time, bool):
        raise ValueError(f"dht_time must be a number, got {type(dht_time).__name__}")
    if not (math.isfinite(dht_time) and dht_time >= 0):
        raise ValueError(f"dht_time must be a finite number >= 0, got {dht_time}")
    r = math.floor(dht_time / seconds)
    if r * seconds > dht_time:
        r -= 1
    elif (r + 1) * seconds <= dht_time:
        r += 1
    return r
