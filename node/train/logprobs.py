"""Log-probs of sampled tokens under the distribution a sampler actually draws from.

Two places need the same number: the rollout engine records, for every sampled token,
its log-prob under the *sampling* distribution (after temperature, top-k and top-p), and
the trainer recomputes that log-prob with gradient under its own weights. Both go
through `sampling_logprobs`, so the truncation rules cannot drift apart.

The truncation follows Hugging Face's sampler exactly (temperature, then top-k keeping
ties with the k-th score, then top-p on the renormalised survivors keeping the smallest
set whose mass reaches p), with one addition: the target token itself is never masked.
At generation time this changes nothing (a sampled token was inside the kept set). At
training time it keeps a peer's token that falls outside the *local* nucleus finite
instead of -inf, which would otherwise turn the importance ratio into NaN.

Memory: a [tokens, vocabulary] logits tensor is the largest thing a step makes (4,096
tokens x 151,936 ids x 4 B = 2.5 GB for Qwen2.5). `sequence_logprobs` therefore runs the
model's body once, then the output head over a chunk of positions at a time: the chosen
token's score minus the logsumexp of its row. Under autograd a chunk's softmax is kept
for the backward pass only while the kept ones together stay within one copy of the head
(`KEEP_SCORES_POSITIONS`, the head's width by default: 896 positions for Qwen2.5-0.5B); past
that, a chunk's scores are rebuilt in the backward pass (one head matmul more) instead of
kept. A micro-batch of a few hundred tokens keeps them all and pays no rebuild; a large one
holds at most that, never a [tokens, vocab] tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "KEEP_SCORES_POSITIONS",
    "LOGIT_CHUNK_ELEMENTS",
    "completion_views",
    "sampling_logprobs",
    "sequence_logprobs",
    "sequence_view",
    "truncate_scores",
]

#: Scores held at once by the chunked path: positions per chunk = this // vocabulary
#: (85 for SmolLM2's 49,152 ids, 27 for Qwen2.5's 151,936): 16 MB of fp32 a tensor.
LOGIT_CHUNK_ELEMENTS = 2**22

#: Positions per pass whose softmax is kept for the backward pass (None: the head's width, so
#: the kept scores never outweigh the head itself); the rest are rebuilt there.
KEEP_SCORES_POSITIONS: int | None = None

# Causal LMs whose logits are exactly `lm_head(body(...).last_hidden_state)`, with no
# scaling or soft-capping after the head; any other model takes the one-pass path.
_SPLITTABLE = frozenset({"llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "smollm3"})


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def truncate_scores(
    scores: torch.Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k / top-p sampling would never draw.

    `scores` are temperature-scaled logits [..., V]. `keep` (same shape minus V, integer
    ids) names tokens that stay unmasked whatever their rank.
    """
    removed = torch.zeros_like(scores, dtype=torch.bool)
    if top_k > 0:
        k = min(top_k, scores.size(-1))
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        removed |= scores < kth
    if top_p < 1.0:
        masked = scores.masked_fill(removed, float("-inf"))
        sorted_scores, order = torch.sort(masked, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1:] = False  # the most likely token always survives
        removed |= drop_sorted.scatter(-1, order, drop_sorted)
    if keep is not None:
        removed.scatter_(-1, keep.unsqueeze(-1), False)
    return scores.masked_fill(removed, float("-inf"))


def sampling_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """log p(target) under softmax(truncate(logits / temperature)); shape of `targets`.

    Computed in fp32 whatever the model's dtype; differentiable w.r.t. `logits`.
    """
    _check_sampling(temperature, top_k, top_p)
    scores = logits.float() / temperature
    if top_k > 0 or top_p < 1.0:
        # The mask is a function of the scores but carries no gradient of its own.
        with torch.no_grad():
            masked = truncate_scores(scores.detach(), top_k, top_p, keep=targets)
        scores = scores.masked_fill(torch.isinf(masked), float("-inf"))
    return scores.log_softmax(dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _layout(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Left-padded prompts then right-padded completions: (ids, attention, p_max, t_max)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if not prompt_ids:
        raise ValueError("empty batch")
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if len(p) == 0:
            raise ValueError(f"sequence {i}: empty prompt (a causal LM needs a first token to condition on)")
        if len(c) == 0:
            raise ValueError(f"sequence {i}: empty completion")
    p_max = max(len(p) for p in prompt_ids)
    t_max = max(len(c) for c in completion_ids)
    batch = len(prompt_ids)
    ids = torch.full((batch, p_max + t_max), pad_id, dtype=torch.long)
    attn = torch.zeros((batch, p_max + t_max), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        start = p_max - len(p)
        ids[i, start:p_max] = torch.as_tensor(list(p), dtype=torch.long)
        ids[i, p_max : p_max + len(c)] = torch.as_tensor(list(c), dtype=torch.long)
        attn[i, start : p_max + len(c)] = 1
    return ids, attn, p_max, t_max


def _split(model: Any) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(body, output head) of a causal LM (peft-wrapped or not) whose logits are head(body), else None."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(lm, "config", None)
    if getattr(config, "model_type", None) not in _SPLITTABLE or not hasattr(lm, "get_output_embeddings"):
        return None
    body, head = getattr(lm, lm.base_model_prefix, None), lm.get_output_embeddings()
    if not isinstance(body, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return None
    return body, head


def _chosen_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """log p(target) for a chunk of rows of raw logits: the chosen score minus the row's logsumexp."""
    scores = logits.float() / temperature
    if top_k > 0 or top_p < 1.0:
        with torch.no_grad():
            masked = truncate_scores(scores.detach(), top_k, top_p, keep=targets)
        scores = scores.masked_fill(torch.isinf(masked), float("-inf"))
    return scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - scores.logsumexp(dim=-1)


def _chunk_scores(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    return _chosen_logprobs(head(hidden), targets, temperature, top_k, top_p)


def _masked_scores(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    scores = torch.nn.functional.linear(hidden, weight).float() / temperature
    if top_k > 0 or top_p < 1.0:
        scores = scores.masked_fill(torch.isinf(truncate_scores(scores, top_k, top_p, keep=targets)), float("-inf"))
    return scores


class _ChosenLogprob(torch.autograd.Function):
    """`_chunk_scores` for a bias-free linear head, with its gradient written out:
    d logp / d scores = onehot(target) - softmax. `keep` saves the chunk's softmax for the
    backward pass; otherwise it is rebuilt there from the saved hidden states and logsumexp.
    Same numbers as checkpointing the chunk, with fewer passes over the [chunk, vocab] scores."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        top_k: int,
        top_p: float,
        keep: bool,
    ) -> torch.Tensor:
        scores = _masked_scores(hidden, weight, targets, temperature, top_k, top_p)
        lse = scores.logsumexp(dim=-1)
        chosen = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        kept = scores.sub_(lse.unsqueeze(-1)).exp_() if keep else lse
        ctx.save_for_backward(hidden, weight, targets, kept)
        ctx.sampling, ctx.keep = (temperature, top_k, top_p), keep
        return chosen

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, kept = ctx.saved_tensors
        temperature = ctx.sampling[0]
        with torch.no_grad():
            if ctx.keep:
                probs = kept.clone()  # the saved tensor stays as autograd saved it
            else:
                probs = _masked_scores(hidden, weight, targets, *ctx.sampling).sub_(kept.unsqueeze(-1)).exp_()
            d_scores = probs.mul_(-grad.unsqueeze(-1))  # masked ids: exp(-inf) = 0, no gradient
            d_scores.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
            d_logits = d_scores.div_(temperature).to(hidden.dtype)
            d_hidden = d_logits @ weight if ctx.needs_input_grad[0] else None
            d_weight = d_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return d_hidden, d_weight, None, None, None, None, None


def _chunked(
    model: Any,
    split: tuple[torch.nn.Module, torch.nn.Module],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    sampling: tuple[float, int, float],
    pad_id: int,
    with_ranks: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The body once, then the head a chunk of real positions at a time: (logp, mask, ranks)."""
    body, head = split
    device = next(model.parameters()).device
    ids, attn, p_max, t_max = _layout(prompt_ids, completion_ids, pad_id)
    ids, attn = ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    hidden = body(input_ids=ids, attention_mask=attn, position_ids=position_ids).last_hidden_state
    # Column p_max-1+t predicts completion token t; only real (unpadded) positions are scored.
    hidden = hidden[:, p_max - 1 : p_max - 1 + t_max]
    mask = attn[:, p_max:].to(torch.float32)
    real = mask > 0
    h, targets = hidden[real], ids[:, p_max:][real]
    del hidden
    weight = getattr(head, "weight", None)
    vocab = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 1
    step = max(1, LOGIT_CHUNK_ELEMENTS // max(vocab, 1))
    backward = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters()))
    plain_head = type(head) is torch.nn.Linear and head.bias is None
    keep_positions = KEEP_SCORES_POSITIONS
    if keep_positions is None:
        keep_positions = int(weight.shape[1]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0
    parts, ranks = [], []
    for start in range(0, h.shape[0], step):
        hc, tc = h[start : start + step], targets[start : start + step]
        if backward and plain_head:
            keep = start + hc.shape[0] <= keep_positions  # else rebuilt in the backward pass
            parts.append(_ChosenLogprob.apply(hc, head.weight, tc, *sampling, keep))
            continue
        if backward:  # another kind of head (a LoRA on lm_head, a bias): checkpoint the chunk
            parts.append(checkpoint(_chunk_scores, hc, head, tc, *sampling, use_reentrant=False))
            continue
        logits = head(hc)
        parts.append(_chosen_logprobs(logits, tc, *sampling))
        if with_ranks:  # how many ids the raw logits rank above the token (0 = the model's first choice)
            raw = logits.float()
            ranks.append((raw > raw.gather(-1, tc.unsqueeze(-1))).sum(-1))
        del logits
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_scatter(real, torch.cat(parts))
    rank = None
    if with_ranks:
        rank = torch.zeros(mask.shape, dtype=torch.long, device=device).masked_scatter(real, torch.cat(ranks))
    return logp, mask, rank


def _one_pass(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    sampling: tuple[float, int, float],
    pad_id: int,
    with_ranks: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The whole [B, T, V] logits at once: for models `_split` does not know, and the reference."""
    device = next(model.parameters()).device
    ids, attn, p_max, t_max = _layout(prompt_ids, completion_ids, pad_id)
    ids, attn = ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=t_max + 1)
    # Column p_max-1+t predicts completion token t.
    logits = out.logits[:, :-1, :]
    targets = ids[:, p_max:]
    mask = attn[:, p_max:].to(torch.float32)
    logp = sampling_logprobs(logits, targets, *sampling)
    rank = None
    if with_ranks:
        with torch.no_grad():
            raw = logits.detach().float()
            rank = (raw > raw.gather(-1, targets.unsqueeze(-1))).sum(-1) * (mask > 0)
    return torch.where(mask > 0, logp, torch.zeros_like(logp)), mask, rank


def _score(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float,
    top_k: int,
    top_p: float,
    pad_id: int,
    chunked: bool,
    with_ranks: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    _check_sampling(temperature, top_k, top_p)
    split = _split(model) if chunked else None
    if split is not None:
        return _chunked(model, split, prompt_ids, completion_ids, (temperature, top_k, top_p), pad_id, with_ranks)
    return _one_pass(model, prompt_ids, completion_ids, (temperature, top_k, top_p), pad_id, with_ranks)


def sequence_logprobs(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    pad_id: int = 0,
    *,
    chunked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion given its prompt: (logp[B, T], mask[B, T]).

    The batch is laid out as left-padded prompts followed by right-padded completions,
    so every completion starts at the same column. Positions are counted from each
    row's first real token, exactly as `generate` does for a left-padded batch.

    `chunked` (the default) scores the head a chunk of positions at a time (see the
    module's docstring); False makes the whole [B, T, V] logits in one pass, as before
    the chunks existed (the reference the tests and `bench memory` compare against).

    `logp` carries gradient when the model's parameters do; padded slots are 0 and
    `mask` (float, 1 = real token) marks the rest.
    """
    logp, mask, _ = _score(
        model, prompt_ids, completion_ids, temperature, top_k, top_p, pad_id, chunked, with_ranks=False
    )
    return logp, mask


def sequence_view(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a screen needs, without autograd: (logp[B, T], rank[B, T], mask[B, T]).

    `logp` as `sequence_logprobs`; `rank` counts the ids whose raw logit beats the token's.
    """
    with torch.no_grad():  # ranks are only made without autograd
        logp, mask, rank = _score(
            model, prompt_ids, completion_ids, temperature, top_k, top_p, pad_id, chunked=True, with_ranks=True
        )
    assert rank is not None
    return logp, rank, mask


def completion_views(
    model: Any,
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    pad_id: int = 0,
    *,
    token_budget: int = 4096,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(logp, rank) of every token of `completions`, all answering `prompt_ids`, as numpy rows.

    `sequence_view` over batches of about `token_budget` padded tokens, so the body's
    activations stay bounded too.
    """
    out: list[tuple[np.ndarray, np.ndarray]] = []
    i = 0
    while i < len(completions):
        width = len(prompt_ids) + max(len(c) for c in completions[i:])
        chunk = [list(c) for c in completions[i : i + max(1, token_budget // max(width, 1))]]
        logp, rank, _ = sequence_view(model, [prompt_ids] * len(chunk), chunk, temperature, top_k, top_p, pad_id)
        for row, c in enumerate(chunk):
            out.append((logp[row, : len(c)].cpu().numpy(), rank[row, : len(c)].cpu().numpy().astype(np.int64)))
        i += len(chunk)
    return out
