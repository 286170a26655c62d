"""The trainer and its checkpoints, on real samples from the HF engine and a real optimizer."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from node.rollout import Sampling, make_engine
from node.train.checkpoint import CheckpointError, CheckpointWriter, load_checkpoint, load_latest
from node.train.ftis import LossConfig, group_advantages
from node.train.logprobs import sequence_logprobs
from node.train.trainer import TrainBatch, Trainer, TrainerConfig, TrainSequence

PROMPTS = ["1 + 2 =", "33 + 44 = 77 and 5 + 6 =", "7", "12 + 9 ="]


def _reward(tokens: list[int]) -> float:
    """A fixed, learnable preference: the share of even token ids."""
    return float(np.mean([t % 2 == 0 for t in tokens]))


def make_batch(
    model_dir: Path, *, seed: int = 0, samplings: list[Sampling] | None = None, n: int = 4, source: str = "self"
) -> TrainBatch:
    """Real completions of the base model, scored, with group advantages."""
    engine = make_engine("hf", model_dir)
    samplings = samplings or [Sampling(max_tokens=10, seed=seed)]
    seqs: list[TrainSequence] = []
    group = 0
    for sampling in samplings:
        for samples in engine.generate(PROMPTS, n=n, sampling=sampling):
            rewards = torch.tensor([_reward(s.token_ids) for s in samples])
            adv = group_advantages(rewards, torch.zeros(len(samples), dtype=torch.long))
            for s, a in zip(samples, adv.tolist()):
                seqs.append(
                    TrainSequence(
                        prompt_ids=s.prompt_token_ids,
                        completion_ids=s.token_ids,
                        logp_gen=s.logprobs,
                        advantage=a,
                        group_id=group,
                        temperature=sampling.temperature,
                        top_k=sampling.top_k,
                        top_p=sampling.top_p,
                        source=source,
                    )
                )
            group += 1
    engine.close()
    return TrainBatch(sequences=seqs)


def _policy_logp(trainer: Trainer, batch: TrainBatch) -> torch.Tensor:
    """Mean per-token log-prob of each sequence under the trainer's current weights."""
    trainer.model.eval()
    with torch.no_grad():
        logp, mask = sequence_logprobs(
            trainer.model,
            [s.prompt_ids for s in batch.sequences],
            [s.completion_ids for s in batch.sequences],
            pad_id=trainer.pad_id,
        )
    trainer.model.train()
    return logp.sum(-1) / mask.sum(-1)


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path) -> TrainBatch:
    return make_batch(tiny_model_dir)


def test_own_samples_are_on_policy(tiny_model_dir: Path) -> None:
    """Before any step, the trainer's recompute equals the engine's recorded log-probs,
    under each sequence's own temperature / top-k / top-p: w = 1 everywhere."""
    batch = make_batch(
        tiny_model_dir,
        samplings=[
            Sampling(max_tokens=10, seed=1),
            Sampling(temperature=0.7, top_k=40, top_p=0.9, max_tokens=10, seed=2),
        ],
        n=2,
    )
    trainer = Trainer(tiny_model_dir, TrainerConfig(micro_batch_tokens=64))
    metrics = trainer.step(batch)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["mean_abs_delta"] < 1e-5
    assert metrics["frac_capped"] == 0.0 and abs(metrics["is_weight_mean"] - 1.0) < 1e-5
    assert metrics["by_source"]["self"]["n_seqs"] == len(batch.sequences)
    assert metrics["micro_batches"] >= 2  # two sampling transforms never share a pass


def test_per_source_stats_and_the_filter(tiny_model_dir: Path, batch: TrainBatch) -> None:
    """A "peer" whose recorded log-probs say p = 1 everywhere is far from the local policy:
    its negative-advantage sequences are filtered, positive ones kept, own ones untouched."""
    peer = [
        s.model_copy(
            update={
                "logp_gen": np.zeros(len(s.completion_ids), np.float32),
                "source": "peer",
                "group_id": s.group_id + 1000,
            }
        )
        for s in batch.sequences
    ]
    mixed = TrainBatch(sequences=[*batch.sequences, *peer])
    trainer = Trainer(tiny_model_dir, TrainerConfig(loss=LossConfig(kl_reduction="mean")))
    metrics = trainer.step(mixed)
    own, far = metrics["by_source"]["self"], metrics["by_source"]["peer"]
    negative = np.mean([s.advantage < 0 for s in peer])
    assert 0 < negative < 1
    assert own["frac_filtered"] == 0.0 and own["mean_abs_delta"] < 1e-5
    assert far["frac_filtered"] == pytest.approx(negative)
    assert far["kl_mean"] > 1.0 and far["is_weight_mean"] < 0.1
    assert metrics["frac_filtered"] == pytest.approx(negative / 2)


def test_step_reduces_loss(tiny_model_dir: Path, batch: TrainBatch) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=3e-3, seed=0))
    positive = torch.tensor([s.advantage > 0 for s in batch.sequences])
    negative = torch.tensor([s.advantage < 0 for s in batch.sequences])
    before = _policy_logp(trainer, batch)
    losses = [trainer.step(batch)["loss"] for _ in range(6)]
    after = _policy_logp(trainer, batch)
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(b <= a + 1e-6 for a, b in zip(losses, losses[1:])), losses
    # The policy moved toward the preferred completions and away from the others.
    assert (after - before)[positive].mean() > 0 > (after - before)[negative].mean()


def test_micro_batches_accumulate_to_the_full_batch(tiny_model_dir: Path) -> None:
    batch = make_batch(
        tiny_model_dir,
        samplings=[Sampling(max_tokens=10, seed=3), Sampling(temperature=0.7, top_p=0.9, max_tokens=6, seed=4)],
        n=3,
    )
    one = Trainer(tiny_model_dir, TrainerConfig(micro_batch_tokens=100_000, max_grad_norm=None, seed=5))
    many = Trainer(tiny_model_dir, TrainerConfig(micro_batch_tokens=40, max_grad_norm=None, seed=5))
    m_one, m_many = one.step(batch), many.step(batch)
    assert m_one["micro_batches"] == 2 and m_many["micro_batches"] >= 6
    assert m_one["loss"] == pytest.approx(m_many["loss"], abs=1e-7)
    assert m_one["grad_norm"] == pytest.approx(m_many["grad_norm"], rel=1e-5)
    for p, q in zip(one.params, many.params):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_micro_batch_plan_respects_budget(tiny_model_dir: Path, batch: TrainBatch) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig(micro_batch_tokens=50))
    plan = trainer.plan_micro_batches(batch.sequences)
    assert sorted(i for mb in plan for i in mb) == list(range(len(batch.sequences)))
    for mb in plan:
        width = max(len(batch.sequences[i].prompt_ids) for i in mb) + max(
            len(batch.sequences[i].completion_ids) for i in mb
        )
        assert len(mb) == 1 or len(mb) * width <= 50


def test_saved_adapter_matches_the_trainer(tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path) -> None:
    from peft import PeftModel

    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=3e-3))
    v0 = trainer.adapter_version
    trainer.step(batch)
    v1 = trainer.adapter_version
    assert v1 != v0 and trainer.adapter_version == v1  # content hash: changes with the weights only
    path = trainer.save_adapter(tmp_path / "adapter")
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), path).eval()
    prompts = [s.prompt_ids for s in batch.sequences]
    completions = [s.completion_ids for s in batch.sequences]
    trainer.model.eval()
    with torch.no_grad():
        mine, _ = sequence_logprobs(trainer.model, prompts, completions, temperature=0.7, pad_id=trainer.pad_id)
        theirs, _ = sequence_logprobs(reference, prompts, completions, temperature=0.7, pad_id=trainer.pad_id)
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)

    # The rollout engine, switched to this adapter, samples from the trained policy.
    engine = make_engine("hf", tiny_model_dir)
    engine.load_adapter(path, v1)
    samples = [s for g in engine.generate(PROMPTS, n=2, sampling=Sampling(max_tokens=8, seed=0)) for s in g]
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            trainer.model, [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], pad_id=trainer.pad_id
        )
    for i, s in enumerate(samples):
        np.testing.assert_allclose(logp[i, : len(s.token_ids)].numpy(), s.logprobs, atol=1e-4)


def test_full_mode(tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig(mode="full", lr=1e-3))
    assert trainer.cfg.learning_rate == 1e-3
    assert TrainerConfig(mode="full").learning_rate == 1e-6
    n_params = sum(p.numel() for p in trainer.model.parameters())
    assert sum(p.numel() for p in trainer.params) == n_params  # every weight trains
    before = [p.detach().clone() for p in trainer.params]
    losses = [trainer.step(batch)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    path = trainer.save_adapter(tmp_path / "full")
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    engine = make_engine("hf", path)  # a self-contained model folder
    samples = [s for g in engine.generate(PROMPTS, n=2, sampling=Sampling(max_tokens=8, seed=0)) for s in g]
    trainer.model.eval()
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            trainer.model, [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], pad_id=trainer.pad_id
        )
    for i, s in enumerate(samples):
        np.testing.assert_allclose(logp[i, : len(s.token_ids)].numpy(), s.logprobs, atol=1e-4)


def test_bad_sequences_are_rejected(tiny_model_dir: Path) -> None:
    good = dict(prompt_ids=[1, 2], completion_ids=[3, 4], logp_gen=[-1.0, -2.0], advantage=0.5, group_id=0)
    TrainSequence(**good)
    with pytest.raises(ValueError, match="2 completion tokens but 1 log-probs"):
        TrainSequence(**{**good, "logp_gen": [-1.0]})
    with pytest.raises(ValueError, match="positive values"):
        TrainSequence(**{**good, "logp_gen": [-1.0, 0.5]})
    with pytest.raises(ValueError, match="non-finite"):
        TrainSequence(**{**good, "logp_gen": [-1.0, float("nan")]})
    with pytest.raises(ValueError):
        TrainSequence(**{**good, "completion_ids": [], "logp_gen": []})
    with pytest.raises(ValueError):
        TrainBatch(sequences=[])
    trainer = Trainer(tiny_model_dir, TrainerConfig())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        trainer.step(TrainBatch(sequences=[TrainSequence(**{**good, "completion_ids": [3, 100_000]})]))
    with pytest.raises(ValueError, match="the model has 512 positions"):
        trainer.step(TrainBatch(sequences=[TrainSequence(**{**good, "prompt_ids": [1] * 511})]))


# --------------------------------------------------------------------------- checkpoints


def test_crash_mid_save_keeps_the_previous_checkpoint(tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=3e-3))
    trainer.step(batch)
    first = trainer.save_checkpoint(tmp_path, round=1)
    trainer.step(batch)

    def crash(stage: str) -> None:
        if stage == "weights":
            raise KeyboardInterrupt("power cut")

    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(tmp_path, round=2, on_stage=crash)
    latest = load_latest(tmp_path)
    assert latest is not None and latest.round == 1 and latest.path == first.path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "round-00000001"]

    # A checkpoint that did land but is corrupt on disk is skipped for the previous one.
    second = trainer.save_checkpoint(tmp_path, round=2)
    assert load_latest(tmp_path).round == 2
    weights = next(second.weights_dir.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="bytes, expected"):
        load_checkpoint(second.path)
    assert load_latest(tmp_path).round == 1
    # ... and so is one whose meta.json never got written (a crash before the rename is
    # cleaned up, but a folder copied by hand may still lack it).
    (second.path / "meta.json").unlink()
    assert load_latest(tmp_path).round == 1


def test_keep_last_k(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig())
    for r in range(1, 6):
        trainer.save_checkpoint(tmp_path, round=r, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "round-00000004", "round-00000005"]
    assert (tmp_path / "latest").read_text().strip() == "round-00000005"
    assert load_latest(tmp_path / "nowhere") is None


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_resume_continues_exactly(tiny_model_dir: Path, tmp_path: Path, mode: str) -> None:
    """Save after step 1; a fresh trainer resumed from it takes the same steps 2 and 3."""
    batches = [make_batch(tiny_model_dir, seed=s, n=3) for s in range(3)]
    cfg = TrainerConfig(mode=mode, lr=3e-3 if mode == "lora" else 1e-4, lora_dropout=0.2, seed=1)
    a = Trainer(tiny_model_dir, cfg)
    a.step(batches[0])
    ckpt = a.save_checkpoint(tmp_path, round=7, extra={"peers": 3})
    uninterrupted = [a.step(b)["loss"] for b in batches[1:]]

    torch.manual_seed(12345)  # whatever ran before the restart must not matter
    b = Trainer(tiny_model_dir, cfg.model_copy(update={"seed": 2}))  # a different LoRA init, then overwritten
    latest = load_latest(tmp_path)
    assert latest is not None and latest.round == 7 and latest.meta.extra == {"peers": 3}
    b.resume(latest)
    assert b.steps == 1 and b.adapter_version == ckpt.meta.adapter_version
    resumed = [b.step(x)["loss"] for x in batches[1:]]
    assert resumed == pytest.approx(uninterrupted, abs=1e-6)
    for p, q in zip(a.params, b.params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    if mode == "full":
        return  # no dropout in the full model, so the RNG does not enter the step
    # Without the RNG restore, LoRA dropout masks differ and so does the loss.
    c = Trainer(tiny_model_dir, cfg)
    c.resume(latest)
    torch.manual_seed(4)
    assert c.step(batches[1])["loss"] != pytest.approx(uninterrupted[0], abs=1e-6)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_background_checkpoint_holds_the_state_of_its_snapshot(
    tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path, mode: str
) -> None:
    """Steps taken while a checkpoint is written do not leak into it; a failed write is raised by wait()."""
    cfg = TrainerConfig(mode=mode, lr=3e-3 if mode == "lora" else 1e-4, seed=1)
    a = Trainer(tiny_model_dir, cfg)
    a.step(batch)
    version, params = a.adapter_version, [p.detach().clone() for p in a.params]
    job = a.checkpoint_job(tmp_path, round=1)  # the snapshot is taken here
    a.step(batch)  # ... and training goes on before the write starts
    a.step(batch)
    writer = CheckpointWriter()
    writer.submit(job)
    ckpt = writer.wait()
    assert ckpt is not None and ckpt.meta.step == 1 and ckpt.meta.adapter_version == version
    assert a.steps == 3 and a.adapter_version != version

    b = Trainer(tiny_model_dir, cfg.model_copy(update={"seed": 2}))
    b.resume(load_latest(tmp_path))  # resume checks the weights hash to the recorded version
    assert b.steps == 1 and b.adapter_version == version
    for p, q in zip(params, b.params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    again = [b.step(batch)["loss"] for _ in range(2)]  # the optimizer state was snapshotted too
    c = Trainer(tiny_model_dir, cfg)
    c.step(batch)
    assert again == pytest.approx([c.step(batch)["loss"] for _ in range(2)], abs=1e-6)

    (tmp_path / "blocked").write_text("a file where the checkpoint folder should be")
    writer.submit(a.checkpoint_job(tmp_path / "blocked", round=2))
    with pytest.raises(OSError):
        writer.wait()
    assert writer.wait() is ckpt  # raised once; the newest good checkpoint is still known


def test_resume_rejects_a_mismatched_trainer(tiny_model_dir: Path, tmp_path: Path, caplog) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig())
    ckpt = trainer.save_checkpoint(tmp_path, round=0)
    with pytest.raises(ValueError, match="lora checkpoint, this trainer trains full"):
        Trainer(tiny_model_dir, TrainerConfig(mode="full")).resume(ckpt)
    with pytest.raises(ValueError, match="adapter has"):
        Trainer(tiny_model_dir, TrainerConfig(lora_rank=4)).resume(ckpt)
    (tmp_path / "latest").write_text("../elsewhere\n")
    with caplog.at_level(logging.WARNING):
        assert load_latest(tmp_path).round == 0  # a bad pointer falls back to the folders
    assert "not a checkpoint folder" in caplog.text
