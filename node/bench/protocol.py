"""Wire-format benchmark: bytes per token and encode/decode speed on realistic packets.

A realistic packet is one node's round: 8 groups x 12 completions x 200 tokens. Token
ids are uniform over the vocabulary, the worst case for compression; log-probs look
like a sampler's: most tokens near-certain (close to 0), a heavy tail down to about -30.
Figures are compared with the paper's format (int32 id + fp32 log-prob = 8 B/token)
and with naive JSON of the same numbers.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from protocol import (
    Completion,
    Group,
    PacketHeader,
    RolloutPacket,
    SamplingParams,
    decode,
    encode,
    peek_header,
)

__all__ = ["format_protocol_bench", "realistic_packet", "run_protocol_bench"]

VOCAB_QWEN25 = 151_646
VOCAB_SMOLLM2 = 49_152
SHAPE = {"groups": 8, "completions_per_group": 12, "tokens_per_completion": 200}


def _realistic_logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    # 75% confident tokens (mean -0.02), 25% from a wide tail (mean -2.5, reaching ~-30).
    confident = rng.random(n) < 0.75
    return np.where(confident, -rng.exponential(0.02, n), -rng.exponential(2.5, n)).astype(np.float32)


def realistic_packet(
    vocab_size: int,
    *,
    groups: int = SHAPE["groups"],
    completions: int = SHAPE["completions_per_group"],
    tokens: int = SHAPE["tokens_per_completion"],
    seed: int = 0,
) -> RolloutPacket:
    """A seeded packet of `groups` x `completions` x `tokens` with realistic log-probs."""
    rng = np.random.default_rng(seed)
    header = PacketHeader.create(
        swarm_id="bench",
        round=123_456,
        sender_peer_id="12D3KooWBenchPeerIdBenchPeerIdBenchPeerIdBenchPe",
        base_model_id="Qwen/Qwen2.5-1.5B-Instruct",
        adapter_version="3f9a1c0e2b7d4a58",
        tokenizer_fingerprint="sha256:6b1f0c2e9d8a7b3c",
        vocab_size=vocab_size,
        created_at=1_750_000_000.25,
    )
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=tokens)
    return RolloutPacket(
        header=header,
        groups=[
            Group.of(
                f"gsm_symbolic/{seed}/{g}",
                header.base_model_id,
                sampling,
                [
                    Completion.of(
                        rng.integers(0, vocab_size, tokens, dtype=np.uint32),
                        _realistic_logprobs(rng, tokens),
                        finish_reason="length" if c % 3 == 0 else "stop",
                    )
                    for c in range(completions)
                ],
            )
            for g in range(groups)
        ],
    )


def _median_seconds(fn: Callable[[], Any], repeats: int, min_time: float = 0.05) -> float:
    """Median over `repeats` of the mean time per call, each repeat lasting >= min_time."""
    fn()  # warm caches and lazy imports
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_time / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def _json_bytes(packet: RolloutPacket) -> int:
    doc = {
        "header": packet.header.model_dump(),
        "groups": [
            {
                "task_id": g.task_id,
                "completions": [
                    {"token_ids": c.token_ids.tolist(), "logprobs": c.logprobs.astype(np.float64).tolist()}
                    for c in g.completions
                ],
            }
            for g in packet.groups
        ],
    }
    return len(json.dumps(doc).encode())


def _max_abs_error(original: RolloutPacket, decoded: RolloutPacket) -> float:
    a = np.concatenate([c.logprobs for _, c in original.completions()]).astype(np.float64)
    b = np.concatenate([c.logprobs for _, c in decoded.completions()]).astype(np.float64)
    ids_a = np.concatenate([c.token_ids for _, c in original.completions()])
    ids_b = np.concatenate([c.token_ids for _, c in decoded.completions()])
    if not np.array_equal(ids_a, ids_b):
        raise AssertionError("token ids did not survive the round trip")
    return float(np.abs(a - b).max())


def run_protocol_bench(repeats: int = 5) -> dict:
    """Measure the codec on realistic packets; figures are medians over `repeats`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    packet = realistic_packet(VOCAB_QWEN25)
    small_vocab = realistic_packet(VOCAB_SMOLLM2, seed=1)
    n = packet.num_tokens
    plain, packed = encode(packet), encode(packet, compress=True)
    plain49, packed49 = encode(small_vocab), encode(small_vocab, compress=True)
    ids = np.concatenate([c.token_ids for _, c in packet.completions()])
    lps = np.concatenate([c.logprobs for _, c in packet.completions()])
    paper_bytes = ids.astype(np.int32).nbytes + lps.astype(np.float32).nbytes

    t_enc = _median_seconds(lambda: encode(packet), repeats)
    t_dec = _median_seconds(lambda: decode(plain), repeats)
    t_enc_z = _median_seconds(lambda: encode(packet, compress=True), repeats)
    t_dec_z = _median_seconds(lambda: decode(packed), repeats)
    t_peek = _median_seconds(lambda: peek_header(plain), repeats)
    error = max(_max_abs_error(packet, decode(plain)), _max_abs_error(small_vocab, decode(plain49)))
    return {
        "shape": dict(SHAPE),
        "tokens_per_packet": n,
        "vocab_size": VOCAB_QWEN25,
        "packet_bytes": len(plain),
        "bytes_per_token": len(plain) / n,
        "bytes_per_token_zstd": len(packed) / n,
        "bytes_per_token_vocab49k": len(plain49) / small_vocab.num_tokens,
        "bytes_per_token_vocab49k_zstd": len(packed49) / small_vocab.num_tokens,
        "paper_bytes_per_token": paper_bytes / n,
        "json_bytes_per_token": _json_bytes(packet) / n,
        "encode_tokens_per_s": n / t_enc,
        "decode_tokens_per_s": n / t_dec,
        "encode_tokens_per_s_zstd": n / t_enc_z,
        "decode_tokens_per_s_zstd": n / t_dec_z,
        "peek_header_us": t_peek * 1e6,
        "max_abs_logprob_error": error,
        "repeats": repeats,
    }


def format_protocol_bench(result: dict) -> str:
    """A plain-text table of `run_protocol_bench`'s result."""
    s = result["shape"]
    paper = result["paper_bytes_per_token"]

    def size(label: str, key: str) -> str:
        v = result[key]
        return f"  {label:<34}{v:>10.3f} B/token   {paper / v:>5.2f}x smaller than the paper"

    lines = [
        f"Wire protocol, {s['groups']} groups x {s['completions_per_group']} completions x "
        f"{s['tokens_per_completion']} tokens = {result['tokens_per_packet']:,} tokens/packet "
        f"(median of {result['repeats']})",
        "",
        f"  {'paper (int32 id + fp32 logprob)':<34}{paper:>10.3f} B/token",
        f"  {'naive JSON':<34}{result['json_bytes_per_token']:>10.3f} B/token",
        size(f"ours, vocab {result['vocab_size']:,}", "bytes_per_token"),
        size(f"ours, vocab {result['vocab_size']:,} + zstd", "bytes_per_token_zstd"),
        size("ours, vocab 49,152", "bytes_per_token_vocab49k"),
        size("ours, vocab 49,152 + zstd", "bytes_per_token_vocab49k_zstd"),
        f"  {'packet size':<34}{result['packet_bytes']:>10,} bytes",
        "",
        f"  {'encode':<34}{result['encode_tokens_per_s'] / 1e6:>10.1f} M tokens/s",
        f"  {'decode (validated)':<34}{result['decode_tokens_per_s'] / 1e6:>10.1f} M tokens/s",
        f"  {'encode + zstd':<34}{result['encode_tokens_per_s_zstd'] / 1e6:>10.1f} M tokens/s",
        f"  {'decode + zstd':<34}{result['decode_tokens_per_s_zstd'] / 1e6:>10.1f} M tokens/s",
        f"  {'peek_header':<34}{result['peek_header_us']:>10.1f} us",
        f"  {'max |logprob error|':<34}{result['max_abs_logprob_error']:>10.2e}",
    ]
    return "\n".join(lines)
