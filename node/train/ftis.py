"""F-TIS: Filtered Truncated Importance Sampling, a GRPO variant for learning from
samples that other models generated.

Everything here is a pure function of tensors: no model, no optimizer, no state.
The trainer computes `logp` (the local policy's per-token log-probs, with grad) on a
padded micro-batch and calls `ftis_loss`, which returns the scalar loss and a dict of
detached float metrics.

The loss, line by line as in the README's "The loss" section (group = one prompt
answered G times by ONE generator model):

    A_i     = (r_i - mean(r)) / (std(r) + 1e-6)        group_advantages()
    delta_t = logp[t].detach() - logp_gen[t]
    kl_i    = sum_t (-delta_t)                         k1 estimate of KL(gen || local)
    A_i     = 0  if  A_i < 0 and kl_i > g              the filter (whole sequence)
    w_t     = min(exp(delta_t), C)                     truncated IS weight, no grad
    R_t     = exp(logp[t] - logp[t].detach())          == 1, carries grad of log pi
    s_t     = min(R_t * A_i, clip(R_t, 1-eps, 1+eps) * A_i)
    loss    = - mean_groups mean_i mean_t (w_t * s_t)

The variants the paper compares differ only in w, R and the filter (`LossConfig`).
The paper's "alone" baseline is not a loss: it trains on the node's own samples only,
which is a choice of data made by the trainer; its loss is any variant here (on own
samples they coincide up to the engine/trainer mismatch that w absorbs).

Micro-batching. The nested mean is linear in the sequences, so it can be written as
`loss = - sum_i scale_i * seq_weight_i * mean_t(w_t * s_t)` with
`scale_i = 1 / (n_groups * size of i's group)` (see `group_mean_scale`). A trainer
that splits a batch into micro-batches computes `scale` once for the whole batch,
passes each micro-batch its slice as `sequence_scale`, and sums the micro-batch
losses (or accumulates their gradients): the result is exactly the full-batch loss.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor

__all__ = [
    "VARIANTS",
    "LossConfig",
    "default_kl_threshold",
    "group_advantages",
    "group_mean_scale",
    "ftis_loss",
    "grpo_loss",
    "offpolicy_stats",
    "kl_bin_edges",
]

Variant = Literal["nois", "vis", "tis", "f-nois", "f-vis", "f-tis"]
VARIANTS: tuple[str, ...] = typing.get_args(Variant)
KlReduction = Literal["sum", "mean"]

# The paper's threshold g = 50 is for kl summed over a completion's tokens. With a
# per-token mean the natural scale is DeepSeek-V3.2's (about 0.5 nats per token).
_DEFAULT_KL_THRESHOLD: dict[str, float] = {"sum": 50.0, "mean": 0.5}

# Histogram bins as fractions of the threshold g, so that the filter's edge (1.0 * g)
# is always a bin edge whatever the reduction. k1 estimates can be negative, hence 0.
_KL_BIN_FRACTIONS: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def default_kl_threshold(kl_reduction: str) -> float:
    """The filter threshold g that goes with a KL reduction: 50 for "sum", 0.5 for "mean"."""
    try:
        return _DEFAULT_KL_THRESHOLD[kl_reduction]
    except KeyError:
        raise ValueError(
            f"unknown kl_reduction {kl_reduction!r}: expected one of {sorted(_DEFAULT_KL_THRESHOLD)}"
        ) from None


class LossConfig(BaseModel):
    """Which variant of the loss, and its constants (paper defaults).

    | variant | w_t               | R_t (PPO ratio)  | filter |
    |---------|-------------------|------------------|--------|
    | nois    | 1                 | pi / pi.detach() | no     |
    | vis     | 1                 | pi / pi_gen      | no     |
    | tis     | min(pi/pi_gen, C) | pi / pi.detach() | no     |
    | f-nois  | 1                 | pi / pi.detach() | yes    |
    | f-vis   | 1                 | pi / pi_gen      | yes    |
    | f-tis   | min(pi/pi_gen, C) | pi / pi.detach() | yes    |

    `kl_threshold` defaults to `default_kl_threshold(kl_reduction)` when not given.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: Variant = "f-tis"
    is_cap: float = Field(2.0, ge=1.0, description="C: cap on the IS weight exp(delta)")
    kl_threshold: float = Field(
        _DEFAULT_KL_THRESHOLD["sum"], ge=0.0, description="g: filter threshold on kl_i (see the validator)"
    )
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="eps: PPO ratio clip")
    kl_reduction: KlReduction = Field("sum", description="kl_i summed or averaged over tokens")

    @model_validator(mode="before")
    @classmethod
    def _threshold_follows_reduction(cls, data: Any) -> Any:
        # A threshold given explicitly wins; otherwise pick the one that matches the
        # reduction, since g = 50 with a per-token mean would never filter anything.
        if isinstance(data, dict) and data.get("kl_threshold") is None:
            reduction = data.get("kl_reduction", "sum")
            # An invalid reduction is reported by the field's own validation; the sum's g stands in.
            default = _DEFAULT_KL_THRESHOLD.get(reduction) if isinstance(reduction, str) else None
            data = {**data, "kl_threshold": default if default is not None else _DEFAULT_KL_THRESHOLD["sum"]}
        return data

    @field_validator("variant", mode="before")
    @classmethod
    def _known_variant(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip().lower().replace("_", "-")
            if value == "alone":
                raise ValueError(
                    "'alone' is not a loss variant: it means training on the node's own "
                    "samples only, a data setting of the trainer; pick the loss among "
                    f"{', '.join(VARIANTS)}"
                )
            if value not in VARIANTS:
                raise ValueError(f"unknown loss variant {value!r}: expected one of {', '.join(VARIANTS)}")
        return value

    @property
    def filtered(self) -> bool:
        """Whether negative-advantage sequences with kl_i > g are dropped."""
        return self.variant.startswith("f-")

    @property
    def truncated_is(self) -> bool:
        """Whether tokens are weighted by w_t = min(exp(delta_t), C)."""
        return self.variant in ("tis", "f-tis")

    @property
    def ratio_to_generator(self) -> bool:
        """Whether the PPO ratio is pi / pi_gen (vis) instead of pi / pi.detach()."""
        return self.variant in ("vis", "f-vis")


# --------------------------------------------------------------------------- groups


def _dense_groups(group_ids: Tensor, n: int) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to 0..K-1 (the order of first appearance is not kept)."""
    if not isinstance(group_ids, Tensor):
        raise TypeError(f"group_ids must be a torch.Tensor, got {type(group_ids).__name__}")
    if group_ids.dim() != 1 or group_ids.shape[0] != n:
        raise ValueError(f"group_ids must have shape [{n}], got {list(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean(r)) / (std(r) + eps), with mean and std over i's group.

    A group is one prompt answered by ONE generator model; callers must give samples
    of different generators different ids, because advantages are never pooled across
    models. `std` is the POPULATION std (divide by G, not G - 1): it is defined for a
    group of one, it makes the advantages of a group exactly unit-variance, and with
    G = 12 it differs from the sample std by a factor sqrt(12/11) only. A group whose
    rewards are all equal (including a group of one) gets advantage exactly 0.
    """
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [N], got {list(rewards.shape)}")
    if not rewards.dtype.is_floating_point:
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n = rewards.shape[0]
    inverse, k = _dense_groups(group_ids, n)
    r = rewards.detach()
    count = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count
    centered = r - mean[inverse]
    var = torch.zeros_like(count).index_add_(0, inverse, centered * centered) / count
    adv = centered / (var.sqrt()[inverse] + eps)
    # Equal rewards can leave a rounding residue in `centered` (1e-17 / 1e-6 is not 0);
    # such a group carries no signal, so its advantage is set to exactly 0.
    hi = torch.full_like(count, -math.inf).scatter_reduce_(0, inverse, r, reduce="amax")
    lo = torch.full_like(count, math.inf).scatter_reduce_(0, inverse, r, reduce="amin")
    return torch.where((hi == lo)[inverse], torch.zeros_like(adv), adv)


def group_mean_scale(group_ids: Tensor | None, n: int | None = None) -> Tensor:
    """Per-sequence factor that turns a sum over sequences into mean_groups mean_i.

    scale_i = 1 / (n_groups * size of i's group); with `group_ids=None`, every row is
    one level of mean over sequences and scale_i = 1 / n. Compute this once over the
    whole batch and slice it per micro-batch (`ftis_loss(..., sequence_scale=...)`).
    """
    if group_ids is None:
        if n is None or n <= 0:
            raise ValueError("group_mean_scale needs group_ids or a positive n")
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    n = group_ids.shape[0] if n is None else n
    if n == 0:
        raise ValueError("group_mean_scale of an empty batch")
    inverse, k = _dense_groups(group_ids, n)
    size = torch.bincount(inverse, minlength=k).to(torch.float64)
    return 1.0 / (k * size[inverse])


# --------------------------------------------------------------------------- inputs


def _compute_dtype(logp: Tensor) -> torch.dtype:
    # exp(delta) and the clip boundaries are not meaningful in bf16/fp16; compute in
    # at least fp32 (an fp64 input stays fp64, which the tests rely on).
    return torch.promote_types(logp.dtype, torch.float32)


def _check_bt(name: str, x: Any, shape: torch.Size | None) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if shape is None:
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [B, T], got {list(x.shape)}")
    elif x.shape != shape:
        raise ValueError(f"{name} must have the shape of logp {list(shape)}, got {list(x.shape)}")


def _check_rows(name: str, x: Any, b: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1 or x.shape[0] != b:
        raise ValueError(f"{name} must have shape [{b}], got {list(x.shape)}")


def _valid_mask(mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("mask must hold only 0 and 1 (1 = completion token)")
    return mask != 0


def _prepare(
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None,
    seq_weights: Tensor | None,
    sequence_scale: Tensor | None,
    logp_gen: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Validate the inputs; return (valid mask, logp, advantages, scale, logp_gen) in the compute dtype.

    Padding positions of logp / logp_gen are replaced by 0 with `where`, so whatever
    they held (garbage, -inf, NaN) changes neither the loss nor the gradient.
    """
    _check_bt("logp", logp, None)
    b = logp.shape[0]
    if b == 0:
        raise ValueError("empty batch: logp has no rows")
    if not logp.dtype.is_floating_point:
        raise ValueError(f"logp must be a floating tensor, got {logp.dtype}")
    _check_bt("mask", mask, logp.shape)
    _check_rows("advantages", advantages, b)
    if group_ids is not None and sequence_scale is not None:
        raise ValueError(
            "pass group_ids (normalise within this call) or sequence_scale (normalisation "
            "precomputed over the whole batch), not both"
        )
    dtype = _compute_dtype(logp)
    dev = logp.device
    valid = _valid_mask(mask).to(dev)
    adv = advantages.detach().to(device=dev, dtype=dtype)
    checks: dict[str, Tensor] = {"advantages must be finite": ~torch.isfinite(adv)}
    if sequence_scale is not None:
        _check_rows("sequence_scale", sequence_scale, b)
        scale = sequence_scale.detach().to(device=dev, dtype=dtype)
        checks["sequence_scale must be finite and >= 0"] = ~torch.isfinite(scale) | (scale < 0)
    else:
        scale = group_mean_scale(group_ids, b).to(device=dev, dtype=dtype)
    if seq_weights is not None:
        _check_rows("seq_weights", seq_weights, b)
        sw = seq_weights.detach().to(device=dev, dtype=dtype)
        checks["seq_weights must be finite and >= 0"] = ~torch.isfinite(sw) | (sw < 0)
        scale = scale * sw
    gen = None
    if logp_gen is not None:
        _check_bt("logp_gen", logp_gen, logp.shape)
        gen = torch.where(valid, logp_gen.detach().to(device=dev, dtype=dtype), 0.0)
        checks["logp_gen must be finite at completion tokens"] = ~torch.isfinite(gen)
    # One host sync for all value checks, not one per tensor.
    failed = torch.stack([c.any() for c in checks.values()]).tolist()
    for reason, bad in zip(checks, failed):
        if bad:
            raise ValueError(reason)
    lp = torch.where(valid, logp.to(dtype), 0.0)
    return valid, lp, adv, scale, gen


def _ppo_term(ratio: Tensor, adv: Tensor, eps: float) -> Tensor:
    """s_t = min(R_t * A_i, clip(R_t, 1-eps, 1+eps) * A_i), broadcast over tokens."""
    a = adv[:, None]
    return torch.minimum(ratio * a, ratio.clamp(1.0 - eps, 1.0 + eps) * a)


def _clip_active(ratio: Tensor, adv: Tensor, eps: float, valid: Tensor) -> Tensor:
    """Tokens where the clipped branch wins the min, i.e. whose gradient clipping removes."""
    a = adv[:, None]
    return valid & (((a > 0) & (ratio > 1.0 + eps)) | ((a < 0) & (ratio < 1.0 - eps)))


def _masked_seq_mean(x: Tensor, n_tok: Tensor) -> Tensor:
    """mean_t over a sequence's valid tokens (x is already 0 at padding); 0 for an empty row."""
    return x.sum(-1) / n_tok.clamp(min=1)


# --------------------------------------------------------------------------- stats


def _sequence_kl(delta: Tensor, n_tok: Tensor, cfg: LossConfig) -> Tensor:
    """kl_i = sum_t(-delta_t), or its mean over the sequence's tokens (delta is 0 at padding)."""
    kl = -delta.sum(-1)
    return kl / n_tok.clamp(min=1) if cfg.kl_reduction == "mean" else kl


def _offpolicy_core(
    delta: Tensor, w_is: Tensor, valid: Tensor, n_tok: Tensor, cfg: LossConfig
) -> tuple[dict[str, Tensor], Tensor]:
    """0-d tensors of the off-policy diagnostics, and the per-sequence kl_i.

    `w_is` = min(exp(delta), C): the IS diagnostics (frac_capped, is_weight_mean, ess)
    use the truncated weight whatever the variant, so they compare across variants.
    """
    dt = delta.dtype
    n_all = valid.sum().clamp(min=1).to(dt)
    vf = valid.to(dt)
    kl = _sequence_kl(delta, n_tok, cfg)
    w = w_is * vf
    mean_w = w.sum() / n_all
    mean_w2 = (w * w).sum() / n_all
    q = torch.quantile(kl, torch.tensor([0.1, 0.5, 0.9], dtype=dt, device=kl.device))
    core = {
        "n_seqs": torch.tensor(float(delta.shape[0]), dtype=dt, device=delta.device),
        "n_tokens": valid.sum().to(dt),
        "mean_abs_delta": delta.abs().sum() / n_all,
        "frac_capped": ((delta > math.log(cfg.is_cap)) & valid).sum().to(dt) / n_all,
        "is_weight_mean": mean_w,
        # 1 / mean(w^2) as the design states; ess_kish = mean(w)^2 / mean(w^2) is the
        # textbook normalised ESS in (0, 1], which stays <= 1 when the weights are < 1.
        "ess": 1.0 / mean_w2.clamp(min=torch.finfo(dt).tiny),
        "ess_kish": mean_w * mean_w / mean_w2.clamp(min=torch.finfo(dt).tiny),
        "kl_mean": kl.mean(),
        "kl_p10": q[0],
        "kl_p50": q[1],
        "kl_p90": q[2],
        "kl_max": kl.max(),
    }
    return core, kl


def kl_bin_edges(cfg: LossConfig) -> list[float]:
    """Fixed edges of the kl histogram: fractions (0 .. 5) of the threshold g.

    The histogram has len(edges) + 1 counts: below edges[0] (negative k1 estimates),
    then [edges[j-1], edges[j]), then at or above edges[-1]. All edges are finite so
    the histogram serialises to JSON.
    """
    return [f * cfg.kl_threshold for f in _KL_BIN_FRACTIONS]


def offpolicy_stats(logp: Tensor, logp_gen: Tensor, mask: Tensor, cfg: LossConfig) -> dict[str, Any]:
    """Per-peer off-policy diagnostics, for the daemon to log and show per peer.

    Returns floats (and `kl_hist`: list[int], `kl_bin_edges`: list[float]):
    n_seqs, n_tokens, mean_abs_delta, frac_capped (tokens with exp(delta) > C),
    is_weight_mean, ess = 1/mean(w^2), ess_kish, kl_mean, kl_p10/p50/p90/max, and
    frac_kl_over (sequences with kl_i > g, which the filter drops when A_i < 0).
    """
    _check_bt("logp", logp, None)
    if logp.shape[0] == 0:
        raise ValueError("empty batch: logp has no rows")
    _check_bt("logp_gen", logp_gen, logp.shape)
    _check_bt("mask", mask, logp.shape)
    dtype = _compute_dtype(logp)
    valid = _valid_mask(mask)
    gen = torch.where(valid, logp_gen.detach().to(dtype), 0.0)
    lp = torch.where(valid, logp.detach().to(dtype), 0.0)
    if not bool(torch.isfinite(gen).all() & torch.isfinite(lp).all()):
        raise ValueError("non-finite log-prob at a completion token")
    n_tok = valid.sum(-1).to(dtype)
    delta = lp - gen
    core, kl = _offpolicy_core(delta, torch.exp(delta).clamp(max=cfg.is_cap), valid, n_tok, cfg)
    core["frac_kl_over"] = (kl > cfg.kl_threshold).to(dtype).mean()
    edges = kl_bin_edges(cfg)
    bins = torch.bucketize(kl, torch.tensor(edges, dtype=dtype, device=kl.device), right=True)
    hist = torch.bincount(bins, minlength=len(edges) + 1)
    names = list(core)
    values = torch.stack([core[k] for k in names]).tolist()
    out: dict[str, Any] = dict(zip(names, values))
    out["n_seqs"], out["n_tokens"] = int(out["n_seqs"]), int(out["n_tokens"])
    out["kl_hist"] = [int(c) for c in hist.tolist()]
    out["kl_bin_edges"] = edges
    return out


# --------------------------------------------------------------------------- losses


def ftis_loss(
    logp: Tensor,
    logp_gen: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    group_ids: Tensor | None = None,
    seq_weights: Tensor | None = None,
    sequence_scale: Tensor | None = None,
    with_metrics: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """The F-TIS loss (or one of its variants, `cfg.variant`) on a padded batch.

    Args:
        logp: [B, T] local policy log-probs of the completion tokens, with grad.
        logp_gen: [B, T] the generator's sampling log-probs of the same tokens.
        advantages: [B] group-normalised advantages (`group_advantages`), computed
            over whole groups BEFORE the filter, so filtered samples still count in
            their group's mean and std.
        mask: [B, T] 1 (or True) at completion tokens, 0 at prompt/padding.
        cfg: the variant and its constants.
        group_ids: [B] int, the generator group of each row; the loss is then
            mean_groups mean_i mean_t. None: one mean over rows.
        seq_weights: [B] >= 0, multiplies each sequence's contribution without
            renormalising (the cross-tokenizer GRAFT rule passes min(s, 1), so a
            doubtful sequence counts less and the others do not count more).
        sequence_scale: [B] >= 0, explicit normalisation: loss = -sum_i scale_i *
            mean_t(w s). Pass the slice of `group_mean_scale(batch_group_ids)` for a
            micro-batch; exclusive with group_ids.
        with_metrics: False skips the diagnostics (metrics is then {}): a trainer that
            accumulates micro-batches computes them once over the whole batch instead.

    A row with no completion token contributes 0 but still counts in its group's size.
    vis / f-vis use the raw ratio pi / pi_gen: with A < 0 the PPO min leaves it
    unbounded above, as in the paper (that instability is what the variants compare).

    Returns:
        (loss, metrics): metrics are floats: loss, n_seqs, n_tokens, mean_abs_delta,
        frac_capped, is_weight_mean, ess, ess_kish, kl_mean, kl_p10/p50/p90/max,
        frac_filtered (sequences whose advantage the filter zeroed), clip_frac
        (tokens whose gradient the ratio clip removed), w_mean (the weight actually
        applied: 1 for the non-IS variants), adv_mean.
    """
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    valid, logp, adv, scale, prepared_gen = _prepare(
        logp, advantages, mask, group_ids, seq_weights, sequence_scale, logp_gen=logp_gen
    )
    assert prepared_gen is not None
    logp_gen = prepared_gen
    vf = valid.to(logp.dtype)
    n_tok = vf.sum(-1)

    # delta_t = logp.detach() - logp_gen ; kl_i = sum_t(-delta_t) (or its token mean)
    delta = logp.detach() - logp_gen
    w_is = torch.exp(delta).clamp(max=cfg.is_cap)
    if with_metrics:
        stats, kl = _offpolicy_core(delta, w_is, valid, n_tok, cfg)
    else:
        kl = _sequence_kl(delta, n_tok, cfg)

    # The filter: drop whole negative-advantage sequences the local policy finds too
    # far from the generator; positive advantages are never filtered.
    if cfg.filtered:
        filtered = (adv < 0) & (kl > cfg.kl_threshold)
        adv = torch.where(filtered, torch.zeros_like(adv), adv)
    else:
        filtered = torch.zeros_like(adv, dtype=torch.bool)

    # w_t = min(exp(delta_t), C), no grad (delta is detached).
    w = w_is if cfg.truncated_is else torch.ones_like(delta)

    # R_t: value 1 with the gradient of log pi, or the ratio to the generator (vis).
    ratio = torch.exp(logp - logp_gen) if cfg.ratio_to_generator else torch.exp(logp - logp.detach())

    s = _ppo_term(ratio, adv, cfg.clip_eps)
    per_seq = _masked_seq_mean(w * s * vf, n_tok)
    loss = -(scale * per_seq).sum()
    if not with_metrics:
        return loss, {}

    n_all = n_tok.sum().clamp(min=1)
    with torch.no_grad():
        stats["frac_filtered"] = filtered.to(logp.dtype).mean()
        stats["clip_frac"] = _clip_active(ratio.detach(), adv, cfg.clip_eps, valid).sum().to(logp.dtype) / n_all
        stats["w_mean"] = (w * vf).sum() / n_all
        stats["adv_mean"] = adv.mean()
        stats["loss"] = loss.detach()
        names = list(stats)
        values = torch.stack([stats[k] for k in names]).tolist()  # one host sync
    return loss, dict(zip(names, values))


def grpo_loss(
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps: float = 0.2,
    group_ids: Tensor | None = None,
    sequence_scale: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Plain on-policy GRPO (beta = 0), with exactly the normalisation of `ftis_loss`.

    R_t = exp(logp - logp.detach()); loss = - mean_groups mean_i mean_t min(R A, clip(R) A).
    The baseline for the loss-overhead benchmark and the on-policy limit of every variant.
    """
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    valid, logp, adv, scale, _ = _prepare(logp, advantages, mask, group_ids, None, sequence_scale)
    vf = valid.to(logp.dtype)
    n_tok = vf.sum(-1)
    ratio = torch.exp(logp - logp.detach())
    per_seq = _masked_seq_mean(_ppo_term(ratio, adv, eps) * vf, n_tok)
    loss = -(scale * per_seq).sum()
    values = torch.stack([loss.detach(), n_tok.sum()]).tolist()
    return loss, {"loss": values[0], "n_seqs": float(logp.shape[0]), "n_tokens": values[1]}
