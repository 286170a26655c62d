"""Tests of the F-TIS loss against hand-computed values and hand-derived gradients."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from node.train.ftis import (
    VARIANTS,
    LossConfig,
    default_kl_threshold,
    ftis_loss,
    group_advantages,
    group_mean_scale,
    grpo_loss,
    kl_bin_edges,
    offpolicy_stats,
)

F64 = torch.float64


def random_batch(seed: int, b: int = 6, t: int = 9, spread: float = 1.0):
    """A padded batch: logp (leaf, grad), logp_gen, advantages, bool mask (lengths >= 1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    logp = -0.1 - 6.0 * torch.rand(b, t, generator=g, dtype=F64)
    # the generator is a little more confident on its own samples: kl_i tends to be > 0
    noise = spread * (torch.randn(b, t, generator=g, dtype=F64) + 0.3)
    logp_gen = (logp + noise).clamp(max=0.0)
    adv = torch.randn(b, generator=g, dtype=F64)
    return logp.requires_grad_(True), logp_gen, adv, mask


def loss_and_grad(logp: torch.Tensor, *args, **kwargs):
    leaf = logp.detach().clone().requires_grad_(True)
    loss, metrics = ftis_loss(leaf, *args, **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad.detach(), metrics


# ------------------------------------------------------------------ advantages


def test_group_advantages_hand_computed_population_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 0.0, 3.0], dtype=F64)
    ids = torch.tensor([7, 7, 7, 7, 3, 3, 3, -1, -1])
    a = group_advantages(rewards, ids)
    # group 7: mean 0.5, population std 0.5; group 3: no variance; group -1: mean 1.5, std 1.5
    s7 = 0.5 / (0.5 + 1e-6)
    s1 = 1.5 / (1.5 + 1e-6)
    expected = torch.tensor([s7, -s7, -s7, s7, 0.0, 0.0, 0.0, -s1, s1], dtype=F64)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-12)
    # population, not sample, std: the sample std of group 7 would give 0.866
    assert abs(float(a[0]) - 0.5 / (rewards[:4].std(unbiased=True).item() + 1e-6)) > 0.1


def test_group_advantages_interleaved_and_zero_variance():
    rewards = torch.tensor([0.0, 0.1, 1.0, 0.1, 0.1, 5.0], dtype=F64)
    ids = torch.tensor([1, 2, 1, 2, 2, 9])
    a = group_advantages(rewards, ids)
    s = 0.5 / (0.5 + 1e-6)
    assert a.tolist()[0] == pytest.approx(-s) and a.tolist()[2] == pytest.approx(s)
    # 0.1 three times leaves a rounding residue in r - mean; the advantage must be exactly 0
    assert a[1].item() == 0.0 and a[3].item() == 0.0 and a[4].item() == 0.0
    assert a[5].item() == 0.0  # a group of one
    # integer rewards are accepted and give the same result as floats
    ai = group_advantages(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
    assert ai.tolist() == pytest.approx([-s, s, 0.0, 0.0])


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([0.0, math.nan]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[N\]"):
        group_advantages(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long))


def test_group_mean_scale():
    ids = torch.tensor([4, 4, 4, 8, 8, 1])
    scale = group_mean_scale(ids)
    assert scale.tolist() == pytest.approx([1 / 9, 1 / 9, 1 / 9, 1 / 6, 1 / 6, 1 / 3])
    assert scale.sum().item() == pytest.approx(1.0)
    assert group_mean_scale(None, 4).tolist() == [0.25] * 4
    with pytest.raises(ValueError):
        group_mean_scale(None)


# ------------------------------------------------------------------ the gradient


def test_ftis_gradient_is_stopgrad_w_times_a_times_grad_logpi():
    logp, logp_gen, adv, mask = random_batch(0, b=6, t=9)
    mask[0, :7] = True
    logp_gen = logp_gen.clone()
    # row 0: negative advantage, far from the generator: filtered (kl = 10 per token)
    adv[0] = -1.3
    logp_gen[0] = logp[0].detach() + 10.0
    # row 1: positive advantage equally far: kept
    adv[1] = 0.7
    logp_gen[1] = logp[1].detach() + 10.0
    # row 2: tokens far more likely under the local policy: weights capped at C
    logp_gen[2] = logp[2].detach() - 2.0
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    cfg = LossConfig(variant="f-tis")
    loss, grad, m = loss_and_grad(logp, logp_gen, adv, mask, cfg, group_ids=ids)

    vf = mask.to(F64)
    delta = (logp.detach() - logp_gen) * vf
    kl = -delta.sum(-1)
    a = torch.where((adv < 0) & (kl > 50.0), 0.0, adv)
    assert a[0] == 0 and a[1] == adv[1]
    w = torch.exp(delta).clamp(max=2.0)
    n = vf.sum(-1)
    scale = torch.tensor([1 / 6, 1 / 6, 1 / 9, 1 / 9, 1 / 9, 1 / 3], dtype=F64)
    expected_grad = -(scale / n)[:, None] * w * a[:, None] * vf
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
    expected_loss = -(scale * (w * a[:, None] * vf).sum(-1) / n).sum()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-15)
    assert torch.all(grad[0] == 0) and torch.all(grad[1][mask[1]] != 0)
    assert m["frac_filtered"] == pytest.approx(1 / 6)
    assert m["loss"] == pytest.approx(loss.item())
    assert m["clip_frac"] == 0.0  # R = 1: the clip never acts in tis


def test_on_policy_every_variant_equals_grpo():
    logp, _, adv, mask = random_batch(1, b=5, t=7)
    logp_gen = logp.detach().clone()
    ids = torch.tensor([3, 3, 5, 5, 5])
    ref_leaf = logp.detach().clone().requires_grad_(True)
    ref_loss, ref_m = grpo_loss(ref_leaf, adv, mask, eps=0.2, group_ids=ids)
    ref_loss.backward()
    # by hand: R = 1 and w = 1, so the loss is - mean_groups mean_i A_i
    hand = -(adv[:2].mean() + adv[2:].mean()) / 2
    torch.testing.assert_close(ref_loss.detach(), hand, rtol=1e-12, atol=1e-15)
    assert ref_m["n_tokens"] == mask.sum().item()
    for variant in VARIANTS:
        loss, grad, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant=variant), group_ids=ids)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-15, msg=variant)
        torch.testing.assert_close(grad, ref_leaf.grad, rtol=1e-12, atol=1e-15, msg=variant)
        assert m["mean_abs_delta"] == 0.0 and m["frac_filtered"] == 0.0 and m["ess"] == pytest.approx(1.0)


def test_tis_gradient_is_w_times_nois_gradient():
    logp, logp_gen, adv, mask = random_batch(2, spread=0.8)
    _, g_nois, _ = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="nois"))
    _, g_tis, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="tis"))
    w = torch.exp(logp.detach() - logp_gen).clamp(max=2.0)
    torch.testing.assert_close(g_tis[mask], (w * g_nois)[mask], rtol=1e-12, atol=1e-15)
    assert 0 < m["frac_capped"] < 1  # the data does exercise the cap
    assert m["w_mean"] == pytest.approx(w[mask].mean().item())


def test_positive_advantages_never_filtered():
    logp, _, _, mask = random_batch(3, b=4, t=5)
    mask[:] = True
    logp_gen = logp.detach() + 20.0  # kl_i = 100 for every row
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=F64)
    for variant in ("f-tis", "f-nois", "f-vis"):
        for g in (50.0, 0.0):
            cfg = LossConfig(variant=variant, kl_threshold=g)
            _, grad, m = loss_and_grad(logp, logp_gen, adv, mask, cfg)
            assert torch.all(grad[[0, 2]] != 0), variant
            assert torch.all(grad[[1, 3]] == 0), variant
            assert m["frac_filtered"] == 0.5
    # without the filter the negative rows do get a gradient
    _, grad, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="tis"))
    assert torch.all(grad[[1, 3]] != 0) and m["frac_filtered"] == 0.0


def test_filtered_samples_still_count_in_group_mean_and_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0], dtype=F64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, ids)
    t = 4
    mask = torch.ones(6, t, dtype=torch.bool)
    logp = torch.full((6, t), -1.0, dtype=F64)
    logp_gen = logp.clone()
    logp_gen[3] = logp[3] + 15.0  # row 3 (reward 0, A < 0) is filtered: kl = 60
    _, grad, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="f-tis"), group_ids=ids)
    assert m["frac_filtered"] == pytest.approx(1 / 6)
    # the kept rows keep the advantages of the FULL group of 4 and the group size 4
    a_full = torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], dtype=F64) * (
        math.sqrt(3 / 16) / (math.sqrt(3 / 16) + 1e-6)
    )
    expected = -(1 / (2 * 4)) * a_full[:, None] / t * torch.ones(3, t, dtype=F64)
    torch.testing.assert_close(grad[:3], expected, rtol=1e-12, atol=1e-15)
    assert torch.all(grad[3] == 0)
    # dropping the row before normalising would have given other advantages
    a_without = group_advantages(rewards[:3], ids[:3])
    assert not torch.allclose(a_without, adv[:3])


def test_weights_capped_at_c():
    logp = torch.tensor([[-0.1, -1.0, -2.0]], dtype=F64)
    logp_gen = logp - torch.tensor([[3.0, 0.5, -1.0]], dtype=F64)  # delta = 3, 0.5, -1
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=F64)
    _, grad, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="tis"))
    torch.testing.assert_close(grad, -torch.tensor([[2.0, math.exp(0.5), math.exp(-1.0)]], dtype=F64) / 3)
    assert m["frac_capped"] == pytest.approx(1 / 3)
    _, grad, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="tis", is_cap=1.5))
    torch.testing.assert_close(grad, -torch.tensor([[1.5, 1.5, math.exp(-1.0)]], dtype=F64) / 3)
    assert m["frac_capped"] == pytest.approx(2 / 3)
    assert m["w_mean"] == pytest.approx((3.0 + math.exp(-1.0)) / 3)


# ------------------------------------------------------------------ masking and reductions


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_changes_neither_loss_nor_grad(variant: str):
    logp, logp_gen, adv, mask = random_batch(4, b=5, t=8, spread=0.5)
    mask[0, 3:] = False  # at least one padded row
    cfg = LossConfig(variant=variant)
    ids = torch.tensor([0, 0, 1, 1, 1])
    base_loss, base_grad, base_m = loss_and_grad(logp, logp_gen, adv, mask, cfg, group_ids=ids)
    pad = ~mask
    assert pad.any()
    for fill in (123.0, -math.inf, math.nan, -1e4):
        lp = logp.detach().clone()
        lg = logp_gen.clone()
        lp[pad] = fill
        lg[pad] = -fill if math.isfinite(fill) else fill
        loss, grad, m = loss_and_grad(lp, lg, adv, mask.to(torch.int64), cfg, group_ids=ids)
        assert loss.item() == base_loss.item(), fill
        assert torch.equal(grad, base_grad), fill
        assert torch.all(grad[pad] == 0)
        assert m == base_m


def test_empty_row_contributes_nothing_but_counts_in_group():
    logp, logp_gen, adv, mask = random_batch(5, b=3, t=4)
    mask[2] = False
    ids = torch.tensor([0, 0, 0])
    loss, grad, _ = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="nois"), group_ids=ids)
    n = mask.sum(-1).to(F64)
    expected = -(adv[0] + adv[1]) / 3  # mean over 3 rows, the empty one adds 0
    torch.testing.assert_close(loss, expected)
    assert torch.isfinite(grad).all() and torch.all(grad[2] == 0)
    assert n[2] == 0


def test_kl_reduction_sum_vs_mean():
    t = 200
    mask = torch.zeros(2, t, dtype=torch.bool)
    mask[0, :] = True  # 200 tokens at delta = -0.3: kl sum 60 > 50, mean 0.3 < 0.5
    mask[1, :10] = True  # 10 tokens at delta = -0.6: kl sum 6 < 50, mean 0.6 > 0.5
    logp = torch.full((2, t), -1.0, dtype=F64)
    logp_gen = logp.clone()
    logp_gen[0] += 0.3
    logp_gen[1] += 0.6
    adv = torch.tensor([-1.0, -1.0], dtype=F64)

    sum_cfg = LossConfig(variant="f-tis", kl_reduction="sum")
    mean_cfg = LossConfig(variant="f-tis", kl_reduction="mean")
    assert sum_cfg.kl_threshold == 50.0 and mean_cfg.kl_threshold == 0.5
    _, g_sum, m_sum = loss_and_grad(logp, logp_gen, adv, mask, sum_cfg)
    _, g_mean, m_mean = loss_and_grad(logp, logp_gen, adv, mask, mean_cfg)
    assert torch.all(g_sum[0] == 0) and torch.all(g_sum[1, :10] != 0)
    assert torch.all(g_mean[1] == 0) and torch.all(g_mean[0] != 0)
    assert m_sum["kl_max"] == pytest.approx(60.0) and m_mean["kl_max"] == pytest.approx(0.6)
    assert m_sum["frac_filtered"] == m_mean["frac_filtered"] == 0.5


def test_vis_uses_ratio_to_generator_and_clips():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=F64)
    r = torch.tensor([[1.5, 0.9], [1.5, 0.5]], dtype=F64)  # pi / pi_gen per token
    logp_gen = logp - torch.log(r)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, grad, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="vis"))
    # row 0 (A > 0): 1.5 clipped to 1.2 (no grad), 0.9 kept (grad A R)
    # row 1 (A < 0): 1.5 kept (min picks -1.5), 0.5 clipped to 0.8 (no grad)
    assert loss.item() == pytest.approx(-0.5 * ((1.2 + 0.9) / 2 + (-1.5 - 0.8) / 2))
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.225], [0.375, 0.0]], dtype=F64))
    assert m["clip_frac"] == pytest.approx(0.5)
    # nois on the same tokens sees R = 1: no clipping, gradient -A / (2 * 2) per token
    loss, grad, m = loss_and_grad(logp, logp_gen, adv, mask, LossConfig(variant="nois"))
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]], dtype=F64))
    assert loss.item() == pytest.approx(0.0) and m["clip_frac"] == 0.0


# ------------------------------------------------------------------ normalisation and micro-batches


@pytest.mark.parametrize("variant", ["f-tis", "f-vis", "nois"])
def test_microbatch_accumulation_equals_full_batch(variant: str):
    b, t = 10, 12
    logp, logp_gen, adv, mask = random_batch(6, b=b, t=t, spread=2.0)
    ids = torch.tensor([0, 1, 0, 2, 0, 1, 0, 2, 1, 0])  # groups of 5, 3, 2
    weights = torch.linspace(0.2, 1.0, b, dtype=F64)
    cfg = LossConfig(variant=variant, kl_threshold=3.0)
    full_loss, full_grad, full_m = loss_and_grad(logp, logp_gen, adv, mask, cfg, group_ids=ids, seq_weights=weights)
    assert full_m["frac_filtered"] > 0 or variant == "nois"

    scale = group_mean_scale(ids)
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(0))
    leaf = logp.detach().clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    naive = torch.zeros((), dtype=F64)
    for idx in perm.split([4, 4, 2]):
        tm = int(mask[idx].sum(-1).max())  # each micro-batch is padded to its own length
        part = dict(logp_gen=logp_gen[idx, :tm], advantages=adv[idx], mask=mask[idx, :tm], cfg=cfg)
        loss, _ = ftis_loss(leaf[idx, :tm], **part, seq_weights=weights[idx], sequence_scale=scale[idx])
        loss.backward()
        total += loss.detach()
        naive += ftis_loss(leaf[idx, :tm], **part, seq_weights=weights[idx], group_ids=ids[idx])[0].detach()
    torch.testing.assert_close(total, full_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(leaf.grad, full_grad, rtol=1e-12, atol=1e-15)
    # normalising inside each micro-batch instead would be wrong, which is what the scale is for
    assert abs(naive.item() - full_loss.item()) > 1e-3


def test_no_group_ids_means_one_mean_over_rows():
    logp, logp_gen, adv, mask = random_batch(7, b=4)
    cfg = LossConfig()
    a, ga, _ = loss_and_grad(logp, logp_gen, adv, mask, cfg)
    b, gb, _ = loss_and_grad(logp, logp_gen, adv, mask, cfg, sequence_scale=torch.full((4,), 0.25))
    c, gc, _ = loss_and_grad(logp, logp_gen, adv, mask, cfg, group_ids=torch.tensor([9, 9, 9, 9]))
    assert a.item() == pytest.approx(b.item()) == pytest.approx(c.item())
    torch.testing.assert_close(ga, gb)
    torch.testing.assert_close(ga, gc)


def test_seq_weights_scale_contributions_without_renormalising():
    logp, logp_gen, adv, mask = random_batch(8, b=4)
    cfg = LossConfig(variant="f-tis")
    _, g1, _ = loss_and_grad(logp, logp_gen, adv, mask, cfg)
    weights = torch.tensor([1.0, 0.5, 0.0, 1.0], dtype=F64)
    _, gw, _ = loss_and_grad(logp, logp_gen, adv, mask, cfg, seq_weights=weights)
    torch.testing.assert_close(gw, g1 * weights[:, None])
    assert torch.all(gw[2] == 0) and torch.equal(gw[0], g1[0])


# ------------------------------------------------------------------ robustness


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_finite(variant: str, dtype: torch.dtype):
    logp, logp_gen, adv, mask = random_batch(9, b=8, t=16, spread=3.0)
    leaf = logp.detach().to(dtype).requires_grad_(True)
    loss, m = ftis_loss(leaf, logp_gen.to(torch.float16), adv.float(), mask, LossConfig(variant=variant))
    loss.backward()
    assert loss.dtype == torch.float32  # computed in fp32 at least
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad.float()).all()
    assert leaf.grad.dtype == dtype
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
    assert m["n_seqs"] == 8 and m["n_tokens"] == mask.sum().item()


def test_bad_config_gives_clear_error():
    with pytest.raises(ValidationError, match="unknown loss variant 'ppo'"):
        LossConfig(variant="ppo")
    with pytest.raises(ValidationError, match="not a loss variant"):
        LossConfig(variant="alone")
    with pytest.raises(ValidationError, match="is_cap"):
        LossConfig(is_cap=0.5)
    with pytest.raises(ValidationError, match="clip_eps"):
        LossConfig(clip_eps=1.5)
    with pytest.raises(ValidationError, match="kl_reduction"):
        LossConfig(kl_reduction="max")
    with pytest.raises(ValidationError, match="Extra inputs"):
        LossConfig(beta=0.1)
    assert LossConfig(variant="F_TIS").variant == "f-tis"
    assert LossConfig(kl_reduction="mean", kl_threshold=2.0).kl_threshold == 2.0
    assert default_kl_threshold("sum") == 50.0 and default_kl_threshold("mean") == 0.5
    with pytest.raises(ValueError, match="unknown kl_reduction"):
        default_kl_threshold("max")
    cfg = LossConfig()
    assert (cfg.variant, cfg.is_cap, cfg.kl_threshold, cfg.clip_eps) == ("f-tis", 2.0, 50.0, 0.2)
    with pytest.raises(ValidationError):
        cfg.is_cap = 3.0  # frozen


def test_bad_inputs_give_clear_errors():
    logp, logp_gen, adv, mask = random_batch(10, b=3, t=4)
    cfg = LossConfig()
    with pytest.raises(ValueError, match="shape of logp"):
        ftis_loss(logp, logp_gen[:, :3], adv, mask, cfg)
    with pytest.raises(ValueError, match=r"advantages must have shape \[3\]"):
        ftis_loss(logp, logp_gen, adv[:2], mask, cfg)
    with pytest.raises(ValueError, match="only 0 and 1"):
        ftis_loss(logp, logp_gen, adv, mask.to(F64) * 0.5, cfg)
    with pytest.raises(ValueError, match="advantages must be finite"):
        ftis_loss(logp, logp_gen, torch.tensor([0.0, math.nan, 1.0], dtype=F64), mask, cfg)
    bad_gen = logp_gen.clone()
    bad_gen[0, 0] = math.inf
    with pytest.raises(ValueError, match="logp_gen must be finite"):
        ftis_loss(logp, bad_gen, adv, mask, cfg)
    with pytest.raises(ValueError, match="not both"):
        ftis_loss(
            logp, logp_gen, adv, mask, cfg, group_ids=torch.zeros(3, dtype=torch.long), sequence_scale=torch.ones(3)
        )
    with pytest.raises(ValueError, match="seq_weights must be finite and >= 0"):
        ftis_loss(logp, logp_gen, adv, mask, cfg, seq_weights=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="empty batch"):
        ftis_loss(logp[:0], logp_gen[:0], adv[:0], mask[:0], cfg)
    with pytest.raises(TypeError, match="LossConfig"):
        ftis_loss(logp, logp_gen, adv, mask, {"variant": "f-tis"})
    with pytest.raises(ValueError, match="sequence_scale must be"):
        ftis_loss(logp, logp_gen, adv, mask, cfg, sequence_scale=torch.tensor([1.0, math.inf, 1.0]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        ftis_loss(logp[0], logp_gen[0], adv, mask[0], cfg)
    with pytest.raises(ValueError, match="eps"):
        grpo_loss(logp, adv, mask, eps=0.0)


# ------------------------------------------------------------------ per-peer stats


def test_offpolicy_stats_hand_computed():
    t = 3
    logp = torch.full((3, t), -1.0, dtype=F64)
    delta = torch.tensor([[0.0, math.log(3.0), -1.0], [-30.0, -30.0, 0.0], [-25.0, -25.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    logp_gen = logp - delta
    logp_gen[~mask] = 7.0  # padding holds garbage on purpose
    s = offpolicy_stats(logp, logp_gen, mask, LossConfig())
    d = delta[mask]
    w = torch.exp(d).clamp(max=2.0)
    assert s["n_seqs"] == 3 and s["n_tokens"] == 7
    assert s["mean_abs_delta"] == pytest.approx(d.abs().mean().item())
    assert s["frac_capped"] == pytest.approx(1 / 7)
    assert s["is_weight_mean"] == pytest.approx(w.mean().item())
    assert s["ess"] == pytest.approx(1 / (w * w).mean().item())
    assert s["ess_kish"] == pytest.approx((w.mean() ** 2 / (w * w).mean()).item())
    kl = [1.0 - math.log(3.0), 60.0, 50.0]
    assert s["kl_max"] == pytest.approx(60.0) and s["kl_mean"] == pytest.approx(sum(kl) / 3)
    assert s["kl_p50"] == pytest.approx(50.0)
    assert s["kl_p10"] == pytest.approx(kl[0] + 0.2 * (50.0 - kl[0]))  # linear interpolation
    assert s["frac_kl_over"] == pytest.approx(1 / 3)  # 50 is not over g = 50
    assert s["kl_bin_edges"] == [0.0, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0]
    # negative kl below the first edge; 50 and 60 in [50, 100)
    assert s["kl_hist"] == [1, 0, 0, 0, 0, 0, 0, 2, 0, 0]
    json.dumps(s, allow_nan=False)  # the API can serve it as is

    mean_cfg = LossConfig(kl_reduction="mean")
    assert kl_bin_edges(mean_cfg)[6] == 0.5
    s_mean = offpolicy_stats(logp, logp_gen, mask, mean_cfg)
    assert s_mean["kl_max"] == pytest.approx(30.0) and sum(s_mean["kl_hist"]) == 3


def test_loss_metrics_agree_with_offpolicy_stats():
    logp, logp_gen, adv, mask = random_batch(11, spread=2.0)
    cfg = LossConfig(variant="f-tis", kl_threshold=5.0)
    _, _, m = loss_and_grad(logp, logp_gen, adv, mask, cfg)
    s = offpolicy_stats(logp, logp_gen, mask, cfg)
    for key in ("mean_abs_delta", "frac_capped", "ess", "kl_mean", "kl_p10", "kl_p50", "kl_p90", "kl_max"):
        assert m[key] == pytest.approx(s[key]), key
    # the filter drops exactly the negative-advantage rows among those over the threshold
    mf = (-(logp.detach() - logp_gen) * mask).sum(-1)
    assert m["frac_filtered"] == pytest.approx(((adv < 0) & (mf > 5.0)).double().mean().item())
    assert m["frac_filtered"] > 0


def test_metrics_can_be_skipped_without_changing_loss_or_gradient():
    torch.manual_seed(3)
    logp = (-torch.rand(4, 6, dtype=torch.float64) * 3).requires_grad_()
    logp_gen = -torch.rand(4, 6, dtype=torch.float64) * 3
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    cfg = LossConfig(variant="f-tis", kl_threshold=0.5)
    full, metrics = ftis_loss(logp, logp_gen, adv, mask, cfg)
    (g_full,) = torch.autograd.grad(full, logp)
    bare, none = ftis_loss(logp, logp_gen, adv, mask, cfg, with_metrics=False)
    (g_bare,) = torch.autograd.grad(bare, logp)
    assert none == {} and metrics["frac_filtered"] > 0
    assert torch.equal(full, bare) and torch.equal(g_full, g_bare)
