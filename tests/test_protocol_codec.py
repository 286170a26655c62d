"""Hand tests of the wire codec: round trips, sizes, and every rejection reason."""

from __future__ import annotations

import pickle
import struct

import msgpack
import numpy as np
import pytest
import zstandard
from pydantic import ValidationError

from protocol import (
    FLAG_ZSTD,
    FORMAT_VERSION,
    LOGPROB_FLOOR,
    MAGIC,
    MAX_DISPLAY_NAME_CHARS,
    PROTOCOL_VERSION,
    Completion,
    ErrorCode,
    Group,
    Limits,
    PacketHeader,
    ProtocolError,
    RolloutPacket,
    SamplingParams,
    decode,
    encode,
    high_bit_planes,
    peek_header,
)
from protocol.codec import PREFIX_SIZE

QWEN_VOCAB = 151_646
SMOL_VOCAB = 49_152


def make_header(vocab_size: int = QWEN_VOCAB, **overrides) -> PacketHeader:
    fields = dict(
        swarm_id="test-swarm",
        round=7,
        sender_peer_id="12D3KooWPeer",
        base_model_id="Qwen/Qwen2.5-0.5B",
        tokenizer_fingerprint="sha256:abcd",
        vocab_size=vocab_size,
        adapter_version="a1b2c3",
        created_at=1_700_000_000.5,
    )
    fields.update(overrides)
    return PacketHeader.create(**fields)


def make_packet(
    vocab_size: int = QWEN_VOCAB,
    *,
    groups: int = 2,
    completions: int = 3,
    tokens: int = 20,
    texts: bool = False,
    seed: int = 0,
) -> RolloutPacket:
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(temperature=0.7, top_p=0.95, top_k=50, max_tokens=tokens)
    return RolloutPacket(
        header=make_header(vocab_size),
        groups=[
            Group.of(
                f"task/{g}",
                "Qwen/Qwen2.5-0.5B",
                sampling,
                [
                    Completion.of(
                        rng.integers(0, vocab_size, tokens),
                        -rng.exponential(2.0, tokens),
                        text=f"answer {g}.{c} = ünïcode ✓" if texts else None,
                        finish_reason="length" if c == 0 else "stop",
                    )
                    for c in range(completions)
                ],
            )
            for g in range(groups)
        ],
    )


def split(data: bytes) -> tuple[int, int, dict, dict]:
    """Take an encoding apart along the documented layout (uncompressed body)."""
    magic, version, flags, hlen, blen = struct.unpack_from("<4sBBII", data)
    header = msgpack.unpackb(data[PREFIX_SIZE : PREFIX_SIZE + hlen])
    body = msgpack.unpackb(data[PREFIX_SIZE + hlen :])
    return version, flags, header, body


def assemble(
    header: object,
    body: object,
    *,
    flags: int = 0,
    version: int = FORMAT_VERSION,
    raw_body: bytes | None = None,
) -> bytes:
    h = msgpack.packb(header)
    b = raw_body if raw_body is not None else msgpack.packb(body)
    return struct.pack("<4sBBII", MAGIC, version, flags, len(h), len(b)) + h + b


DEFAULT_LIMITS = Limits()


def rejects(data: object, code: str, limits: Limits = DEFAULT_LIMITS) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data, limits)  # type: ignore[arg-type]
    assert info.value.code == code, info.value.reason
    assert info.value.reason  # a human-readable reason is always given
    return info.value


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("vocab_size", [2, 65_536, 65_537, SMOL_VOCAB, QWEN_VOCAB, 2**32])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(vocab_size: int, compress: bool) -> None:
    packet = make_packet(vocab_size, texts=True)
    out = decode(encode(packet, compress=compress))
    assert out.header == packet.header
    assert len(out.groups) == len(packet.groups)
    for g_in, g_out in zip(packet.groups, out.groups, strict=True):
        assert (g_out.task_id, g_out.generator_model_id, g_out.sampling) == (
            g_in.task_id,
            g_in.generator_model_id,
            g_in.sampling,
        )
        for c_in, c_out in zip(g_in.completions, g_out.completions, strict=True):
            assert c_out.token_ids.dtype == np.uint32 and c_out.logprobs.dtype == np.float32
            np.testing.assert_array_equal(c_out.token_ids, c_in.token_ids)
            np.testing.assert_allclose(c_out.logprobs, c_in.logprobs, rtol=0, atol=5e-4)
            assert (c_out.text, c_out.finish_reason) == (c_in.text, c_in.finish_reason)


def test_high_ids_survive_bit_planes() -> None:
    ids = [0, 65_535, 65_536, 131_071, 151_645, 2**17 + 12_345]
    packet = RolloutPacket(
        header=make_header(QWEN_VOCAB),
        groups=[Group.of("t", "m", SamplingParams(max_tokens=10), [Completion.of(ids, [0.0] * len(ids))])],
    )
    assert decode(encode(packet)).groups[0].completions[0].token_ids.tolist() == ids
    assert [high_bit_planes(v) for v in (1, 65_536, 65_537, QWEN_VOCAB, 2**18, 2**18 + 1, 2**32)] == [
        0,
        0,
        1,
        2,
        2,
        3,
        16,
    ]


def test_logprob_precision_and_clamp() -> None:
    lps = [0.0, -1e-6, -0.5, -16.3, -31.99, -49.9999, -50.0, -63.9999, -64.0, -64.5, -1000.0]
    packet = RolloutPacket(
        header=make_header(100),
        groups=[Group.of("t", "m", SamplingParams(max_tokens=20), [Completion.of(list(range(len(lps))), lps)])],
    )
    out = decode(encode(packet)).groups[0].completions[0].logprobs.astype(np.float64)
    expected = np.maximum(np.array(lps), LOGPROB_FLOOR)  # below -64 clamps to -64 (documented)
    assert np.abs(out - expected).max() < 5e-4
    assert out[0] == 0.0 and out[-1] == -64.0


def test_tiny_positive_logprob_is_float_noise_and_encodes_as_zero() -> None:
    c = Completion.of([1, 2], [5e-5, -1.0])
    packet = RolloutPacket(header=make_header(10), groups=[Group.of("t", "m", SamplingParams(max_tokens=2), [c])])
    assert decode(encode(packet)).groups[0].completions[0].logprobs[0] == 0.0


def test_empty_packet_and_empty_completion_round_trip() -> None:
    empty = RolloutPacket(header=make_header())
    assert decode(encode(empty)).groups == []
    packet = RolloutPacket(
        header=make_header(),
        groups=[Group.of("t", "m", SamplingParams(max_tokens=1), [Completion.of([], [])])],
    )
    out = decode(encode(packet, compress=True))
    assert out.groups[0].completions[0].token_ids.size == 0


@pytest.mark.parametrize("vocab_size,limit", [(QWEN_VOCAB, 4.5), (SMOL_VOCAB, 4.1)])
def test_bytes_per_token_on_realistic_packet(vocab_size: int, limit: float) -> None:
    packet = make_packet(vocab_size, groups=8, completions=12, tokens=200)
    assert packet.num_tokens == 19_200
    plain = len(encode(packet)) / packet.num_tokens
    assert plain <= limit
    assert len(encode(packet, compress=True)) < len(encode(packet))


def test_peek_header_reads_only_the_header() -> None:
    packet = make_packet()
    for data in (encode(packet), encode(packet, compress=True)):
        assert peek_header(data) == packet.header
        hlen = struct.unpack_from("<I", data, 6)[0]
        # The body may be missing entirely (a DHT record can carry just the header).
        assert peek_header(data[: PREFIX_SIZE + hlen]) == packet.header
    with pytest.raises(ProtocolError) as info:
        peek_header(encode(packet)[: PREFIX_SIZE + 3])
    assert info.value.code == "truncated"


# ----------------------------------------------------------------------------- the model path


def test_lists_become_numpy_arrays() -> None:
    c = Completion.of([1, 2, 3], [-0.1, -0.2, -0.3])
    assert c.token_ids.dtype == np.uint32 and c.logprobs.dtype == np.float32
    assert c == Completion.of(np.array([1, 2, 3], np.int64), np.array([-0.1, -0.2, -0.3]))
    assert c != Completion.of([1, 2, 4], [-0.1, -0.2, -0.3])
    assert len(c) == 3


@pytest.mark.parametrize(
    "ids,lps,match",
    [
        ([1, 2], [-0.1], "differ in length"),
        ([[1, 2]], [[-0.1, -0.2]], "1-D"),
        ([1.5, 2.0], [-0.1, -0.2], "integers"),
        ([-1, 2], [-0.1, -0.2], r"\[0, 2\*\*32\)"),
        ([1, 2**32], [-0.1, -0.2], r"\[0, 2\*\*32\)"),
        ([1, 2], [-0.1, 0.5], "<= 0"),
        ([1, 2], [-0.1, float("nan")], "finite"),
        ([1, 2], [float("-inf"), -0.2], "finite"),
        ([1, 2], ["a", "b"], "real numbers"),
    ],
)
def test_completion_construction_rejects(ids: list, lps: list, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        Completion.of(ids, lps)


def test_group_and_packet_construction_reject() -> None:
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValidationError, match="max_tokens=2"):
        Group.of("t", "m", sp, [Completion.of([1, 2, 3], [0.0] * 3)])
    with pytest.raises(ValidationError, match="at least 1"):
        Group.of("t", "m", sp, [])
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        RolloutPacket(header=make_header(10), groups=[Group.of("t", "m", sp, [Completion.of([3, 10], [0.0, 0.0])])])
    with pytest.raises(ValidationError, match="swarm id"):
        make_header(swarm_id="Bad Swarm!")
    for bad in (dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0)):
        with pytest.raises(ValidationError):
            SamplingParams(**{"max_tokens": 8, **bad})


def test_strings_must_be_encodable() -> None:
    with pytest.raises(ValidationError, match="not valid unicode"):
        Completion.of([1], [0.0], text="ok \udcff")
    with pytest.raises(ValidationError, match="unicode"):
        Group.of("task-\ud800", "m", SamplingParams(max_tokens=1), [Completion.of([1], [0.0])])


def test_json_dump_for_the_dashboard() -> None:
    packet = make_packet(groups=1, completions=1, tokens=3)
    dumped = packet.model_dump(mode="json")
    c = dumped["groups"][0]["completions"][0]
    assert c["token_ids"] == packet.groups[0].completions[0].token_ids.tolist()
    assert isinstance(c["logprobs"][0], float)
    assert packet.model_dump_json().startswith('{"header"')


def test_encode_rechecks_arrays_mutated_after_construction() -> None:
    packet = make_packet(1000, groups=1, completions=1, tokens=4)
    c = packet.groups[0].completions[0]
    c.token_ids[0] = 5000
    with pytest.raises(ProtocolError) as info:
        encode(packet)
    assert info.value.code == "bad_token_id"
    c.token_ids[0] = 1
    c.logprobs[1] = np.nan
    with pytest.raises(ProtocolError) as info:
        encode(packet)
    assert info.value.code == "bad_logprob"
    with pytest.raises(TypeError):
        encode(packet.header)  # type: ignore[arg-type]


def test_protocol_error_pickles_with_its_code() -> None:
    err = pickle.loads(pickle.dumps(ProtocolError("boom", code="bad_magic")))
    assert isinstance(err, ProtocolError) and err.code == "bad_magic" and err.reason == "boom"
    assert err.code is ErrorCode.BAD_MAGIC
    with pytest.raises(ValueError):
        ProtocolError("x", code="no_such_code")


# ----------------------------------------------------------------------------- rejections: framing


def test_reject_not_bytes() -> None:
    for value in ("FTIS", None, 12, [1, 2]):
        rejects(value, "not_bytes")
    data = encode(make_packet())
    assert decode(bytearray(data)).header == decode(memoryview(data)).header


def test_reject_too_large() -> None:
    data = encode(make_packet())
    rejects(data, "too_large", Limits(max_bytes=len(data) - 1))
    assert decode(data, Limits(max_bytes=len(data))).header.round == 7


def test_reject_truncated() -> None:
    data = encode(make_packet())
    for n in (0, 3, PREFIX_SIZE - 1, PREFIX_SIZE + 5, len(data) - 1):
        rejects(data[:n], "truncated")


def test_reject_trailing_bytes() -> None:
    rejects(encode(make_packet()) + b"\x00", "length_mismatch")


def test_reject_bad_magic() -> None:
    data = encode(make_packet())
    rejects(b"GIF89a" + data[6:], "bad_magic")
    rejects(b"X", "bad_magic")


def test_reject_bad_versions() -> None:
    data = bytearray(encode(make_packet()))
    data[4] = FORMAT_VERSION + 1
    rejects(bytes(data), "bad_version")
    future_header = PacketHeader(**{**make_header().model_dump(), "protocol_version": PROTOCOL_VERSION + 1})
    future = make_packet().model_copy(update={"header": future_header})
    err = rejects(encode(future), "bad_version")
    assert f"protocol version {PROTOCOL_VERSION + 1}" in err.reason
    with pytest.raises(ProtocolError) as info:
        peek_header(encode(future))
    assert info.value.code == "bad_version"


def test_reject_unknown_flags() -> None:
    data = bytearray(encode(make_packet()))
    data[5] |= 0x80
    rejects(bytes(data), "bad_flags")


def test_reject_msgpack_garbage() -> None:
    _, _, header, _ = split(encode(make_packet()))
    rejects(assemble(header, None, raw_body=b"\xc1\xc1\xc1"), "bad_msgpack")  # 0xc1 is never valid
    rejects(assemble(header, None, raw_body=msgpack.packb({}) + b"\x01"), "bad_msgpack")  # extra data
    h = b"\xc1"
    rejects(struct.pack("<4sBBII", MAGIC, FORMAT_VERSION, 0, len(h), 0) + h, "bad_msgpack")


# ----------------------------------------------------------------------------- rejections: compression


def test_reject_bad_compression() -> None:
    _, _, header, body = split(encode(make_packet()))
    raw = msgpack.packb(body)
    rejects(assemble(header, None, flags=FLAG_ZSTD, raw_body=raw), "bad_compression")  # not a frame
    frame = zstandard.ZstdCompressor().compress(raw)
    assert decode(assemble(header, None, flags=FLAG_ZSTD, raw_body=frame)).header.round == 7
    rejects(assemble(header, None, flags=FLAG_ZSTD, raw_body=frame + b"junk"), "bad_compression")
    rejects(assemble(header, None, flags=FLAG_ZSTD, raw_body=frame[:-4]), "bad_compression")
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    rejects(assemble(header, None, flags=FLAG_ZSTD, raw_body=unsized), "bad_compression")


def test_reject_decompression_bomb() -> None:
    _, _, header, _ = split(encode(make_packet()))
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * 10_000_000)  # ~330 bytes on the wire
    assert len(bomb) < 1000
    rejects(assemble(header, None, flags=FLAG_ZSTD, raw_body=bomb), "decompression_bomb")
    # The same bomb lying about its size (declares 1,000 bytes) is caught by the bounded output.
    liar = bytearray(bomb)
    assert liar[4] == 0x80  # frame header: 4-byte content size at offset 6
    liar[6:10] = struct.pack("<I", 1000)
    rejects(assemble(header, None, flags=FLAG_ZSTD, raw_body=bytes(liar)), "bad_compression")


# ----------------------------------------------------------------------------- rejections: schema


def test_reject_bad_header_schema() -> None:
    _, _, header, body = split(encode(make_packet()))
    rejects(assemble([1, 2], body), "bad_schema")
    for change in (
        {"round": "7"},  # wrong type: no coercion from the network
        {"round": -1},
        {"vocab_size": 0},
        {"created_at": float("nan")},
        {"swarm_id": "UPPER"},
        {"sender_peer_id": ""},
        {"sender_name": 7},
        {"extra_field": 1},
    ):
        rejects(assemble({**header, **change}, body), "bad_schema")
    missing = dict(header)
    del missing["tokenizer_fingerprint"]
    err = rejects(assemble(missing, body), "bad_schema")
    assert "tokenizer_fingerprint" in err.reason


def test_the_sender_name_travels_bounded_and_printable() -> None:
    # A stranger's label reaches dashboards, terminals and metric labels: bounded, one line.
    named = make_packet().model_copy(update={"header": make_header(sender_name="alice's laptop ✓")})
    assert decode(encode(named)).header.sender_name == "alice's laptop ✓"
    assert peek_header(encode(named)).sender_name == "alice's laptop ✓"
    _, _, header, body = split(encode(named))
    for bad in ("x" * (MAX_DISPLAY_NAME_CHARS + 1), "two\nlines", "esc\x1b[31m", "\u202eevil"):
        err = rejects(assemble({**header, "sender_name": bad}, body), "bad_schema")
        assert "sender_name" in err.reason
    unnamed = {k: v for k, v in header.items() if k != "sender_name"}  # the field is optional
    assert decode(assemble(unnamed, body)).header.sender_name == ""
    assert decode(assemble({**header, "sender_name": "x" * MAX_DISPLAY_NAME_CHARS}, body)).header.sender_name


def test_reject_bad_body_schema() -> None:
    _, _, header, body = split(encode(make_packet(texts=True)))
    rejects(assemble(header, [body]), "bad_schema")
    rejects(assemble(header, {k: v for k, v in body.items() if k != "ids_hi"}), "bad_schema")
    rejects(assemble(header, {**body, "more": 1}), "bad_schema")
    group = body["groups"][0]
    for bad_group in (
        group[:3],
        [group[0], group[1], group[2][:3], group[3]],
        [group[0], group[1], group[2], 0],
        [group[0], group[1], group[2], True],
        [7, group[1], group[2], group[3]],
        [group[0], group[1], [-1.0, *group[2][1:]], group[3]],  # temperature must be > 0
        [group[0], group[1], [*group[2][:2], "50", group[2][3]], group[3]],
    ):
        rejects(assemble(header, {**body, "groups": [bad_group, body["groups"][1]]}), "bad_schema")
    rejects(assemble(header, {**body, "groups": "x"}), "bad_schema")
    rejects(assemble(header, {**body, "lengths": [20] * 6}), "bad_schema")
    rejects(assemble(header, {**body, "finish": b"\x07" * 6}), "bad_schema")
    rejects(assemble(header, {**body, "texts": "abc"}), "bad_schema")
    rejects(assemble(header, {**body, "texts": [1] * 6}), "bad_schema")


def test_reject_lengths_that_disagree() -> None:
    _, _, header, body = split(encode(make_packet()))
    lengths = np.frombuffer(body["lengths"], "<u4")
    cases = {
        "lengths": lengths[:-1].tobytes(),  # one completion too few
        "finish": body["finish"][:-1],
        "ids_lo": body["ids_lo"][:-2],
        "logprobs": body["logprobs"] + b"\x00\x00",
        "ids_hi": body["ids_hi"] + b"\x00",
        "texts": [None] * 5,
    }
    for key, value in cases.items():
        err = rejects(assemble(header, {**body, key: value}), "length_mismatch")
        assert f"'{key}'" in err.reason
    rejects(assemble(header, {**body, "lengths": body["lengths"][:-1]}), "length_mismatch")  # not a multiple of 4
    # Moving one token between completions keeps the total but breaks max_tokens=20.
    moved = lengths.copy()
    moved[0] += 1
    moved[1] -= 1
    err = rejects(assemble(header, {**body, "lengths": moved.tobytes()}), "length_mismatch")
    assert "max_tokens=20" in err.reason


def test_reject_ids_outside_vocab() -> None:
    packet = make_packet(1000)
    _, _, header, body = split(encode(packet))
    ids = np.frombuffer(body["ids_lo"], "<u2").copy()
    ids[25] = 1000
    err = rejects(assemble(header, {**body, "ids_lo": ids.tobytes()}), "bad_token_id")
    assert "completion 1" in err.reason and "1000" in err.reason
    # A high bit-plane that sets bit 17 on a vocabulary of 151,646 (max id 151,645) is caught too.
    _, _, header, body = split(encode(make_packet(QWEN_VOCAB)))
    planes = np.frombuffer(body["ids_hi"], np.uint8).reshape(2, -1).copy()
    lo = np.frombuffer(body["ids_lo"], "<u2").copy()
    lo[0] = 65_535
    planes[:, 0] |= 0x80  # bits 16 and 17 of token 0 -> id 262,143
    rejects(assemble(header, {**body, "ids_lo": lo.tobytes(), "ids_hi": planes.tobytes()}), "bad_token_id")


# ----------------------------------------------------------------------------- rejections: limits


def test_reject_over_limits() -> None:
    data = encode(make_packet(groups=3, completions=4, tokens=20, texts=True))
    assert decode(data).num_tokens == 240
    rejects(data, "too_many_groups", Limits(max_groups=2))
    rejects(data, "too_many_completions", Limits(max_completions_per_group=3))
    rejects(data, "completion_too_long", Limits(max_tokens_per_completion=19))
    rejects(data, "too_many_tokens", Limits(max_total_tokens=239))
    rejects(data, "text_too_long", Limits(max_text_chars=5))
    ok = Limits(max_groups=3, max_completions_per_group=4, max_tokens_per_completion=20, max_total_tokens=240)
    assert decode(data, ok).num_completions == 12


def test_limits_are_validated() -> None:
    with pytest.raises(ValidationError):
        Limits(max_groups=0)
    with pytest.raises(ValidationError):
        Limits(max_bytes=10, unknown=1)  # type: ignore[call-arg]


# ----------------------------------------------------------------------------- the benchmark


def test_protocol_bench_figures() -> None:
    from node.bench.protocol import format_protocol_bench, run_protocol_bench

    result = run_protocol_bench(repeats=1)
    assert result["tokens_per_packet"] == 8 * 12 * 200
    assert result["paper_bytes_per_token"] == 8.0
    assert result["bytes_per_token"] <= 4.5
    assert result["bytes_per_token_vocab49k"] <= 4.5
    assert result["bytes_per_token_zstd"] < result["bytes_per_token"]
    assert result["json_bytes_per_token"] > result["paper_bytes_per_token"]
    assert 0 < result["max_abs_logprob_error"] < 1e-3
    assert result["encode_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    table = format_protocol_bench(result)
    assert "B/token" in table and "M tokens/s" in table
    with pytest.raises(ValueError):
        run_protocol_bench(repeats=0)
