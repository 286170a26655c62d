"""The decoder's work is bounded by the limits, not by what a packet's bytes claim.

Each known hostile packet (node/bench/fuzz_cases.py `hostile_cases`) is rejected with
its reason and a bounded Python-heap peak (tracemalloc counts every object and numpy
buffer). Time is not asserted here: `ftis-node bench fuzz` measures it.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import zstandard

from node.bench.fuzz import heap_peak_mib
from node.bench.fuzz_cases import FuzzContext, frame, hostile_cases, zstd_frame
from node.tasks import get_task
from protocol import Completion, Limits, PacketHeader, ProtocolError, RolloutPacket, decode, encode
from protocol.codec import MAX_HEADER_BYTES, PREFIX_SIZE
from protocol.packet import MAX_NAME_CHARS
from protocol.reader import BoundedReader, kind_of

LIMITS = Limits()
CTX = FuzzContext(
    swarm_id="fuzz",
    round=1000,
    peer_id="QmPeer",
    fingerprint="sha256:ours",
    vocab_size=512,
    max_positions=512,
    tokenize=lambda text: list(text.encode()),
    task=get_task("toy"),
    limits=LIMITS,
)
EXPECTED = {
    "groups_4M_empty_arrays_zstd": "too_many_groups",
    "body_map_300k_keys_zstd": "bad_schema",
    "texts_4M_nils_zstd": "length_mismatch",
    "task_id_1M_nested_zstd": "bad_schema",
    "sampling_1M_items_zstd": "bad_schema",
    "group_count_2e9_zstd": "too_many_completions",
    "body_4MiB_nested_arrays_raw": "bad_schema",
    "header_8KiB_nested_arrays": "bad_schema",
    "header_4MiB": "too_large",
    "zstd_declares_8MiB": "decompression_bomb",
    "zstd_window_2GiB": "bad_compression",
    "zstd_unsized_16MiB": "bad_compression",
    "zstd_expands_past_limit": "decompression_bomb",
    "max_tokens_last_id_bad": "bad_token_id",
    "max_tokens_valid": None,
}


@pytest.fixture(scope="module")
def hostile() -> dict[str, bytes]:
    return hostile_cases(CTX)


def outcome(data: bytes) -> str | None:
    try:
        decode(data, LIMITS)
    except ProtocolError as err:
        return err.code.value
    return None


def test_the_list_of_hostile_cases_is_known(hostile: dict[str, bytes]) -> None:
    assert set(hostile) == set(EXPECTED)
    assert len(hostile["groups_4M_empty_arrays_zstd"]) < 600  # the issue's ~13,000x amplification
    assert all(len(d) <= LIMITS.max_bytes for d in hostile.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_packet_is_rejected_with_bounded_memory(hostile: dict[str, bytes], name: str) -> None:
    data = hostile[name]
    assert outcome(data) == EXPECTED[name]
    peak = heap_peak_mib(lambda: outcome(data))
    if EXPECTED[name] is None:
        # The largest valid packet (1M tokens): its arrays, about 8 bytes per token.
        assert peak <= 32
    else:
        # Before the fix: 249 MiB for the 4M-groups case. Rejection may copy the (at most
        # 4 MiB) body a couple of times, never build what its bytes announce.
        assert peak <= 16, f"{name}: {peak:.1f} MiB"


def test_rejection_costs_the_bytes_not_what_they_announce(hostile: dict[str, bytes]) -> None:
    # 4 million arrays announced (about 224 MiB as Python lists) in a 4 MB body: the
    # rejection costs a small multiple of those 4 MB, as it does for 40,000 announced.
    small = frame(None, {"groups": [[]] * 40_000}, compress=True, raw_header=_header_bytes())
    big = hostile["groups_4M_empty_arrays_zstd"]
    assert outcome(small) == outcome(big) == "too_many_groups"
    assert heap_peak_mib(lambda: outcome(small)) <= 3 * 40_000 / 2**20 + 0.25
    assert heap_peak_mib(lambda: outcome(big)) <= 3 * 4_000_000 / 2**20 + 0.25


def _header_bytes() -> bytes:
    return msgpack.packb(
        PacketHeader.create(
            swarm_id="fuzz", round=1, sender_peer_id="p", base_model_id="m", tokenizer_fingerprint="f", vocab_size=512
        ).model_dump()
    )


def _body(**change: object) -> dict[str, object]:
    body: dict[str, object] = {
        "groups": [["toy/id/1", "m", [1.0, 1.0, 0, 4], 1]],
        "lengths": struct.pack("<I", 2),
        "finish": b"\x00",
        "texts": None,
        "ids_lo": struct.pack("<2H", 5, 9),
        "ids_hi": b"",
        "logprobs": b"\x00\x00\x00\x00",
    }
    body.update(change)
    return body


def test_reference_body_decodes() -> None:
    packet = decode(frame(None, _body(), compress=False, raw_header=_header_bytes()))
    assert packet.groups[0].completions[0].token_ids.tolist() == [5, 9]


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"groups": [["toy/id/1", "m", [1.0, 1.0, 0, 4], 1]] * 257}, "too_many_groups"),
        ({"groups": [[["nested"], "m", [1.0, 1.0, 0, 4], 1]]}, "bad_schema"),
        ({"groups": [["toy/id/1", "m", [1.0, 1.0, 0, [4]], 1]]}, "bad_schema"),
        ({"groups": [["toy/id/1", "m", {"t": 1.0}, 1]]}, "bad_schema"),
        ({"groups": [["toy/id/1", "m", [1.0, 1.0, 0, 4], 1, 5]]}, "bad_schema"),
        ({"groups": [["t" * (4 * MAX_NAME_CHARS + 1), "m", [1.0, 1.0, 0, 4], 1]]}, "bad_schema"),
        ({"groups": [["toy/id/1", "m", [msgpack.ExtType(1, b"x"), 1.0, 0, 4], 1]]}, "bad_schema"),
        ({"texts": [None] * 40_000}, "length_mismatch"),
        ({"texts": [[None]]}, "bad_schema"),
        ({"texts": ["x" * 800_001]}, "text_too_long"),
        ({"lengths": [2]}, "bad_schema"),
    ],
)
def test_structure_is_checked_as_it_is_read(change: dict[str, object], code: str) -> None:
    data = frame(None, _body(**change), compress=False, raw_header=_header_bytes())
    assert outcome(data) == code


def _map(pairs: list[tuple[str, object]]) -> bytes:
    """A msgpack map from pairs as they are, repeats included."""
    return bytes([0x80 | len(pairs)]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in pairs)


def test_body_map_entries_are_counted_and_unique() -> None:
    h = _header_bytes()
    fields = list(_body().items())
    assert outcome(frame(None, _map(fields), compress=False, raw_header=h)) is None
    assert outcome(frame(None, _map([*fields, ("groups", [])]), compress=False, raw_header=h)) == "bad_schema"
    # The same field twice in a map of 7: in a plain dict the last one would silently win.
    dup = [*fields[:-1], ("groups", [])]
    with pytest.raises(ProtocolError) as info:
        decode(frame(None, _map(dup), compress=False, raw_header=h))
    assert info.value.code == "bad_schema" and "twice" in info.value.reason


def test_header_keys_are_unique_and_the_header_bounded() -> None:
    pairs = list(msgpack.unpackb(_header_bytes()).items())
    assert outcome(frame(None, _body(), compress=False, raw_header=_map(pairs))) is None
    with pytest.raises(ProtocolError) as info:
        decode(frame(None, _body(), compress=False, raw_header=_map([*pairs, ("round", 2)])))
    assert info.value.code == "bad_schema" and "twice" in info.value.reason
    big = frame(None, _body(), compress=False, raw_header=b"\xc0" * (MAX_HEADER_BYTES + 1))
    assert outcome(big) == "too_large"


def test_the_largest_valid_header_fits_the_header_bound() -> None:
    name = "\U0001f600" * MAX_NAME_CHARS  # 4 bytes per character in UTF-8
    header = PacketHeader.create(
        swarm_id="s" * 64,
        round=2**63 - 1,
        sender_peer_id=name,
        base_model_id=name,
        adapter_version=name,
        tokenizer_fingerprint=name,
        vocab_size=2**32,
        created_at=1e300,
    )
    packet = RolloutPacket(header=header, groups=[])
    data = encode(packet)
    header_len = struct.unpack_from("<I", data, 6)[0]
    assert header_len <= MAX_HEADER_BYTES
    assert decode(data).header == header


def test_zstd_frames_are_bounded() -> None:
    h = _header_bytes()
    body = msgpack.packb(_body())
    ok = zstd_frame(body)
    assert decode(frame(None, b"", compress=False, raw_header=h, zstd_body=ok)).header.round == 1
    for bad, code in (
        (zstd_frame(body, window_log=31), "bad_compression"),  # asks for a 2 GiB window
        (zstd_frame(body, declared=len(body) - 1), "bad_compression"),  # lies: more data than declared
        (zstd_frame(body, declared=len(body) + 1), "bad_compression"),  # lies: less data than declared
        (zstd_frame(body, declared=LIMITS.max_bytes + 1), "decompression_bomb"),
        (zstandard.ZstdCompressor().compress(body) * 2, "bad_compression"),  # two frames
    ):
        assert outcome(frame(None, b"", compress=False, raw_header=h, zstd_body=bad)) == code


def test_bounded_reader_checks_before_it_reads() -> None:
    buf = msgpack.packb({"a": [1, 2, 3], "b": b"xy"})
    r = BoundedReader(buf, "test", max_str_bytes=16, max_items=8)
    assert r.peek_kind() == "map"
    assert r.container("map", "m", 2) == 2
    assert r.scalar("key", frozenset({"str"})) == "a"
    with pytest.raises(ProtocolError, match="over 2"):
        BoundedReader(buf[3:], "test", max_str_bytes=16, max_items=8).container("array", "list", 2)
    assert r.container("array", "list", 3) == 3
    assert [r.scalar("item") for _ in range(3)] == [1, 2, 3]
    assert r.scalar("key") == "b"
    with pytest.raises(ProtocolError, match="over the limit of 1") as info:
        r.scalar("bin", max_bytes=1)
    assert info.value.code == "bad_schema"
    assert r.scalar("bin", frozenset({"bin"})) == b"xy"
    r.finish()
    with pytest.raises(ProtocolError) as info:
        BoundedReader(buf + b"\x00", "test", max_str_bytes=16, max_items=8).finish()
    assert info.value.code == "bad_msgpack"
    for bad in (b"", b"\xc1", b"\xdd\x00\x00", b"\xd9"):
        with pytest.raises(ProtocolError) as info:
            BoundedReader(bad, "test", max_str_bytes=16, max_items=8).container("array", "x", 10)
        assert info.value.code in ("bad_msgpack", "bad_schema")
    kinds = {kind_of(b) for b in range(256)}
    assert kinds == {"int", "float", "str", "bin", "nil", "bool", "array", "map", "ext", "invalid"}


def test_trusted_completion_is_a_real_completion() -> None:
    ids, lps = np.array([1, 2], np.uint32), np.array([-0.5, -1.0], np.float32)
    fast = Completion.trusted(ids, lps, "hi", "length")
    slow = Completion(token_ids=ids, logprobs=lps, text="hi", finish_reason="length")
    assert tuple(Completion.model_fields) == ("token_ids", "logprobs", "text", "finish_reason")
    assert fast == slow and fast.model_dump_json() == slow.model_dump_json() and repr(fast) == repr(slow)
    assert fast.model_fields_set == slow.model_fields_set
    assert fast.model_copy(update={"text": "x"}).text == "x"
    with pytest.raises(Exception):
        fast.text = "y"  # type: ignore[misc]  # frozen like any Completion


def test_decode_output_round_trips_after_the_rewrite() -> None:
    header = PacketHeader.create(
        swarm_id="s", round=3, sender_peer_id="p", base_model_id="m", tokenizer_fingerprint="f", vocab_size=151_646
    )
    from protocol import Group, SamplingParams

    rng = np.random.default_rng(0)
    groups = [
        Group.of(
            f"t/{g}",
            "m",
            SamplingParams(max_tokens=30),
            [Completion.of(rng.integers(0, 151_646, 30), -rng.exponential(1.0, 30), text=f"{g}") for _ in range(3)],
        )
        for g in range(4)
    ]
    packet = RolloutPacket(header=header, groups=groups)
    for compress in (False, True):
        data = encode(packet, compress=compress)
        out = decode(data)
        assert encode(out, compress=compress) == encode(decode(encode(out, compress=compress)), compress=compress)
        assert [c.token_ids.tolist() for _, c in out.completions()] == [
            c.token_ids.tolist() for _, c in packet.completions()
        ]
        assert len(data) > PREFIX_SIZE
