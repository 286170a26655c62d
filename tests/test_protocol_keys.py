"""DHT key naming and round arithmetic."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import ProtocolError, parse_round_key, round_at, round_key, round_start, validate_swarm_id

FAST = settings(derandomize=True, deadline=None, max_examples=300)


def test_round_key_format() -> None:
    assert round_key("demo", 0) == "ftis/demo/0"
    assert round_key("gsm-8k_v2", 1_234_567) == "ftis/gsm-8k_v2/1234567"
    assert parse_round_key("ftis/demo/42") == ("demo", 42)


@pytest.mark.parametrize("swarm_id", ["a", "0", "demo", "my-swarm_2", "x" * 64])
def test_good_swarm_ids(swarm_id: str) -> None:
    assert validate_swarm_id(swarm_id) == swarm_id


@pytest.mark.parametrize("swarm_id", ["", "x" * 65, "Demo", "my swarm", "a/b", "-lead", "_x", "café", "a.b", 5, None])
def test_bad_swarm_ids(swarm_id: object) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_swarm_id(swarm_id)  # type: ignore[arg-type]
    assert info.value.code == "bad_swarm_id"
    with pytest.raises(ProtocolError):
        round_key(swarm_id, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("round", [-1, 1.0, "3", True, None])
def test_bad_rounds(round: object) -> None:
    with pytest.raises(ProtocolError) as info:
        round_key("demo", round)  # type: ignore[arg-type]
    assert info.value.code == "bad_round"


@pytest.mark.parametrize(
    "key",
    [
        "ftis/demo",
        "ftis/demo/1/2",
        "dht/demo/1",
        "ftis/demo/-1",
        "ftis/demo/01",
        "ftis/demo/1e3",
        "ftis/Demo/1",
        3,
    ],
)
def test_parse_round_key_rejects(key: object) -> None:
    with pytest.raises(ProtocolError):
        parse_round_key(key)  # type: ignore[arg-type]


def test_round_at_is_floor() -> None:
    assert round_at(0.0, 30) == 0
    assert round_at(29.999, 30) == 0
    assert round_at(30.0, 30) == 1
    assert round_at(1_700_000_015.0, 30) == 56_666_667
    # round_start(3, 0.7) == 2.0999999999999996 and 2.0999999999999996 / 0.7 == 2.9999999999999996:
    # a plain floor would put the start of round 3 into round 2.
    assert math.floor(round_start(3, 0.7) / 0.7) == 2
    assert round_at(round_start(3, 0.7), 0.7) == 3
    assert round_start(56_666_667, 30) == 1_700_000_010.0


@pytest.mark.parametrize(
    "t,s",
    [
        (-1.0, 30),
        (math.nan, 30),
        (math.inf, 30),
        (10.0, 0),
        (10.0, -5),
        (10.0, math.nan),
        ("1", 30),
        (1.0, "30"),
    ],
)
def test_round_at_rejects(t: object, s: object) -> None:
    with pytest.raises(ValueError):
        round_at(t, s)  # type: ignore[arg-type]


@FAST
@given(st.integers(0, 2**40), st.floats(min_value=1e-3, max_value=1e5))
def test_round_start_and_round_at_are_inverse(r: int, seconds: float) -> None:
    start = round_start(r, seconds)
    assert round_at(start, seconds) == r
    nxt = round_start(r + 1, seconds)
    if nxt > start:  # below float resolution two rounds can share a start
        assert round_at(math.nextafter(nxt, 0.0), seconds) == r


@FAST
@given(st.floats(min_value=0, max_value=1e11), st.floats(min_value=1e-2, max_value=1e5))
def test_round_at_contains_t(t: float, seconds: float) -> None:
    r = round_at(t, seconds)
    assert round_start(r, seconds) <= t < round_start(r + 1, seconds)


@FAST
@given(st.from_regex(r"[a-z0-9][a-z0-9_-]{0,63}", fullmatch=True), st.integers(0, 2**63))
def test_parse_inverts_round_key(swarm_id: str, r: int) -> None:
    assert parse_round_key(round_key(swarm_id, r)) == (swarm_id, r)
