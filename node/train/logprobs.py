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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["sampling_logprobs", "truncate_scores", "sequence_logprobs"]


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


def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion given its prompt: (logp[B, T], mask[B, T]).

    The batch is laid out as left-padded prompts followed by right-padded completions,
    so every completion starts at the same column. The model then only has to project
    the last T+1 hidden states to the vocabulary (`logits_to_keep`), which keeps the
    [B, L, V] logits tensor from dominating memory. Positions are counted from each
    row's first real token, exactly as `generate` does for a left-padded batch.

    `logp` carries gradient when the model's parameters do; padded slots are 0 and
    `mask` (float, 1 = real token) marks the rest.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if not prompt_ids:
        raise ValueError("empty batch")
    _check_sampling(temperature, top_k, top_p)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if len(p) == 0:
            raise ValueError(f"sequence {i}: empty prompt (a causal LM needs a first token to condition on)")
        if len(c) == 0:
            raise ValueError(f"sequence {i}: empty completion")

    device = next(model.parameters()).device
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
    ids, attn = ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)

    out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=t_max + 1)
    # Column p_max-1+t predicts completion token t.
    logits = out.logits[:, :-1, :]
    targets = ids[:, p_max:]
    mask = attn[:, p_max:].to(torch.float32)
    logp = sampling_logprobs(logits, targets, temperature, top_k, top_p)
    return torch.where(mask > 0, logp, torch.zeros_like(logp)), mask
