"""The memory cuts change no number: chunked log-probs, the step-by-step engine record, the view.

Each cut is compared with the way the same number was computed before it: the one-pass
[B, T, V] logits (`sequence_logprobs(..., chunked=False)`), `generate(output_logits=True)`
and the screen's `score_completions`. The chunk size is made small so that every batch
spans several chunks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import node.train.logprobs as logprobs_module
from node.defence.screen import score_completions
from node.rollout import Sampling, make_engine
from node.train.logprobs import _split, completion_views, sampling_logprobs, sequence_logprobs, sequence_view
from node.train.trainer import Trainer, TrainerConfig
from tests.test_trainer import make_batch

SAMPLINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 5, 1.0), (1.2, 0, 0.9), (0.7, 20, 0.8)]


@pytest.fixture(autouse=True, params=["kept", "rebuilt", "both"])
def small_chunks(monkeypatch: pytest.MonkeyPatch, request) -> None:
    """A few positions per chunk (tiny-s has 512 ids), so a batch always takes several; each
    chunk's softmax kept for the backward pass, rebuilt there, or the first chunks kept."""
    monkeypatch.setattr(logprobs_module, "LOGIT_CHUNK_ELEMENTS", 512 * 7)
    keep = {"kept": 10**9, "rebuilt": 0, "both": 14}[request.param]
    monkeypatch.setattr(logprobs_module, "KEEP_SCORES_POSITIONS", keep)


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path):
    return make_batch(
        tiny_model_dir,
        samplings=[
            Sampling(max_tokens=12, seed=1),
            Sampling(temperature=0.7, top_k=20, top_p=0.8, max_tokens=9, seed=2),
        ],
        n=3,
    )


def _perturbed_trainer(model_dir: Path, **cfg) -> Trainer:
    """A trainer whose LoRA B is not zero, so every LoRA tensor gets a gradient."""
    trainer = Trainer(model_dir, TrainerConfig(max_grad_norm=None, seed=3, **cfg))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return trainer


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chunked_logprobs_equal_the_one_pass_ones(tiny_model_dir: Path, batch, mode: str, sampling) -> None:
    trainer = _perturbed_trainer(tiny_model_dir, mode=mode)
    assert _split(trainer.model) is not None, "tiny-s must take the chunked path"
    seqs = batch.sequences
    args = ([s.prompt_ids for s in seqs], [s.completion_ids for s in seqs], *sampling)
    grads = {}
    for chunked in (True, False):
        trainer.model.zero_grad(set_to_none=True)
        logp, mask = sequence_logprobs(trainer.model, *args, pad_id=trainer.pad_id, chunked=chunked)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        grads[chunked] = (logp.detach(), mask, [p.grad.clone() for p in trainer.params])
    (lp_c, mask_c, g_c), (lp_1, mask_1, g_1) = grads[True], grads[False]
    assert torch.equal(mask_c, mask_1)
    assert (lp_c - lp_1).abs().max() <= 1e-5
    assert bool(torch.isfinite(lp_c).all()) and float(lp_c.max()) <= 0
    for a, b in zip(g_c, g_1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_ftis_step_equals_the_one_pass_step(tiny_model_dir: Path, batch, mode: str) -> None:
    """The trainer's loss, metrics, gradients and updated weights, chunked or not, within 1e-5."""
    chunked = _perturbed_trainer(tiny_model_dir, mode=mode, micro_batch_tokens=80)
    one_pass = _perturbed_trainer(tiny_model_dir, mode=mode, micro_batch_tokens=80, chunked_logprobs=False)
    m_c, m_1 = chunked.step(batch), one_pass.step(batch)
    assert m_c["micro_batches"] >= 3
    for key in ("loss", "mean_abs_delta", "kl_mean"):
        if key in m_1:
            assert m_c[key] == pytest.approx(m_1[key], abs=1e-5), key
    assert m_c["grad_norm"] == pytest.approx(m_1["grad_norm"], rel=1e-4)
    for p, q in zip(chunked.params, one_pass.params):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_gradient_checkpointing_changes_no_gradient(tiny_model_dir: Path, batch, mode: str) -> None:
    plain = _perturbed_trainer(tiny_model_dir, mode=mode)
    ckpt = _perturbed_trainer(tiny_model_dir, mode=mode, gradient_checkpointing=True)
    assert (
        ckpt.model.is_gradient_checkpointing
        if mode == "full"
        else ckpt.model.get_base_model().is_gradient_checkpointing
    )
    m_p, m_c = plain.step(batch), ckpt.step(batch)
    assert m_p["loss"] == pytest.approx(m_c["loss"], abs=1e-6)
    for p, q in zip(plain.params, ckpt.params):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_view_equals_the_screens_one_pass_view(tiny_model_dir: Path, batch, sampling) -> None:
    """The node's local view (`completion_views`, in batches of rows) equals the screen's one-pass one."""
    trainer = _perturbed_trainer(tiny_model_dir)
    prompt = batch.sequences[0].prompt_ids
    completions = [s.completion_ids for s in batch.sequences[:6]]
    temperature, top_k, top_p = sampling
    views = score_completions(
        trainer.model, prompt, completions, temperature=temperature, top_k=top_k, top_p=top_p, pad_id=trainer.pad_id
    )
    rows = completion_views(trainer.model, prompt, completions, *sampling, trainer.pad_id, token_budget=40)
    assert len(rows) == len(views) == len(completions)
    for (logp, rank), view, c in zip(rows, views, completions):
        assert len(logp) == len(rank) == len(c)
        assert np.abs(logp - view.logp).max() <= 1e-5
        assert rank.tolist() == view.rank.tolist()
    logp, rank, mask = sequence_view(trainer.model, [prompt] * 2, completions[:2], *sampling, trainer.pad_id)
    assert not logp.requires_grad and mask.shape == rank.shape == logp.shape


def test_engine_records_what_output_logits_gave(tiny_model_dir: Path) -> None:
    """Same seed, same tokens; the step-by-step log-probs equal the old full-logits record exactly."""
    sampling = Sampling(temperature=0.8, top_k=30, top_p=0.9, max_tokens=14, seed=7)
    prompts = ["1 + 2 =", "33 + 44 = 77 and 5 + 6 =", "7"]
    engine = make_engine("hf", tiny_model_dir)
    got = engine.generate(prompts, n=3, sampling=sampling)
    ids = engine.encode(prompts)
    width = max(len(p) for p in ids)
    input_ids = torch.full((len(ids), width), engine._pad, dtype=torch.long)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    for i, p in enumerate(ids):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    config = GenerationConfig(
        do_sample=True,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_tokens,
        num_return_sequences=3,
        eos_token_id=engine._eos,
        pad_token_id=engine._pad,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(sampling.seed)
        out = engine.base_model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
    generated = out.sequences[:, width:]
    old = torch.stack(
        [sampling_logprobs(x, generated[:, t], 0.8, 30, 0.9) for t, x in enumerate(out.logits)], dim=1
    ).numpy()
    engine.close()
    for i, group in enumerate(got):
        for j, s in enumerate(group):
            row = i * 3 + j
            assert s.token_ids == generated[row, : len(s.token_ids)].tolist()
            np.testing.assert_array_equal(s.logprobs, old[row, : len(s.token_ids)])
