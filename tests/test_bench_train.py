"""The training-step benchmark, at tiny settings: it runs every contender on one batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from node.bench.train import (
    _grpo_step,
    _train_batch,
    _TrlStep,
    format_train_bench,
    make_bench_batch,
    run_train_bench,
)
from node.models.registry import ModelLoadError
from node.rollout.hf import HFEngine
from node.train.trainer import Trainer, TrainerConfig

BATCH, GROUP, LENGTH = 4, 2, 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the bench itself uses: more threads than idle cores stalls."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, one_thread):
    eng = HFEngine.from_pretrained(tiny_model_dir)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def fixed(engine):
    return make_bench_batch(engine, BATCH // GROUP, GROUP, LENGTH, seed=0)


def _lora_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_fixed_batch_is_full_length_seeded_and_mixed(engine, fixed):
    assert len(fixed.completion_ids) == BATCH
    assert all(len(c) == LENGTH for c in fixed.completion_ids)  # EOS held back: nominal length
    assert fixed.tokens == BATCH * LENGTH
    for lp, c in zip(fixed.logp_gen, fixed.completion_ids):
        assert lp.dtype == np.float32 and lp.shape == (len(c),)
        assert np.all(np.isfinite(lp)) and np.all(lp <= 0)
    # Each group has both rewards, so every advantage is non-zero.
    for g in range(BATCH // GROUP):
        assert sorted(fixed.rewards[g * GROUP : (g + 1) * GROUP]) == [0.0, 1.0]
    again = make_bench_batch(engine, BATCH // GROUP, GROUP, LENGTH, seed=0)
    assert again.completion_ids == fixed.completion_ids and again.rewards == fixed.rewards
    other = make_bench_batch(engine, BATCH // GROUP, GROUP, LENGTH, seed=1)
    assert other.completion_ids != fixed.completion_ids


def test_plain_grpo_step_trains_the_trainers_lora(tiny_model_dir, fixed):
    trainer = Trainer(tiny_model_dir, TrainerConfig(seed=0))
    before = _lora_snapshot(trainer.model)
    loss = _grpo_step(trainer, _train_batch(fixed))
    assert math.isfinite(loss)
    after = _lora_snapshot(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_trl_trains_on_the_fixed_batch(tiny_model_dir, fixed, tmp_path):
    cfg = TrainerConfig(seed=0)
    trl = _TrlStep(tiny_model_dir, fixed, cfg, str(tmp_path), seed=0)
    assert trl.trainable == sum(p.numel() for p in Trainer(tiny_model_dir, cfg).params)
    before = _lora_snapshot(trl.trainer.model)
    assert math.isfinite(trl.step())
    metrics = trl.trainer._metrics["train"]
    # TRL saw our completions (their length) and our rewards, not generations of its own.
    assert metrics["completions/mean_length"][-1] == LENGTH
    assert metrics["reward"][-1] == pytest.approx(0.5)
    assert trl.score_seconds > 0
    # Every update takes the batch afresh through TRL's scoring path (none is buffered).
    trl.step()
    assert len(metrics["reward"]) == 2
    after = _lora_snapshot(trl.trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_run_train_bench_reports_every_figure(tiny_model_dir):
    torch.set_num_threads(2)
    threads = torch.get_num_threads()
    lines: list[str] = []
    r = run_train_bench(
        str(tiny_model_dir),
        batch=BATCH,
        group_size=GROUP,
        completion_len=LENGTH,
        repeats=2,
        progress=lines.append,
        overhead_rounds=2,
    )
    assert "repeat 2/2" in lines
    assert torch.get_num_threads() == threads  # restored
    torch.set_num_threads(1)
    for key in (
        "ftis_step_s",
        "nois_step_s",
        "grpo_step_s",
        "trl_step_s",
        "trl_score_s",
        "hf_engine_s",
        "hf_engine_tokens_per_s",
        "ftis_tokens_per_s",
        "trl_tokens_per_s",
        "ratio_vs_trl",
    ):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert math.isfinite(r["loss_overhead_vs_grpo"]) and r["loss_overhead_vs_grpo"] > -1
    assert r["loss_overhead_vs_grpo"] == pytest.approx(r["ftis_step_s"] / r["grpo_step_s"] - 1)
    assert r["ratio_vs_trl"] == pytest.approx(r["ftis_step_s"] / r["trl_step_s"])
    assert r["tokens_per_step"] == BATCH * LENGTH
    assert r["torch_threads"] == r["torch_threads_after"] == 1
    assert r["n_params"] > 0 and r["lora_params"] > 0 and r["repeats"] == 2
    assert r["hf_engine_tokens"] == r["hf_engine_requested_tokens"] == BATCH * LENGTH  # fixed length
    for mode in ("lora", "full"):
        o = r["round_overhead"][mode]
        assert o["mode"] == mode and o["rounds"] == 2 and o["checkpoints_in_rounds"] == 1
        assert o["checkpoint_s"] > 0 and o["step_s"] > 0 and o["engine_load_s"] > 0
        assert o["round_overhead_s"] == pytest.approx(o["per_round_overhead_s"] + o["checkpoint_s"] / 10)
        assert r["round_overhead_s"][mode] == o["round_overhead_s"] > 0
        assert r["round_overhead_vs_step"][mode] == pytest.approx(o["round_overhead_s"] / o["step_s"])
        assert len(o["raw_overhead_s"]) == 2
        assert o["cpu"]["step_s"] > 0 and o["cpu"]["overhead_vs_step"] > 0
    for raw in ("raw_s", "raw_cpu_s"):
        for name, values in r[raw].items():
            assert len(values) == 2 and all(v > 0 for v in values), (raw, name)
    assert all(v > 0 for k, v in r["cpu_s"].items() if not k.startswith(("loss", "ratio")))
    lo = r["loss_only"]
    assert lo["ftis_loss_s"] > 0 and lo["grpo_loss_s"] > 0
    text = format_train_bench(r)
    for label in ("F-TIS", "NoIS", "plain GRPO", "TRL GRPOTrainer", "HF engine", "tok/s", "round overhead, full"):
        assert label in text


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"batch": 6, "group_size": 4}, "multiple of group_size"),
        ({"completion_len": 0}, "completion_len"),
        ({"repeats": 0}, "repeats"),
        ({"lora_rank": 0}, "lora_rank"),
        ({"threads": 0}, "threads"),
        ({"overhead_rounds": 1}, "overhead_rounds"),
        ({"overhead_modes": ("qlora",)}, "overhead_modes"),
    ],
)
def test_bad_settings_are_rejected_with_a_reason(tiny_model_dir, kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        run_train_bench(str(tiny_model_dir), **kwargs)


def test_fixed_batch_rejects_bad_sizes(engine):
    with pytest.raises(ValueError, match="must be >= 1"):
        make_bench_batch(engine, 0, GROUP, LENGTH)
    with pytest.raises(ValueError, match="positions"):
        make_bench_batch(engine, 1, GROUP, 10_000)


def test_unknown_model_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model"):
        run_train_bench("no-such-model")
    with pytest.raises(ModelLoadError, match="no config.json"):
        run_train_bench(str(tmp_path))
