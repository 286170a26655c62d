"""What counts as wrong in `ftis-node bench fuzz`: the rules each admitted packet must keep.

Three sets of rules, each checked on the bytes and on what `Admission.admit` returned,
never by asking the decoder again:

1. The wire format (`spec_violation`): an independent reference reader written from
   protocol/codec.py's docstring with plain `msgpack.unpackb` and Python loops. It
   shares no code with the decoder, so the two disagreeing is a finding either way:
   `decoder_accepted_invalid` (decode returned a packet the spec forbids) or
   `decoder_rejected_valid` (decode refused a packet the spec allows).
2. What admission states (`admission_violations`, from node/defence/admission.py): the header
   names the signed sender, our swarm and a round within the stale bound; a foreign
   tokenizer is only taken on the GRAFT path; every admitted group is one of the
   packet's groups, of our task, with a task id we can rebuild, at least
   `min_group_size` sequences and the prompt as WE tokenize it; every sequence is one of
   its group's completions, re-scored by our verifier (reward == task.reward), its ids
   and sampling log-probs the packet's own (token path) or its text re-tokenized with a
   GRAFT weight in (0.8, 1] (the other path).
3. What this node can train on (`unsafe_violations`, issue 10 item 0): every admitted
   sequence has at least one token, ids inside the model's vocabulary, prompt +
   completion within its positions, a header vocabulary equal to ours when the
   tokenizer is ours, and finite local log-probs at the declared sampling parameters.

`admitted_invalid` counts cases admission let through that break rule 1 or 2;
`admitted_unsafe` those that break rule 3.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zstandard

from protocol import Limits

__all__ = ["admission_violations", "spec_is_cheap", "spec_violation", "unsafe_violations"]

_HEADER_FIELDS = {
    "protocol_version",
    "swarm_id",
    "round",
    "sender_peer_id",
    "base_model_id",
    "adapter_version",
    "tokenizer_fingerprint",
    "vocab_size",
    "created_at",
}
_NAMES = ("sender_peer_id", "base_model_id", "adapter_version", "tokenizer_fingerprint")
_BODY_FIELDS = {"groups", "lengths", "finish", "texts", "ids_lo", "ids_hi", "logprobs"}
# Written as a character set on purpose, not the decoder's regex.
_SWARM_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")
_HEADER_BOUND = 8192
_GRAFT_MIN = 0.8


class _Invalid(Exception):
    pass


def _unique(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Invalid("a map repeats a key")
    return out


def _int(x: Any) -> bool:
    return type(x) is int


def _real(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _name(x: Any) -> bool:
    return type(x) is str and 1 <= len(x) <= 256


def _check(ok: bool, why: str) -> None:
    if not ok:
        raise _Invalid(why)


def _header(h: Any) -> dict[str, Any]:
    _check(type(h) is dict and set(h) - {"sender_name"} == _HEADER_FIELDS, "header fields")
    _check(_int(h["protocol_version"]) and h["protocol_version"] == 3, "protocol version")
    label = h.get("sender_name", "")
    _check(type(label) is str and len(label) <= 64 and label.isprintable(), "sender name")
    s = h["swarm_id"]
    _check(type(s) is str and 1 <= len(s) <= 64 and set(s) <= _SWARM_CHARS and s[0] not in "_-", "swarm id")
    _check(_int(h["round"]) and 0 <= h["round"] < 2**63, "round")
    _check(all(_name(h[k]) for k in _NAMES), "a header name")
    _check(_int(h["vocab_size"]) and 1 <= h["vocab_size"] <= 2**32, "vocab_size")
    _check(_real(h["created_at"]) and h["created_at"] >= 0, "created_at")
    return h


def _groups(groups: Any, limits: Limits) -> list[tuple[int, int]]:
    """(max_tokens, n) per group."""
    _check(type(groups) is list and len(groups) <= limits.max_groups, "groups")
    out = []
    for g in groups:
        _check(type(g) is list and len(g) == 4 and _name(g[0]) and _name(g[1]), "group shape or names")
        _check(type(g[2]) is list and len(g[2]) == 4, "sampling shape")
        temperature, top_p, top_k, max_tokens = g[2]
        _check(_real(temperature) and 0 < temperature <= 100, "temperature")
        _check(_real(top_p) and 0 < top_p <= 1, "top_p")
        _check(_int(top_k) and 0 <= top_k < 2**32, "top_k")
        _check(_int(max_tokens) and 1 <= max_tokens < 2**32, "max_tokens")
        _check(_int(g[3]) and 1 <= g[3] <= limits.max_completions_per_group, "completion count")
        out.append((max_tokens, g[3]))
    return out


def _token_ids(lo: bytes, hi: bytes, n_tok: int, planes: int) -> np.ndarray:
    ids = np.array(struct.unpack(f"<{n_tok}H", lo), dtype=np.int64)
    plane_bytes = (n_tok + 7) // 8
    for k in range(planes):
        plane = np.frombuffer(hi[k * plane_bytes : (k + 1) * plane_bytes], np.uint8)
        # Bit i of the plane, most significant bit of each byte first (np.packbits order).
        bits = (plane[np.arange(n_tok) // 8] >> (7 - np.arange(n_tok) % 8)) & 1
        ids |= bits.astype(np.int64) << (16 + k)
    return ids


def _body(b: Any, header: dict[str, Any], limits: Limits) -> None:
    _check(type(b) is dict and set(b) == _BODY_FIELDS, "body fields")
    per_group = _groups(b["groups"], limits)
    n_comp = sum(n for _, n in per_group)
    for key in ("lengths", "finish", "ids_lo", "ids_hi", "logprobs"):
        _check(type(b[key]) is bytes, f"{key} is not binary")
    _check(len(b["lengths"]) == 4 * n_comp, "lengths size")
    lengths = struct.unpack(f"<{n_comp}I", b["lengths"])
    allowed = [m for m, n in per_group for _ in range(n)]
    _check(all(n <= min(m, limits.max_tokens_per_completion) for n, m in zip(lengths, allowed)), "a length")
    n_tok = sum(lengths)
    _check(n_tok <= limits.max_total_tokens, "total tokens")
    _check(len(b["finish"]) == n_comp and all(f < 2 for f in b["finish"]), "finish")
    texts = b["texts"]
    if texts is not None:
        _check(type(texts) is list and len(texts) == n_comp, "texts")
        for t in texts:
            _check(t is None or (type(t) is str and len(t) <= limits.max_text_chars), "a text")
    planes = max(0, (header["vocab_size"] - 1).bit_length() - 16)
    _check(len(b["ids_lo"]) == 2 * n_tok and len(b["logprobs"]) == 2 * n_tok, "token array sizes")
    _check(len(b["ids_hi"]) == planes * ((n_tok + 7) // 8), "ids_hi size")
    ids = _token_ids(b["ids_lo"], b["ids_hi"], n_tok, planes)
    _check(not ids.size or int(ids.max()) < header["vocab_size"], "a token id")


def spec_is_cheap(data: bytes, max_bytes: int = 64 * 1024) -> bool:
    """Whether the reference reader can afford `data`: it builds every object a body
    holds, so it only runs where that body (decompressed) is at most `max_bytes`."""
    if len(data) > max_bytes:
        return False
    if len(data) >= 14 and data[:4] == b"FTIS" and data[5] & 1:
        hlen = int.from_bytes(data[6:10], "little")
        try:
            return bool(zstandard.get_frame_parameters(data[14 + hlen :]).content_size <= max_bytes)
        except Exception:
            return True  # not a frame: rejected at once
    return True


def spec_violation(data: Any, limits: Limits) -> str | None:
    """Why `data` is not a valid packet under `limits` by the documented format, or None."""
    try:
        _check(type(data) is bytes, "not bytes")
        _check(len(data) <= limits.max_bytes, "too large")
        _check(len(data) >= 14, "shorter than the prefix")
        magic, version, flags, hlen, blen = struct.unpack_from("<4sBBII", data)
        _check(magic == b"FTIS" and version == 1 and flags in (0, 1), "magic, version or flags")
        _check(hlen <= _HEADER_BOUND and 14 + hlen + blen == len(data), "lengths")
        header = _header(
            msgpack.unpackb(data[14 : 14 + hlen], raw=False, strict_map_key=False, object_pairs_hook=_unique)
        )
        body = data[14 + hlen :]
        if flags:
            params = zstandard.get_frame_parameters(body)
            _check(0 <= params.content_size <= limits.max_bytes, "zstd content size")
            _check(params.window_size <= 1 << max(10, (limits.max_bytes - 1).bit_length()), "zstd window")
            body = zstandard.ZstdDecompressor().decompress(body, allow_extra_data=False)
            _check(len(body) == params.content_size, "zstd size")
        _body(msgpack.unpackb(body, raw=False, strict_map_key=False, object_pairs_hook=_unique), header, limits)
    except _Invalid as e:
        return str(e)
    except Exception as e:  # not msgpack, not zstd, a bad UTF-8 string, ...
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------- admission


def _subsequence(items: list[Any], pool: list[Any], same: Callable[[Any, Any], bool]) -> list[Any] | None:
    """Match each of `items`, in order, to a later element of `pool`; None if impossible."""
    out, j = [], 0
    for item in items:
        while j < len(pool) and not same(item, pool[j]):
            j += 1
        if j == len(pool):
            return None
        out.append(pool[j])
        j += 1
    return out


def admission_violations(admission: Any, peer_id: str, current_round: int, packet: Any, admitted: Any) -> list[str]:
    """The rules of node/defence/admission.py that `admitted` (an `Admitted`) breaks for `packet`."""
    h = packet.header
    found = []
    if h.sender_peer_id != peer_id:
        found.append("sender")
    if h.swarm_id != admission.swarm_id:
        found.append("swarm")
    if not current_round - admission.stale_rounds <= h.round <= current_round + 1:
        found.append("stale")
    same_tokenizer = h.tokenizer_fingerprint == admission.fingerprint
    if not same_tokenizer and admission.cross_tokenizer != "graft":
        found.append("foreign_tokenizer")
    pairs = _subsequence(
        admitted.groups,
        packet.groups,
        lambda a, g: (
            a.task_id == g.task_id
            and a.generator == g.generator_model_id
            and (a.temperature, a.top_k, a.top_p) == (g.sampling.temperature, g.sampling.top_k, g.sampling.top_p)
        ),
    )
    if pairs is None:
        return [*found, "group_not_in_packet"]
    task = admission.task
    for a, g in zip(admitted.groups, pairs):
        if not task.owns(a.task_id):
            found.append("foreign_task")
            continue
        try:
            problem = task.problem(a.task_id)
        except ValueError:
            found.append("bad_task_id")
            continue
        if len(a.sequences) < admission.min_group_size:
            found.append("group_too_small")
        if a.prompt_ids != admission.tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]:
            found.append("prompt_not_ours")
        for s, c in zip(a.sequences, _sequences_to_completions(admission, a.sequences, g, same_tokenizer)):
            if c is None:
                found.append("sequence_not_in_group")
                break
            if s.reward != float(task.reward(problem, s.text)):
                found.append("reward_not_rescored")
            if same_tokenizer and s.seq_weight != 1.0:
                found.append("token_path_weight")
            if not same_tokenizer and not (_GRAFT_MIN < s.seq_weight <= 1.0 and s.text):
                found.append("graft_weight")
    return found


ANSWER_CLOSE = "</answer>"  # the tag a reward reads the answer up to (docs/security.md)


def _kept_prefix(tok: Any, kept: list[int], full: list[int]) -> bool:
    """`kept` is `full`, or `full` cut right after the first place its text closes the answer
    tag, with an end-of-sequence token right after the tag kept too (the tail rule)."""
    n = len(kept)
    if kept != full[:n]:
        return False
    if n == len(full):
        return True
    eos = tok.eos_token_id
    k = n - 1 if n > 1 and kept[-1] == eos and ANSWER_CLOSE in tok.decode(kept[:-1]) else n
    return ANSWER_CLOSE in tok.decode(kept[:k]) and ANSWER_CLOSE not in tok.decode(kept[: k - 1])


def _sequences_to_completions(admission: Any, seqs: list[Any], group: Any, same_tokenizer: bool) -> list[Any]:
    tok = admission.tokenizer

    def same(s: Any, c: Any) -> bool:
        if same_tokenizer:
            full = c.token_ids.tolist()
            n = len(s.completion_ids)
            return (
                _kept_prefix(tok, s.completion_ids, full)
                # The claimed-log-prob rule may raise a claim on a flagged token (lowering its
                # weight), never lower one; all other claims pass unchanged.
                and len(s.logp_gen) == n
                and bool(np.all(np.asarray(s.logp_gen) >= np.asarray(c.logprobs)[:n]))
                # the text is the whole completion's: the reward was scored before any cut
                and s.text == tok.decode(full, skip_special_tokens=True)
            )
        if not c.text or s.text != c.text:
            return False
        ids = tok(c.text, add_special_tokens=False)["input_ids"]
        eos = tok.eos_token_id
        return any(_kept_prefix(tok, s.completion_ids, full) for full in (ids, [*ids, eos] if eos is not None else ids))

    matched = _subsequence(seqs, list(group.completions), same)
    return matched if matched is not None else [None] * len(seqs)


def unsafe_violations(
    admitted: Any, packet: Any, fingerprint: str, vocab_size: int, max_positions: int, group_logprobs: Any
) -> list[str]:
    """What this node could not train on among the admitted sequences (issue 10, item 0).

    `group_logprobs(prompt_ids, [completion_ids, ...], temperature, top_k, top_p)` gives
    the local per-token log-probs of each completion, as the trainer would compute them.
    """
    found = []
    if packet.header.tokenizer_fingerprint == fingerprint and packet.header.vocab_size != vocab_size:
        found.append("header_vocab_differs")
    for g in admitted.groups:
        scorable = []
        for s in g.sequences:
            if not s.completion_ids:
                found.append("empty_completion")
            elif max(s.completion_ids) >= vocab_size:
                found.append("token_id_past_vocab")
            elif len(g.prompt_ids) + len(s.completion_ids) > max_positions:
                found.append("past_positions")
            else:
                scorable.append(s.completion_ids)
        if not scorable:
            continue
        try:
            logps = group_logprobs(g.prompt_ids, scorable, g.temperature, g.top_k, g.top_p)
        except Exception:  # what the trainer would hit on this group
            found.append("local_logprobs_raise")
            continue
        if not all(np.all(np.isfinite(lp)) for lp in logps):
            found.append("nonfinite_local_logprobs")
    return sorted(set(found))
