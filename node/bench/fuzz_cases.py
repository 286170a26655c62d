"""The packets `ftis-node bench fuzz` feeds a node: valid seeds, their mutations, and known hostile cases.

Seeds are real packets for the toy task in this node's swarm and round, most with its
own tokenizer (they reach the token-level path of admission), some with another (the
re-tokenizing path) and some that declare what the node cannot train on (a temperature
of 1e-300, empty or over-long completions, ids past its vocabulary). Each case is one
seed put through one mutation: bit flips and byte edits, truncation, edited length
fields, edits behind consistent framing (so they reach msgpack and the schema checks),
type-confused fields, huge arrays and maps, zstd frames that lie or expand past the
limit. `hostile_cases` are the known worst inputs, built at full size. No torch here.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zstandard

from node.tasks.toy import toy_completion
from protocol import (
    FLAG_ZSTD,
    FORMAT_VERSION,
    MAGIC,
    Completion,
    Group,
    Limits,
    PacketHeader,
    RolloutPacket,
    SamplingParams,
    encode,
)
from protocol.frame import _PREFIX, PREFIX_SIZE

__all__ = ["FuzzContext", "hostile_cases", "make_case", "make_seed", "make_seeds", "zstd_frame"]


@dataclass(frozen=True)
class FuzzContext:
    """What the receiving node is: its swarm, round, tokenizer and model limits."""

    swarm_id: str
    round: int
    peer_id: str  # the signed sender id every seed is delivered under
    fingerprint: str
    vocab_size: int  # the model's vocabulary (embedding rows)
    max_positions: int
    tokenize: Callable[[str], list[int]]
    task: Any  # node.tasks.Task
    limits: Limits


# --------------------------------------------------------------------------- seeds


def _logprobs(rng: random.Random, n: int) -> np.ndarray:
    return np.array([-rng.expovariate(1.0) for _ in range(n)], dtype=np.float32)


def _header(ctx: FuzzContext, rng: random.Random, **change: Any) -> PacketHeader:
    fields: dict[str, Any] = dict(
        swarm_id=ctx.swarm_id,
        round=ctx.round - rng.choice((0, 0, 0, 1)),
        sender_peer_id=ctx.peer_id,
        sender_name=rng.choice(("", "node", "alice's laptop")),
        base_model_id="tiny-s",
        adapter_version=rng.choice(("base", "3f9a1c0e2b7d4a58")),
        tokenizer_fingerprint=ctx.fingerprint,
        vocab_size=ctx.vocab_size,
        created_at=1_750_000_000.0 + rng.random(),
    )
    fields.update(change)
    return PacketHeader.create(**fields)


def _answer_ids(ctx: FuzzContext, rng: random.Random, task_id: str) -> tuple[list[int], str]:
    answer = ctx.task.problem(task_id).answer
    text = toy_completion(answer if rng.random() < 0.5 else str(int(answer) + rng.randint(1, 9)))
    return ctx.tokenize(text), text


def make_seed(ctx: FuzzContext, rng: random.Random) -> tuple[str, RolloutPacket]:
    """A valid packet and its kind: `own_tokenizer`, `foreign_tokenizer` or `past_node_limits`."""
    kind = rng.choices(("own_tokenizer", "foreign_tokenizer", "past_node_limits"), (75, 10, 15))[0]
    foreign = kind == "foreign_tokenizer"
    header = (
        _header(ctx, rng, tokenizer_fingerprint="sha256:another-tokenizer", vocab_size=151_646)
        if foreign
        else _header(ctx, rng)
    )
    sampling = SamplingParams(
        temperature=rng.choice((1.0, 1.0, 0.7)), top_p=rng.choice((1.0, 0.9)), top_k=rng.choice((0, 50)), max_tokens=64
    )
    groups = []
    for _ in range(rng.randint(1, 3)):
        task_id = ctx.task.sample(rng)
        completions = []
        for _ in range(rng.choice((1, 2, 2, 4))):
            ids, text = _answer_ids(ctx, rng, task_id)
            if foreign:  # ids of another vocabulary; the receiver re-tokenizes the text
                ids = [rng.randrange(header.vocab_size) for _ in ids]
            completions.append(Completion.of(ids, _logprobs(rng, len(ids)), text=text if foreign else None))
        groups.append(Group.of(task_id, header.base_model_id, sampling, completions))
    if kind == "past_node_limits":
        groups[0], header = _past_node_limits(ctx, rng, groups[0], header)
    return kind, RolloutPacket(header=header, groups=groups)


def _past_node_limits(
    ctx: FuzzContext, rng: random.Random, group: Group, header: PacketHeader
) -> tuple[Group, PacketHeader]:
    """One of the valid packets no node can train on (issue 10, item 0)."""
    what = rng.choice(("temperature", "empty", "too_long", "id_past_vocab"))
    comps = list(group.completions)
    sampling = group.sampling
    if what == "temperature":
        sampling = sampling.model_copy(update={"temperature": rng.choice((1e-300, 1e-40))})
    elif what == "empty":
        comps = [Completion.of([], []) for _ in range(max(2, len(comps)))]
    elif what == "too_long":
        n = ctx.max_positions + 88
        sampling = sampling.model_copy(update={"max_tokens": n})
        comps[0] = Completion.of([rng.randrange(ctx.vocab_size) for _ in range(n)], _logprobs(rng, n))
    else:
        header = header.model_copy(update={"vocab_size": 100_000})
        ids = comps[0].token_ids.copy()
        ids[rng.randrange(ids.size)] = rng.randrange(ctx.vocab_size, 100_000)
        comps[0] = Completion.of(ids, comps[0].logprobs)
    return Group.of(group.task_id, group.generator_model_id, sampling, comps), header


# --------------------------------------------------------------------------- framing helpers


def frame(
    header: Any, body: Any, *, compress: bool, raw_header: bytes | None = None, zstd_body: bytes | None = None
) -> bytes:
    """A packet around any header and body objects (or raw bytes), with correct lengths.
    `zstd_body` is sent as the compressed body as it is."""
    h = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
    b = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    if compress:
        b = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(b)
    if zstd_body is not None:
        b, compress = zstd_body, True
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_ZSTD if compress else 0, len(h), len(b)) + h + b


def split(data: bytes) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """A seed's header, body (decompressed) and whether it was compressed."""
    _, _, flags, hlen, _ = _PREFIX.unpack_from(data)
    body = data[PREFIX_SIZE + hlen :]
    if flags & FLAG_ZSTD:
        body = zstandard.ZstdDecompressor().decompress(body)
    return msgpack.unpackb(data[PREFIX_SIZE : PREFIX_SIZE + hlen]), msgpack.unpackb(body), bool(flags & FLAG_ZSTD)


def zstd_frame(content: bytes, *, declared: int | None = None, window_log: int | None = None) -> bytes:
    """A hand-made one-block zstd frame: `declared` may lie about the size, `window_log`
    asks for a window that big (no single-segment flag)."""
    size = len(content) if declared is None else declared
    if window_log is None:
        fhd = 0xA0  # 4-byte content size, single segment
        descriptor = b""
    else:
        fhd = 0x80  # 4-byte content size, window descriptor follows
        descriptor = bytes([(window_log - 10) << 3])
    block = struct.pack("<I", 1 | (len(content) << 3))[:3]  # last block, raw
    return struct.pack("<I", 0xFD2FB528) + bytes([fhd]) + descriptor + struct.pack("<I", size) + block + content


def _patch_content_size(frame_bytes: bytes, size: int) -> bytes:
    """Rewrite the content size a zstd frame declares (keeping its field width)."""
    fhd = frame_bytes[4]
    single, dict_flag, fcs_flag = (fhd >> 5) & 1, fhd & 3, fhd >> 6
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if width == 0:
        return frame_bytes
    value = size - 256 if width == 2 else size
    value %= 1 << (8 * width)
    return frame_bytes[:at] + value.to_bytes(width, "little") + frame_bytes[at + width :]


# --------------------------------------------------------------------------- mutations


def _odd_value(rng: random.Random, depth: int = 0) -> Any:
    """A msgpack value of a random, usually wrong, type."""
    choices: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.choice((True, False)),
        lambda: rng.choice((0, 1, -1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1)),
        lambda: rng.choice((0.0, -0.0, 1e-300, -1.0, 0.5, 1e300, math.nan, math.inf, -math.inf)),
        lambda: rng.choice(("", "x", "ünïcode ✓", "toy/id/1", "a" * rng.randint(200, 400), "\x00")),
        lambda: bytes(rng.randrange(256) for _ in range(rng.randint(0, 24))),
        lambda: msgpack.ExtType(rng.randint(0, 127), b"\x01\x02"),
        lambda: msgpack.Timestamp(1, 2),
    ]
    if depth < 3:
        choices += [
            lambda: [_odd_value(rng, depth + 1) for _ in range(rng.randint(0, 5))],
            lambda: {str(i): _odd_value(rng, depth + 1) for i in range(rng.randint(0, 4))},
            lambda: [[]] * rng.choice((10, 1000, 100_000)),
        ]
    return rng.choice(choices)()


def _flip(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 8))):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _edit_bytes(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    at = rng.randrange(len(buf))
    op = rng.choice(("set", "insert", "delete", "append"))
    if op == "set":
        buf[at] = rng.randrange(256)
    elif op == "insert":
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif op == "delete":
        del buf[at : at + rng.randint(1, 8)]
    else:
        buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(buf)


def _truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))]


def _edit_lengths(rng: random.Random, data: bytes) -> bytes:
    magic, version, flags, hlen, blen = _PREFIX.unpack_from(data)
    values = (0, 1, 2**32 - 1, rng.randrange(2**32), len(data))
    if rng.random() < 0.5:
        hlen = rng.choice((*values, max(0, hlen + rng.randint(-3, 3))))
    else:
        blen = rng.choice((*values, max(0, blen + rng.randint(-3, 3))))
    version = version if rng.random() < 0.9 else rng.randrange(256)
    flags = flags if rng.random() < 0.9 else rng.randrange(256)
    return _PREFIX.pack(magic, version, flags, hlen % 2**32, blen % 2**32) + data[PREFIX_SIZE:]


def _edit_header(rng: random.Random, data: bytes) -> bytes:
    header, body, compress = split(data)
    key = rng.choice((*sorted(header), "extra_field"))
    edits: dict[str, list[Any]] = {
        "round": [header["round"] + d for d in (-3, -2, 1, 2, 10**6)] + [0, 2**63 - 1, 2**63],
        "swarm_id": ["another", "UPPER", "", "a" * 65, "-x"],
        "sender_peer_id": ["QmSomeoneElse", "", "p" * 257],
        "tokenizer_fingerprint": ["sha256:another-tokenizer", ""],
        "vocab_size": [1, 2, 256, 65_536, 65_537, 100_000, 2**32, 2**32 + 1, 0],
        "protocol_version": [0, 1, 2, 4, 255, True, 3.0],
        "sender_name": ["", "a" * 64, "a" * 65, "two\nlines", "tab\there", "\u202eevil", "名前", 7],
        "created_at": [-1.0, math.inf, math.nan, 0, 2**64 - 1, 1e300],
    }
    options = edits.get(key)
    if options and rng.random() < 0.7:
        header[key] = rng.choice(options)
    elif rng.random() < 0.2:
        header.pop(key, None)
    else:
        header[key] = _odd_value(rng)
    return frame(header, body, compress=compress)


def _edit_body(rng: random.Random, data: bytes) -> bytes:
    header, body, compress = split(data)
    key = rng.choice(sorted(body))
    value = body[key]
    if isinstance(value, bytes) and key != "ids_hi" and value and rng.random() < 0.8:
        width = {"lengths": 4, "finish": 1}.get(key, 2)
        arr = bytearray(value)
        at = rng.randrange(0, len(arr) - width + 1, width) if len(arr) >= width else 0
        new = rng.choice((0, 1, 2 ** (8 * width) - 1, rng.randrange(2 ** (8 * width))))
        arr[at : at + width] = new.to_bytes(width, "little")[: len(arr) - at]
        body[key] = bytes(arr)
    elif key == "groups" and value and rng.random() < 0.8:
        group = value[rng.randrange(len(value))]
        slot = rng.randrange(4)
        if slot == 2 and isinstance(group[2], list) and group[2]:
            group[2][rng.randrange(len(group[2]))] = rng.choice(
                (0, -1, 1e-300, 1e-40, math.nan, math.inf, 101.0, 2**32, "1", True, _odd_value(rng))
            )
        elif slot == 3:
            group[3] = rng.choice((0, -1, group[3] + 1, group[3] - 1, 129, 2**32, True))
        else:
            group[slot] = rng.choice(
                ("toy/id/abc", "toy/ood/1", "gym:x/1", "toy/id/99999999999999999999", "", "t" * 257, _odd_value(rng))
            )
    elif rng.random() < 0.3:
        del body[key]
    else:
        body[key] = _odd_value(rng)
    if rng.random() < 0.05:
        body[rng.choice(("extra", "groups"))] = _odd_value(rng)
    return frame(header, body, compress=compress)


def _reframe_compression(rng: random.Random, data: bytes) -> bytes:
    header, body, _ = split(data)
    raw = msgpack.packb(body, use_bin_type=True)
    h = msgpack.packb(header, use_bin_type=True)
    kind = rng.choice(("declares_more", "declares_less", "unsized", "two_frames", "cut", "window", "bomb", "skippable"))
    if kind in ("declares_more", "declares_less"):
        z = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
        z = _patch_content_size(z, len(raw) + (rng.randint(1, 9) if kind == "declares_more" else -rng.randint(1, 9)))
    elif kind == "unsized":
        z = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    elif kind == "two_frames":
        z = zstandard.ZstdCompressor().compress(raw) * 2
    elif kind == "cut":
        z = zstandard.ZstdCompressor().compress(raw)
        z = z[: rng.randrange(len(z))]
    elif kind == "window":
        z = zstd_frame(raw, window_log=rng.choice((23, 27, 31)))
    elif kind == "bomb":
        z = zstandard.ZstdCompressor().compress(raw + b"\x00" * rng.choice((2**22, 2**23)))
    else:
        z = struct.pack("<II", 0x184D2A50, 4) + b"skip" + zstandard.ZstdCompressor().compress(raw)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_ZSTD, len(h), len(z)) + h + z


def _random_bytes(rng: random.Random, data: bytes) -> bytes:
    n = rng.randint(0, 512)
    junk = bytes(rng.randrange(256) for _ in range(n))
    return junk if rng.random() < 0.3 else data[: rng.randint(4, PREFIX_SIZE)] + junk


_MUTATIONS: dict[str, tuple[Callable[[random.Random, bytes], bytes], int]] = {
    "bit_flip": (_flip, 20),
    "byte_edit": (_edit_bytes, 10),
    "truncate": (_truncate, 8),
    "length_field": (_edit_lengths, 10),
    "header_field": (_edit_header, 14),
    "body_field": (_edit_body, 22),
    "zstd_frame": (_reframe_compression, 6),
    "random_bytes": (_random_bytes, 4),
    "none": (lambda rng, data: data, 6),
}


def make_seeds(ctx: FuzzContext, rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """`n` encoded seeds (half of them compressed) with their kinds."""
    seeds = []
    for _ in range(n):
        kind, packet = make_seed(ctx, rng)
        seeds.append((kind, encode(packet, compress=rng.random() < 0.5)))
    return seeds


_NAMES = list(_MUTATIONS)
_WEIGHTS = [w for _, w in _MUTATIONS.values()]


def make_case(seeds: list[tuple[str, bytes]], rng: random.Random) -> tuple[str, str, bytes]:
    """(seed kind, mutation, packet bytes) of one fuzz case: a random seed, mutated once."""
    kind, data = rng.choice(seeds)
    name = rng.choices(_NAMES, _WEIGHTS)[0]
    return kind, name, _MUTATIONS[name][0](rng, data)


# --------------------------------------------------------------------------- the known worst cases


def hostile_cases(ctx: FuzzContext) -> dict[str, bytes]:
    """The known worst inputs at full size: each is rejected (or, the last, accepted) by the decoder."""
    rng = random.Random(0)
    header = _header(ctx, rng).model_dump()
    empty = {"lengths": b"", "finish": b"", "texts": None, "ids_lo": b"", "ids_hi": b"", "logprobs": b""}
    group = ["toy/id/1", "tiny-s", [1.0, 1.0, 0, 64], 1]
    budget = ctx.limits.max_bytes - 1024  # what fits in one packet once decompressed
    cases = {
        # The case: 367 bytes on the wire, 4 million empty arrays once unpacked.
        "groups_4M_empty_arrays_zstd": frame(header, {"groups": [[]] * 4_000_000, **empty}, compress=True),
        "body_map_300k_keys_zstd": frame(header, {str(i): 0 for i in range(300_000)}, compress=True),
        "texts_4M_nils_zstd": frame(header, {"groups": [group], **empty, "texts": [None] * 4_000_000}, compress=True),
        "task_id_1M_nested_zstd": frame(header, {"groups": [[[[]] * 1_000_000, *group[1:]]], **empty}, compress=True),
        "sampling_1M_items_zstd": frame(header, {"groups": [[*group[:2], [0] * 1_000_000, 1]], **empty}, compress=True),
        "group_count_2e9_zstd": frame(header, {"groups": [[*group[:3], 2**31]], **empty}, compress=True),
        "body_4MiB_nested_arrays_raw": frame(
            header, b"\xdd" + struct.pack(">I", budget) + b"\x90" * (budget - 5), compress=False
        ),
        "header_8KiB_nested_arrays": frame(None, empty, compress=False, raw_header=b"\xdc\x1f\xf0" + b"\x90" * 8_176),
        "header_4MiB": frame(None, empty, compress=False, raw_header=b"\x90" * budget),
        "zstd_declares_8MiB": frame(header, b"", compress=False, zstd_body=zstd_frame(b"\x80", declared=8 * 2**20)),
        "zstd_window_2GiB": frame(header, b"", compress=False, zstd_body=zstd_frame(b"\x80", window_log=31)),
        "zstd_unsized_16MiB": frame(
            header,
            b"",
            compress=False,
            zstd_body=zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * 2**24),
        ),
        "zstd_expands_past_limit": frame(
            header, b"", compress=False, zstd_body=zstandard.ZstdCompressor().compress(b"\x90" * (8 * 2**20))
        ),
    }
    # Every check passes but the last token id: the most work a rejection can cost.
    tokens = min(ctx.limits.max_total_tokens, budget // 4 - 64)
    per = min(ctx.limits.max_tokens_per_completion, -(-tokens // ctx.limits.max_completions_per_group))
    n = -(-tokens // per)
    lengths = np.full(n, per, "<u4")
    lengths[-1] = tokens - per * (n - 1)
    ids = np.zeros(tokens, "<u2")
    ids[-1] = ctx.vocab_size  # one past the vocabulary
    heavy = {
        "groups": [["toy/id/1", "tiny-s", [1.0, 1.0, 0, per], n]],
        "lengths": lengths.tobytes(),
        "finish": bytes(n),
        "texts": None,
        "ids_lo": ids.tobytes(),
        "ids_hi": b"",
        "logprobs": np.zeros(tokens, "<u2").tobytes(),
    }
    cases["max_tokens_last_id_bad"] = frame(header, heavy, compress=False)
    ids[-1] = 0
    cases["max_tokens_valid"] = frame(header, {**heavy, "ids_lo": ids.tobytes()}, compress=False)
    return cases
