"""Binary wire format of a `RolloutPacket`: `encode`, `decode`, `peek_header`.

Layout (integers little-endian):

    offset  size  field
    0       4     magic  b"FTIS"
    4       1     format version (FORMAT_VERSION)
    5       1     flags  (bit 0: the body is one zstd frame)
    6       4     header length H (uint32)
    10      4     body length B (uint32), as sent (compressed or not)
    14      H     header: msgpack map of PacketHeader's fields
    14+H    B     body: msgpack map, zstd-compressed if flag bit 0

The two lengths make truncation and trailing bytes detectable before any parsing.

The header comes first and is never compressed, so `peek_header` (staleness checks)
reads a few hundred bytes and skips the body. The body holds every token of the
packet in flat arrays, so encode and decode are a handful of vectorized numpy calls
however many completions there are:

    groups    [[task_id, generator_model_id, [temperature, top_p, top_k, max_tokens], n], ...]
    lengths   uint32[C]  tokens per completion, C = sum of n, completions in group order
    finish    uint8[C]   0 = "stop", 1 = "length"
    texts     nil, or a list of C (str | nil)
    ids_lo    uint16[T]  low 16 bits of every token id, T = sum(lengths)
    ids_hi    P bit-planes of ceil(T/8) bytes (np.packbits); plane k holds bit 16+k
              of every id. P = bit_length(vocab_size - 1) - 16, floored at 0: none for
              vocab <= 65536, 2 for Qwen2.5 (151,646).
    logprobs  uint16[T]  fixed point q = round(-logprob * 65535 / 64)

Log-probs are fixed point over [-64, 0] in steps of 64/65535, so every decoded value
is within 4.9e-4 of the original. Values below -64 are CLAMPED to -64: a token
sampled with probability below 1.6e-28 gives no usable importance ratio anyway.
(fp16 would not do: its step is already 1/64 between -16 and -32.)

Cost per token: 2 + P/8 + 2 bytes, plus 5 bytes per completion and the strings, so
about 4.3 B/token for vocab 151,646 and 4.05 for 49,152, against 8 for int32 + fp32.

Bounds the decoder enforces, every one before a completion is built (the numbers are
`Limits` and their defaults; the reason code of each rejection in brackets):

    packet      at most max_bytes (4 MiB) as received                       [too_large]
                magic, FORMAT_VERSION, no unknown flag, and the two lengths adding
                up to the packet's size    [bad_magic, bad_version, bad_flags, truncated,
                                            length_mismatch]
    header      at most MAX_HEADER_BYTES (8 KiB; a valid header is under 6 KiB), so
                unpacking it is cheap whatever it holds; a map without repeated keys;
                protocol_version == PROTOCOL_VERSION, then PacketHeader's schema,
                strictly (no coercion)      [too_large, bad_msgpack, bad_version, bad_schema]
    zstd body   one frame that declares its size, at most max_bytes, with a window of
                at most max_bytes rounded up to a power of two, decompressed in one
                shot into exactly the declared size   [decompression_bomb, bad_compression]
    body        read item by item (protocol/body.py, protocol/reader.py): a container's
                declared length is checked against what the schema allows BEFORE the
                container is entered, and only scalars are ever built. A map of the
                seven fields, each once                              [bad_msgpack, bad_schema]
      groups    at most max_groups (256), each exactly
                [str, str, [4 scalars], int], names of 1-256 characters, sampling as
                SamplingParams allows, 1 to max_completions_per_group (128) completions
                                           [too_many_groups, bad_schema, too_many_completions]
      texts     nil, or one entry per completion (at most max_groups * max_completions_
                per_group entries), each nil or at most max_text_chars (200,000)
                characters                                  [length_mismatch, text_too_long]
      the rest  one binary each, sizes agreeing with the groups and each other
                                                                          [length_mismatch]
    tokens      per completion at most max_tokens_per_completion (32,768) and its
                group's max_tokens, in all at most max_total_tokens (1,000,000)
                                  [completion_too_long, length_mismatch, too_many_tokens]
                finish codes known, token ids below the header's vocab_size
                                                                 [bad_schema, bad_token_id]
                log-probs: fixed point, so always finite and in [-64, 0]

So what a rejection costs is bounded by max_bytes, never by what the bytes announce.
Measured on the known worst packets (node/bench/fuzz_cases.py; `ftis-node bench fuzz`
and docs/benchmarks.md have the figures): the costliest rejection takes about 4 ms of
CPU (decompressing a 2.3 MB body) and at most 8.7 MiB of Python heap (a 4 MB body and
the reader's copy of it). 367 bytes announcing 4,000,000 empty groups, which cost 1.75 s
of CPU and 249 MiB before these bounds, are rejected in under 1 ms. A valid packet costs about 8 bytes of
heap per token to decode (1,000,000 tokens: 7.7 MiB, 1.7 ms of CPU).

What the decoder does not check, because it depends on the receiver, is admission's
job (node/defence/admission.py): token ids against the receiver's own vocabulary, completion
lengths against its positions (an empty completion is valid on the wire), whether the
declared sampling parameters are sane for training (a temperature of 1e-300 is > 0),
the task ids, and the swarm, round and sender of the header.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from protocol.body import fail, read_body, validated
from protocol.errors import ErrorCode, ProtocolError
from protocol.frame import _PREFIX, FLAG_ZSTD, FORMAT_VERSION, MAGIC, MAX_HEADER_BYTES, PREFIX_SIZE, Limits
from protocol.packet import (
    PROTOCOL_VERSION,
    Completion,
    Group,
    PacketHeader,
    RolloutPacket,
    logprob_problem,
)

__all__ = [
    "FLAG_ZSTD",
    "FORMAT_VERSION",
    "LOGPROB_FLOOR",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "PREFIX_SIZE",
    "Limits",
    "decode",
    "encode",
    "high_bit_planes",
    "peek_header",
]

_KNOWN_FLAGS = FLAG_ZSTD
ZSTD_LEVEL = 3  # zstd's default: most of the gain at a fraction of the time of higher levels

LOGPROB_FLOOR = -64.0
_LP_LEVELS = 65535
_LP_ENCODE_SCALE = _LP_LEVELS / LOGPROB_FLOOR  # negative: maps [-64, 0] onto [65535, 0]
_LP_DECODE_STEP = np.float32(LOGPROB_FLOOR / _LP_LEVELS)

_FINISH_REASONS: tuple[str, ...] = ("stop", "length")
_FINISH_CODE = {reason: i for i, reason in enumerate(_FINISH_REASONS)}


_DEFAULT_LIMITS = Limits()


def high_bit_planes(vocab_size: int) -> int:
    """How many bit-planes above the low 16 bits the ids of this vocabulary need."""
    return max(0, (vocab_size - 1).bit_length() - 16)


# --------------------------------------------------------------------------- encode


def encode(packet: RolloutPacket, *, compress: bool = False) -> bytes:
    """Serialize `packet`. With `compress`, the body is one zstd frame (the header never is)."""
    if not isinstance(packet, RolloutPacket):
        raise TypeError(f"encode expects a RolloutPacket, got {type(packet).__name__}")
    header = packet.header
    comps = [c for g in packet.groups for c in g.completions]
    lengths = np.fromiter((c.token_ids.size for c in comps), dtype="<u4", count=len(comps))
    if comps:
        ids = np.concatenate([c.token_ids for c in comps])
        lps = np.concatenate([c.logprobs for c in comps])
    else:
        ids, lps = np.zeros(0, np.uint32), np.zeros(0, np.float32)
    # The models validated these at construction, but arrays can be mutated in place
    # afterwards; an id past the vocabulary would lose its high bits silently.
    if ids.size and int(ids.max()) >= header.vocab_size:
        raise ProtocolError(f"token id {int(ids.max())} >= vocab_size {header.vocab_size}", code=ErrorCode.BAD_TOKEN_ID)
    problem = logprob_problem(lps)
    if problem:
        raise ProtocolError(problem, code=ErrorCode.BAD_LOGPROB)

    texts = [c.text for c in comps]
    body = {
        "groups": [
            [
                g.task_id,
                g.generator_model_id,
                [g.sampling.temperature, g.sampling.top_p, g.sampling.top_k, g.sampling.max_tokens],
                len(g.completions),
            ]
            for g in packet.groups
        ],
        "lengths": lengths.tobytes(),
        "finish": bytes(_FINISH_CODE[c.finish_reason] for c in comps),
        "texts": texts if any(t is not None for t in texts) else None,
        "ids_lo": ids.astype("<u2").tobytes(),  # uint32 -> uint16 keeps exactly the low 16 bits
        "ids_hi": _pack_high_bits(ids, high_bit_planes(header.vocab_size)),
        "logprobs": _quantize_logprobs(lps).tobytes(),
    }
    body_bytes = msgpack.packb(body, use_bin_type=True)
    flags = 0
    if compress:
        import zstandard  # optional dependency, only needed when compressing

        body_bytes = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(body_bytes)
        flags |= FLAG_ZSTD
    header_bytes = msgpack.packb(header.model_dump(), use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(header_bytes), len(body_bytes))
    return b"".join((prefix, header_bytes, body_bytes))


def _pack_high_bits(ids: np.ndarray, planes: int) -> bytes:
    if planes == 0:
        return b""
    shifts = np.arange(16, 16 + planes, dtype=np.uint32)[:, None]
    bits = ((ids[None, :] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits, axis=1).tobytes()


def _quantize_logprobs(lps: np.ndarray) -> np.ndarray:
    clipped = np.clip(lps, LOGPROB_FLOOR, 0.0)
    q: np.ndarray = np.rint(clipped * _LP_ENCODE_SCALE).astype("<u2")
    return q


# --------------------------------------------------------------------------- decode


def _read_prefix(data: Any, limits: Limits, *, whole: bool = True) -> tuple[memoryview, int, int]:
    """Check magic/version/flags/sizes; return (view, flags, end of header).

    With `whole=False` only the prefix and header need to be present (peek_header).
    """
    if isinstance(data, memoryview):
        data = data.tobytes()  # any format or stride becomes plain bytes
    if not isinstance(data, (bytes, bytearray)):
        fail(ErrorCode.NOT_BYTES, f"packet must be bytes, got {type(data).__name__}")
    view = memoryview(data)
    if len(view) > limits.max_bytes:
        fail(ErrorCode.TOO_LARGE, f"packet is {len(view)} bytes, over the limit of {limits.max_bytes}")
    if not MAGIC.startswith(bytes(view[: len(MAGIC)])):
        fail(ErrorCode.BAD_MAGIC, f"packet does not start with {MAGIC!r}")
    if len(view) < PREFIX_SIZE:
        fail(ErrorCode.TRUNCATED, f"packet is {len(view)} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, flags, header_len, body_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        fail(ErrorCode.BAD_MAGIC, f"packet does not start with {MAGIC!r}")
    if version != FORMAT_VERSION:
        fail(
            ErrorCode.BAD_VERSION,
            f"format version {version} is not supported (this node reads {FORMAT_VERSION})",
        )
    if flags & ~_KNOWN_FLAGS:
        fail(ErrorCode.BAD_FLAGS, f"unknown flag bits {flags & ~_KNOWN_FLAGS:#04x}")
    if header_len > MAX_HEADER_BYTES:
        fail(ErrorCode.TOO_LARGE, f"header is {header_len} bytes, over the limit of {MAX_HEADER_BYTES}")
    header_end = PREFIX_SIZE + header_len
    if not whole:
        if header_end > len(view):
            fail(
                ErrorCode.TRUNCATED,
                f"header says {header_len} bytes but only {len(view) - PREFIX_SIZE} follow",
            )
        return view, flags, header_end
    expected = header_end + body_len
    if expected > len(view):
        fail(
            ErrorCode.TRUNCATED,
            f"prefix announces {header_len} header + {body_len} body bytes but only {len(view) - PREFIX_SIZE} follow",
        )
    if expected < len(view):
        fail(ErrorCode.LENGTH_MISMATCH, f"{len(view) - expected} unexpected bytes after the body")
    return view, flags, header_end


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # A repeated key would silently keep its last value: two readers could disagree.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        for key, _ in pairs:
            if key in seen:
                fail(ErrorCode.BAD_SCHEMA, f"header field {key!r} appears twice")
            seen.add(key)
    return out


def _read_header(view: memoryview, header_end: int) -> PacketHeader:
    try:
        # At most MAX_HEADER_BYTES, so even a header of nested containers builds few objects.
        raw = msgpack.unpackb(
            view[PREFIX_SIZE:header_end], raw=False, strict_map_key=True, max_ext_len=0, object_pairs_hook=_unique_map
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, FormatError, ValueError, ...)
        fail(ErrorCode.BAD_MSGPACK, f"header is not valid msgpack: {type(e).__name__}: {e}")
    if not isinstance(raw, dict):
        fail(ErrorCode.BAD_SCHEMA, f"header must be a map, got {type(raw).__name__}")
    # Checked before the schema: another version may well have other fields.
    version = raw.get("protocol_version")
    if version != PROTOCOL_VERSION:
        fail(
            ErrorCode.BAD_VERSION,
            f"protocol version {version!r} is not supported (this node speaks {PROTOCOL_VERSION})",
        )
    return validated(PacketHeader, raw, "header")


def peek_header(data: bytes, limits: Limits = _DEFAULT_LIMITS) -> PacketHeader:
    """Decode only the header: the body is neither decompressed nor parsed, and need
    not even be present (the first `PREFIX_SIZE + header length` bytes suffice)."""
    view, _, header_end = _read_prefix(data, limits, whole=False)
    return _read_header(view, header_end)


def _zstd_window_bound(max_bytes: int) -> int:
    # zstd shrinks the window to the content size when it is known, so no frame of at
    # most max_bytes needs a window above the next power of two (zstd's minimum is 1 KiB).
    return 1 << max(10, (max_bytes - 1).bit_length())


def _decompress(frame: bytes | memoryview, max_bytes: int) -> bytes:
    try:
        import zstandard
    except ImportError:
        fail(ErrorCode.BAD_COMPRESSION, "packet is zstd-compressed but the zstandard package is not installed")
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        fail(ErrorCode.BAD_COMPRESSION, f"body is not a zstd frame: {e}")
    declared = params.content_size
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        fail(ErrorCode.BAD_COMPRESSION, "zstd frame does not declare its decompressed size")
    if declared > max_bytes:
        fail(
            ErrorCode.DECOMPRESSION_BOMB,
            f"zstd frame would decompress to {declared} bytes, over the limit of {max_bytes}",
        )
    window = _zstd_window_bound(max_bytes)
    if params.window_size > window:
        fail(ErrorCode.BAD_COMPRESSION, f"zstd frame asks for a {params.window_size}-byte window, over {window}")
    try:
        # One-shot into a buffer of exactly `declared` bytes: a frame that lies about its
        # size fails here instead of growing the output.
        out = zstandard.ZstdDecompressor(max_window_size=window).decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as e:
        fail(ErrorCode.BAD_COMPRESSION, f"corrupt zstd frame: {e}")
    if len(out) != declared:
        fail(ErrorCode.BAD_COMPRESSION, f"zstd frame declared {declared} bytes but gave {len(out)}")
    return out


def _blob(value: memoryview, key: str, dtype: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(value) % itemsize:
        fail(
            ErrorCode.LENGTH_MISMATCH,
            f"body field {key!r} is {len(value)} bytes, not a multiple of {itemsize}",
        )
    return np.frombuffer(value, dtype=dtype)


def _expect_size(arr: np.ndarray, n: int, what: str) -> None:
    if arr.size != n:
        fail(ErrorCode.LENGTH_MISMATCH, f"{what} has {arr.size} entries, expected {n}")


def decode(data: bytes, limits: Limits = _DEFAULT_LIMITS) -> RolloutPacket:
    """Parse and fully validate a packet. Any problem raises `ProtocolError`, nothing else.

    Every check comes before the completions are built, and each one is bounded by the
    limits (see the module docstring), so a rejection costs little whatever the bytes claim.
    """
    view, flags, header_end = _read_prefix(data, limits)
    header = _read_header(view, header_end)
    body_buf: bytes | memoryview = view[header_end:]
    if flags & FLAG_ZSTD:
        body_buf = _decompress(body_buf, limits.max_bytes)
    body = read_body(body_buf, limits)  # its binary fields are views of body_buf; the arrays below copy them
    groups = body.groups
    counts = [g.n for g in groups]
    n_comp = sum(counts)

    lengths = _blob(body.lengths, "lengths", "<u4")
    _expect_size(lengths, n_comp, "'lengths'")
    if n_comp and int(lengths.max()) > limits.max_tokens_per_completion:
        i = int(np.argmax(lengths))
        fail(
            ErrorCode.COMPLETION_TOO_LONG,
            f"completion {i} has {int(lengths[i])} tokens, over the limit of {limits.max_tokens_per_completion}",
        )
    n_tok = int(lengths.sum(dtype=np.int64))
    if n_tok > limits.max_total_tokens:
        fail(ErrorCode.TOO_MANY_TOKENS, f"{n_tok} tokens, over the limit of {limits.max_total_tokens}")
    if n_comp:
        allowed = np.repeat(np.array([g.sampling.max_tokens for g in groups], dtype=np.int64), counts)
        over = np.flatnonzero(lengths > allowed)
        if over.size:
            i = int(over[0])
            fail(
                ErrorCode.LENGTH_MISMATCH,
                f"completion {i} has {int(lengths[i])} tokens, more than its group's max_tokens={int(allowed[i])}",
            )

    finish = _blob(body.finish, "finish", "u1")
    _expect_size(finish, n_comp, "'finish'")
    if n_comp and int(finish.max()) >= len(_FINISH_REASONS):
        fail(ErrorCode.BAD_SCHEMA, f"finish reason code {int(finish.max())} is unknown")
    texts = body.texts
    if texts is None:
        texts = [None] * n_comp
    elif len(texts) != n_comp:
        fail(ErrorCode.LENGTH_MISMATCH, f"'texts' has {len(texts)} entries, expected {n_comp}")

    ids_lo = _blob(body.ids_lo, "ids_lo", "<u2")
    _expect_size(ids_lo, n_tok, "'ids_lo'")
    q = _blob(body.logprobs, "logprobs", "<u2")
    _expect_size(q, n_tok, "'logprobs'")
    planes = high_bit_planes(header.vocab_size)
    plane_bytes = (n_tok + 7) // 8
    ids_hi = _blob(body.ids_hi, "ids_hi", "u1")
    _expect_size(ids_hi, planes * plane_bytes, "'ids_hi'")

    ids = ids_lo.astype(np.uint32)
    for k in range(planes):  # one plane at a time: a temporary of n_tok bytes, not planes * n_tok
        bits = np.unpackbits(ids_hi[k * plane_bytes : (k + 1) * plane_bytes], count=n_tok)
        ids |= bits.astype(np.uint32) << np.uint32(16 + k)
    ends = np.cumsum(lengths, dtype=np.int64)
    if n_tok and int(ids.max()) >= header.vocab_size:
        pos = int(np.argmax(ids))
        ci = int(np.searchsorted(ends, pos, side="right"))
        fail(
            ErrorCode.BAD_TOKEN_ID,
            f"completion {ci}: token id {int(ids[pos])} is outside the vocabulary (vocab_size={header.vocab_size})",
        )
    # Fixed point cannot express a positive or non-finite value, so no check is needed.
    lps = q.astype(np.float32)
    lps *= _LP_DECODE_STEP

    # Everything is checked above, vectorized or per group; building the models without
    # validating them again is what keeps decode fast.
    end_list: list[int] = ends.tolist()
    start_list = [0, *end_list[:-1]] if end_list else []
    finish_list: list[int] = finish.tolist()
    completions = [
        Completion.trusted(ids[s:e], lps[s:e], texts[i], _FINISH_REASONS[finish_list[i]])
        for i, (s, e) in enumerate(zip(start_list, end_list, strict=True))
    ]
    out: list[Group] = []
    first = 0
    for task_id, generator, sampling, n in groups:
        out.append(
            Group.model_construct(
                task_id=task_id,
                generator_model_id=generator,
                sampling=sampling,
                completions=completions[first : first + n],
            )
        )
        first += n
    return RolloutPacket.model_construct(header=header, groups=out)
