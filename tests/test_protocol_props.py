"""Property tests of the codec: random valid packets round-trip, and no input, random
or a mutated valid encoding, makes decode raise anything but ProtocolError."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from protocol import (
    FORMAT_VERSION,
    LOGPROB_FLOOR,
    MAGIC,
    Completion,
    Group,
    Limits,
    PacketHeader,
    ProtocolError,
    RolloutPacket,
    SamplingParams,
    decode,
    encode,
    peek_header,
)
from protocol.codec import FLAG_ZSTD, PREFIX_SIZE

# derandomize: the same examples on every run, so a failure is reproducible in CI.
FAST = settings(derandomize=True, deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow])

VOCABS = st.sampled_from([1, 2, 255, 49_152, 65_536, 65_537, 151_646, 2**18, 2**18 + 1, 2**32])
NAMES = st.text(min_size=1, max_size=24)
SWARM_IDS = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True)
LOGPROBS = st.one_of(
    st.floats(min_value=-80.0, max_value=0.0, width=32),
    st.sampled_from([0.0, -0.0, -1e-30, 5e-5, -63.9999, -64.0, -64.0001, -50.0]),
)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.floats(min_value=0.0, max_value=100.0, exclude_min=True)),
        top_p=draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True)),
        top_k=draw(st.integers(0, 2**32 - 1)),
        max_tokens=draw(st.one_of(st.integers(1, 24), st.integers(1, 2**32 - 1))),
    )


@st.composite
def groups(draw: st.DrawFn, vocab_size: int) -> Group:
    sampling = draw(sampling_params())
    comps = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, min(sampling.max_tokens, 24)))
        comps.append(
            Completion(
                token_ids=draw(arrays(np.uint32, n, elements=st.integers(0, vocab_size - 1))),
                logprobs=draw(arrays(np.float32, n, elements=LOGPROBS)),
                text=draw(st.none() | st.text(max_size=16)),
                finish_reason=draw(st.sampled_from(["stop", "length"])),
            )
        )
    return Group(task_id=draw(NAMES), generator_model_id=draw(NAMES), sampling=sampling, completions=comps)


@st.composite
def packets(draw: st.DrawFn) -> RolloutPacket:
    vocab = draw(VOCABS)
    header = PacketHeader(
        swarm_id=draw(SWARM_IDS),
        round=draw(st.integers(0, 2**63 - 1)),
        sender_peer_id=draw(NAMES),
        base_model_id=draw(NAMES),
        adapter_version=draw(NAMES),
        tokenizer_fingerprint=draw(NAMES),
        vocab_size=vocab,
        created_at=draw(st.floats(min_value=0.0, max_value=1e12)),
    )
    return RolloutPacket(header=header, groups=draw(st.lists(groups(vocab), max_size=4)))


DEFAULT_LIMITS = Limits()


def decodes_or_rejects(data: bytes, limits: Limits = DEFAULT_LIMITS) -> RolloutPacket | None:
    """The contract: a valid packet (that re-encodes) or ProtocolError, never anything else."""
    try:
        packet = decode(data, limits)
    except ProtocolError as e:
        assert e.reason
        return None
    encode(packet)  # whatever decode accepts is a well-formed packet
    return packet


# ----------------------------------------------------------------------------- round trip


@FAST
@given(packets(), st.booleans())
def test_round_trip_preserves_everything(packet: RolloutPacket, compress: bool) -> None:
    data = encode(packet, compress=compress)
    out = decode(data)
    assert peek_header(data) == packet.header
    assert out.header == packet.header
    assert len(out.groups) == len(packet.groups)
    for g_in, g_out in zip(packet.groups, out.groups, strict=True):
        assert g_out.task_id == g_in.task_id
        assert g_out.generator_model_id == g_in.generator_model_id
        assert g_out.sampling == g_in.sampling
        assert len(g_out.completions) == len(g_in.completions)
        for c_in, c_out in zip(g_in.completions, g_out.completions, strict=True):
            np.testing.assert_array_equal(c_out.token_ids, c_in.token_ids)  # exact
            expected = np.maximum(c_in.logprobs.astype(np.float64), LOGPROB_FLOOR)
            expected = np.minimum(expected, 0.0)
            assert np.all(np.abs(c_out.logprobs - expected) < 1e-3)
            assert np.all(c_out.logprobs <= 0) and np.all(np.isfinite(c_out.logprobs))
            assert c_out.text == c_in.text
            assert c_out.finish_reason == c_in.finish_reason
    # Encoding is a function of the packet: decode -> encode reproduces the bytes
    # (log-probs are already on the fixed-point grid the second time).
    assert encode(out, compress=compress) == encode(decode(encode(out, compress=compress)), compress=compress)


# ----------------------------------------------------------------------------- fuzzing


@FAST
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    assert decodes_or_rejects(data) is None  # no valid packet lacks the magic
    decodes_or_rejects(MAGIC + bytes([FORMAT_VERSION]) + data)  # get past magic and version


@FAST
@given(st.integers(0, 255), st.integers(0, 64), st.integers(0, 600), st.binary(max_size=600))
def test_valid_prefix_then_garbage(flags: int, header_len: int, body_len: int, rest: bytes) -> None:
    data = struct.pack("<4sBBII", MAGIC, FORMAT_VERSION, flags, header_len, body_len) + rest
    decodes_or_rejects(data)
    try:
        peek_header(data)
    except ProtocolError:
        pass


MUTATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
        st.tuples(st.just("truncate"), st.integers(0, 10**6)),
        st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 8)),
        st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    ),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, mutations: list[tuple]) -> bytes:
    buf = bytearray(data)
    for m in mutations:
        if not buf:
            break
        pos = m[1] % len(buf)
        if m[0] == "flip":
            buf[pos] ^= 1 << m[2]
        elif m[0] == "truncate":
            del buf[pos:]
        elif m[0] == "insert":
            buf[pos:pos] = m[2]
        elif m[0] == "delete":
            del buf[pos : pos + m[2]]
        else:
            buf[pos] = m[2]
    return bytes(buf)


def reframe(header: bytes, body: bytes, flags: int) -> bytes:
    """Fix the prefix's lengths so a mutation reaches the parser behind the framing."""
    return struct.pack("<4sBBII", MAGIC, FORMAT_VERSION, flags, len(header), len(body)) + header + body


def parts(data: bytes) -> tuple[int, bytes, bytes]:
    _, _, flags, hlen, _ = struct.unpack_from("<4sBBII", data)
    return flags, data[PREFIX_SIZE : PREFIX_SIZE + hlen], data[PREFIX_SIZE + hlen :]


@FAST
@given(packets(), st.booleans(), MUTATIONS)
def test_mutated_encodings_only_raise_protocol_error(packet: RolloutPacket, compress: bool, mutations: list) -> None:
    data = encode(packet, compress=compress)
    decodes_or_rejects(mutate(data, mutations))
    flags, header, body = parts(data)
    # Mutations behind consistent framing: of the header, of the body as sent, and of
    # the body before compression (so they reach msgpack and the schema checks).
    decodes_or_rejects(reframe(mutate(header, mutations), body, flags))
    decodes_or_rejects(reframe(header, mutate(body, mutations), flags))
    if compress:
        raw = zstandard.ZstdDecompressor().decompress(body)
        decodes_or_rejects(reframe(header, zstandard.ZstdCompressor().compress(mutate(raw, mutations)), flags))


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    _containers,
    max_leaves=12,
)


@FAST
@given(packets(), st.data())
def test_type_confused_fields_only_raise_protocol_error(packet: RolloutPacket, data: st.DataObject) -> None:
    flags, header_bytes, body_bytes = parts(encode(packet))
    header, body = msgpack.unpackb(header_bytes), msgpack.unpackb(body_bytes)
    target = data.draw(st.sampled_from(["header", "body", "group"]))
    value = data.draw(MSGPACK_VALUES)
    if target == "header":
        header[data.draw(st.sampled_from(sorted(header)))] = value
    elif target == "body":
        body[data.draw(st.sampled_from(sorted(body)))] = value
    elif body["groups"]:
        group = body["groups"][data.draw(st.integers(0, len(body["groups"]) - 1))]
        index = data.draw(st.integers(0, 3))
        if index == 2:
            group[2][data.draw(st.integers(0, 3))] = value
        else:
            group[index] = value
    decodes_or_rejects(reframe(msgpack.packb(header), msgpack.packb(body), flags & ~FLAG_ZSTD))


@FAST
@given(packets(), st.integers(1, 64))
def test_small_limits_reject_cleanly(packet: RolloutPacket, n: int) -> None:
    limits = Limits(
        max_groups=n,
        max_completions_per_group=n,
        max_tokens_per_completion=n,
        max_total_tokens=n,
        max_text_chars=n,
    )
    out = decodes_or_rejects(encode(packet), limits)
    if out is not None:
        assert len(out.groups) <= n and out.num_tokens <= n
