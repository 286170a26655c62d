"""The HF rollout engine: shapes, EOS handling, seeding, log-prob parity, weight swaps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_contract import PROMPTS, assert_rejects_bad_requests, flat
from transformers import AutoModelForCausalLM, GenerationConfig

from node.rollout import Sampling, make_engine
from node.rollout.hf import HFEngine
from node.train.logprobs import sequence_logprobs, truncate_scores


@pytest.fixture
def engine(tiny_model_dir: Path) -> HFEngine:
    eng = make_engine("hf", tiny_model_dir)
    yield eng
    eng.close()


def _make_adapter(model_dir: Path, out: Path, seed: int, target: list[str]) -> Path:
    """A peft LoRA adapter with random (non-zero) A and B, so it visibly changes outputs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=target, init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out


def test_unknown_engine_is_a_clear_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'.*hf"):
        make_engine("sglang", tiny_model_dir)


def test_shapes_and_fields(engine: HFEngine) -> None:
    out = engine.generate(PROMPTS, n=4, sampling=Sampling(max_tokens=12, seed=0))
    assert len(out) == len(PROMPTS) and all(len(g) == 4 for g in out)
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            assert s.prompt_token_ids == engine.tokenizer.encode(prompt)
            assert 1 <= len(s.token_ids) <= 12
            assert s.logprobs.dtype == np.float32 and s.logprobs.shape == (len(s.token_ids),)
            assert np.all(s.logprobs <= 0) and np.all(np.isfinite(s.logprobs))
            assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
    # Token-id prompts are used as they are.
    ids = [[5, 6, 7], [9]]
    out = engine.generate(ids, n=2, sampling=Sampling(max_tokens=3, seed=0))
    assert [g[0].prompt_token_ids for g in out] == ids


def test_chat_template(engine: HFEngine) -> None:
    tok = engine.tokenizer
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{% if add_generation_prompt %} =>{% endif %}"
    )
    chat = HFEngine(engine.base_model, tok, use_chat_template=True)
    out = chat.generate(["1 + 2"], n=1, sampling=Sampling(max_tokens=2, seed=0))
    assert out[0][0].prompt_token_ids == tok.encode("[user] 1 + 2 =>", add_special_tokens=False)
    # Token-id prompts are never templated.
    assert chat.generate([[5, 6]], n=1, sampling=Sampling(max_tokens=2))[0][0].prompt_token_ids == [5, 6]


def test_chunking_keeps_prompt_order(tiny_model_dir: Path) -> None:
    """Several generate calls (max_batch_sequences) still return one group per prompt, in order."""
    eng = make_engine("hf", tiny_model_dir, max_batch_sequences=4)
    out = eng.generate(PROMPTS, n=3, sampling=Sampling(max_tokens=4, seed=0))
    assert [g[0].prompt_token_ids for g in out] == [eng.tokenizer.encode(p) for p in PROMPTS]
    assert all(len(g) == 3 for g in out)


def test_bad_input(engine: HFEngine) -> None:
    assert_rejects_bad_requests(engine)
    with pytest.raises(ValueError, match="no chat template"):
        HFEngine(engine.base_model, engine.tokenizer, use_chat_template=True)
    with pytest.raises(ValueError):
        Sampling(temperature=0)


def test_eos_cut_and_finish_reasons(engine: HFEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    # Make EOS likely so that both outcomes occur in one seeded batch: raise its logit
    # through the (tied) output embedding row.
    with torch.no_grad():
        engine.base_model.get_output_embeddings().weight[eos] *= 40.0
    out = flat(engine.generate(PROMPTS, n=16, sampling=Sampling(max_tokens=10, seed=3)))
    reasons = {s.finish_reason for s in out}
    assert reasons == {"stop", "length"}, reasons
    for s in out:
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == eos and eos not in s.token_ids[:-1]
        else:
            assert len(s.token_ids) == 10 and eos not in s.token_ids
        assert len(s.logprobs) == len(s.token_ids)


def test_seeding_reproducible(engine: HFEngine) -> None:
    sampling = Sampling(temperature=0.8, top_k=50, max_tokens=16, seed=7)
    a = flat(engine.generate(PROMPTS, n=3, sampling=sampling))
    torch.rand(5)  # unrelated use of the global RNG must not matter
    b = flat(engine.generate(PROMPTS, n=3, sampling=sampling))
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    c = flat(engine.generate(PROMPTS, n=3, sampling=sampling.model_copy(update={"seed": 8})))
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    # Seeded sampling leaves the caller's RNG stream where it was.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(PROMPTS, n=2, sampling=sampling)
    assert torch.equal(torch.rand(3), expected)


def test_top_k_1_is_greedy(engine: HFEngine) -> None:
    out = flat(engine.generate(PROMPTS, n=2, sampling=Sampling(top_k=1, max_tokens=12, seed=0)))
    for s in out:
        ids = torch.tensor([s.prompt_token_ids])
        greedy = engine.base_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=GenerationConfig(do_sample=False, max_new_tokens=12),
        )
        ref = greedy[0, ids.shape[1] :].tolist()
        assert s.token_ids == ref[: len(s.token_ids)]
        np.testing.assert_allclose(s.logprobs, 0.0, atol=1e-6)  # the only token left has p = 1


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1.0, max_tokens=16, seed=1),
        Sampling(temperature=0.7, max_tokens=16, seed=2),
        Sampling(temperature=1.0, top_k=20, max_tokens=16, seed=3),
        Sampling(temperature=0.7, top_k=40, top_p=0.9, max_tokens=16, seed=4),
        Sampling(temperature=1.3, top_p=0.8, max_tokens=16, seed=5),
    ],
    ids=["t1", "t0.7", "t1-k20", "t0.7-k40-p0.9", "t1.3-p0.8"],
)
def test_logprob_parity_with_recompute(engine: HFEngine, sampling: Sampling) -> None:
    """THE contract: recorded log-probs == a fresh forward pass under the same transform."""
    out = flat(engine.generate(PROMPTS, n=3, sampling=sampling))  # prompts of 4, 17 and 1 tokens
    assert len({len(s.prompt_token_ids) for s in out}) == 3
    with torch.no_grad():
        logp, mask = sequence_logprobs(
            engine.base_model,
            [s.prompt_token_ids for s in out],
            [s.token_ids for s in out],
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            pad_id=engine.tokenizer.pad_token_id,
        )
    for i, s in enumerate(out):
        n = len(s.token_ids)
        assert mask[i, :n].sum() == n and mask[i, n:].sum() == 0
        np.testing.assert_allclose(logp[i, :n].numpy(), s.logprobs, atol=1e-4, rtol=0)


def test_logprobs_are_those_of_the_sampler(engine: HFEngine) -> None:
    """With no other processor active, HF's processed `scores` ARE the sampling distribution:
    the engine's log-probs (from raw logits) must match them token for token."""
    sampling = Sampling(temperature=0.7, top_k=30, top_p=0.85, max_tokens=10, seed=11)
    ids = [engine.tokenizer.encode("12 + 30 =")]
    sample = engine.generate(ids, n=1, sampling=sampling)[0][0]
    torch.manual_seed(11)
    prompt = torch.tensor(ids)
    out = engine.base_model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        generation_config=GenerationConfig(
            do_sample=True,
            temperature=0.7,
            top_k=30,
            top_p=0.85,
            max_new_tokens=10,
            return_dict_in_generate=True,
            output_scores=True,
        ),
    )
    tokens = out.sequences[0, prompt.shape[1] :]
    assert tokens[: len(sample.token_ids)].tolist() == sample.token_ids
    ref = torch.stack([s[0].log_softmax(-1)[t] for s, t in zip(out.scores, tokens)])
    np.testing.assert_allclose(sample.logprobs, ref[: len(sample.token_ids)].numpy(), atol=1e-5)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (5, 1.0), (40, 0.9), (1, 0.3), (600, 0.99), (3, 0.01)])
def test_truncation_equals_hf_warpers(top_k: int, top_p: float) -> None:
    """`truncate_scores` keeps exactly the tokens HF's TopK/TopP warpers keep."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(64, 512, generator=torch.Generator().manual_seed(top_k)) * 3
    ref = scores
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    mine = truncate_scores(scores, top_k, top_p)
    assert torch.equal(torch.isinf(mine), torch.isinf(ref))
    # A token outside the kept set stays finite when it is the target (a peer's sample).
    outside = torch.isinf(ref).float().argmax(-1)
    kept = truncate_scores(scores, top_k, top_p, keep=outside)
    assert torch.isfinite(kept.gather(-1, outside[:, None])).all()


def test_model_generation_defaults_do_not_leak(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint's generation_config.json (repetition penalty, top-k 50 ...) must not
    reshape the distribution whose log-probs are recorded."""
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    GenerationConfig(do_sample=True, repetition_penalty=3.0, top_k=5, min_new_tokens=8).save_pretrained(tmp_path / "m")
    eng = make_engine("hf", tmp_path / "m")
    sampling = Sampling(max_tokens=12, seed=5)
    out = flat(eng.generate(PROMPTS, n=2, sampling=sampling))
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            eng.base_model,
            [s.prompt_token_ids for s in out],
            [s.token_ids for s in out],
            pad_id=eng.tokenizer.pad_token_id,
        )
    for i, s in enumerate(out):
        np.testing.assert_allclose(logp[i, : len(s.token_ids)].numpy(), s.logprobs, atol=1e-4)


def test_load_adapter_switches_in_place(engine: HFEngine, tiny_model_dir: Path, tmp_path: Path) -> None:
    a = _make_adapter(tiny_model_dir, tmp_path / "a", seed=1, target=["q_proj", "v_proj"])
    b = _make_adapter(tiny_model_dir, tmp_path / "b", seed=2, target=["q_proj", "k_proj", "v_proj", "o_proj"])
    sampling = Sampling(max_tokens=12, seed=0)
    base_weight = engine.base_model.model.layers[0].self_attn.q_proj.weight
    embed = engine.base_model.get_input_embeddings().weight

    def run() -> list[list[int]]:
        return [s.token_ids for s in flat(engine.generate(PROMPTS, n=2, sampling=sampling))]

    base_out = run()
    assert engine.adapter_version == "base"
    engine.load_adapter(a, "va")
    assert engine.adapter_version == "va"
    a_out = run()
    assert a_out != base_out
    engine.load_adapter(b, "vb")
    b_out = run()
    assert b_out not in (base_out, a_out)
    assert len(engine._peft.peft_config) == 1  # the previous adapter was deleted
    engine.load_adapter(a, "va2")
    assert run() == a_out
    engine.load_adapter(None, "base")
    assert run() == base_out
    # The base tensors were never reloaded or copied.
    assert engine.base_model.model.layers[0].self_attn.q_proj.weight is base_weight
    assert engine.base_model.get_input_embeddings().weight is embed


def test_adapter_logprob_parity(engine: HFEngine, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer-side recompute on a PeftModel from the saved folder matches the engine."""
    from peft import PeftModel

    path = _make_adapter(tiny_model_dir, tmp_path / "a", seed=4, target=["q_proj", "v_proj"])
    engine.load_adapter(path, "v1")
    sampling = Sampling(temperature=0.7, top_p=0.95, max_tokens=12, seed=9)
    out = flat(engine.generate(PROMPTS, n=2, sampling=sampling))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), path).eval()
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            reference,
            [s.prompt_token_ids for s in out],
            [s.token_ids for s in out],
            temperature=0.7,
            top_p=0.95,
            pad_id=engine.tokenizer.pad_token_id,
        )
    for i, s in enumerate(out):
        np.testing.assert_allclose(logp[i, : len(s.token_ids)].numpy(), s.logprobs, atol=1e-4)


def test_load_full_weights(engine: HFEngine, tiny_model_dir: Path, tmp_path: Path) -> None:
    tuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tuned.save_pretrained(tmp_path / "full")
    sampling = Sampling(max_tokens=12, seed=0)
    base_out = [s.token_ids for s in flat(engine.generate(PROMPTS, n=2, sampling=sampling))]
    weight = engine.base_model.model.layers[1].mlp.up_proj.weight
    engine.load_adapter(tmp_path / "full", "full-1")  # detects a model folder
    assert engine.adapter_version == "full-1"
    assert engine.base_model.model.layers[1].mlp.up_proj.weight is weight  # copied in place
    torch.testing.assert_close(weight, tuned.model.layers[1].mlp.up_proj.weight, rtol=0, atol=0)
    out = flat(engine.generate(PROMPTS, n=2, sampling=sampling))
    assert [s.token_ids for s in out] != base_out
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            tuned, [s.prompt_token_ids for s in out], [s.token_ids for s in out], pad_id=engine.tokenizer.pad_token_id
        )
    for i, s in enumerate(out):
        np.testing.assert_allclose(logp[i, : len(s.token_ids)].numpy(), s.logprobs, atol=1e-4)


def test_load_rejects_bad_folders(engine: HFEngine, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a peft adapter"):
        engine.load_adapter(tmp_path, "x")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        engine.load_adapter(tmp_path, "x")
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    before = engine.base_model.get_input_embeddings().weight.clone()
    with pytest.raises(ValueError, match="has shape"):
        engine.load_adapter(tmp_path, "x")
    assert torch.equal(engine.base_model.get_input_embeddings().weight, before)
    assert engine.adapter_version == "base"


# --------------------------------------------------------------------------- weights from memory


def _trained(tiny_model_dir: Path, mode: str):
    """A real Trainer whose published weights differ from the base (perturbed, one step counted)."""
    from node.train.trainer import Trainer, TrainerConfig

    trainer = Trainer(tiny_model_dir, TrainerConfig(mode=mode, seed=3))
    with torch.no_grad():
        for p in trainer.params:
            p.add_(torch.randn_like(p) * 0.05)
    trainer.steps += 1
    return trainer


def _matches_trainer(engine: HFEngine, trainer) -> None:
    """The engine samples from the trainer's policy: its recorded log-probs are the trainer's."""
    out = flat(engine.generate(PROMPTS, n=2, sampling=Sampling(max_tokens=12, seed=4)))
    trainer.model.eval()
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            trainer.model, [s.prompt_token_ids for s in out], [s.token_ids for s in out], pad_id=trainer.pad_id
        )
    for i, s in enumerate(out):
        np.testing.assert_allclose(logp[i, : len(s.token_ids)].numpy(), s.logprobs, atol=1e-4)


def test_load_state_takes_the_trainers_lora_in_place(engine: HFEngine, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _trained(tiny_model_dir, "lora")
    base_weight = engine.base_model.model.layers[0].self_attn.q_proj.weight
    engine.load_state(trainer.published_state(), trainer.adapter_version, lora_config=trainer.lora_config)
    assert engine.adapter_version == trainer.adapter_version
    _matches_trainer(engine, trainer)
    held = dict(engine._lora_params)
    with torch.no_grad():  # the next "step"
        for p in trainer.params:
            p.mul_(1.5)
    trainer.steps += 1
    engine.load_state(trainer.published_state(), trainer.adapter_version, lora_config=trainer.lora_config)
    _matches_trainer(engine, trainer)
    assert all(engine._lora_params[n] is t for n, t in held.items())  # copied into the same tensors
    assert all(t is not dict(trainer.published_state())[n] for n, t in held.items())  # ... its own
    assert engine.base_model.model.layers[0].self_attn.q_proj.base_layer.weight is base_weight
    # A folder adapter in between, then memory again: each replaces the other.
    engine.load_adapter(trainer.save_adapter(tmp_path / "adapter"), "folder")
    _matches_trainer(engine, trainer)
    engine.load_state(trainer.published_state(), "again", lora_config=trainer.lora_config)
    _matches_trainer(engine, trainer)
    assert len(engine._peft.peft_config) == 1


def test_load_state_takes_full_weights_in_place(engine: HFEngine, tiny_model_dir: Path) -> None:
    trainer = _trained(tiny_model_dir, "full")
    weight = engine.base_model.model.layers[1].mlp.up_proj.weight
    engine.load_state(trainer.published_state(), trainer.adapter_version)
    assert engine.adapter_version == trainer.adapter_version and engine._peft is None
    assert engine.base_model.model.layers[1].mlp.up_proj.weight is weight
    _matches_trainer(engine, trainer)


def test_load_state_refuses_a_state_that_does_not_fit(engine: HFEngine, tiny_model_dir: Path) -> None:
    trainer = _trained(tiny_model_dir, "lora")
    engine.load_state(trainer.published_state(), "v1", lora_config=trainer.lora_config)
    before = {n: t.clone() for n, t in engine._lora_params.items()}
    state = trainer.published_state()
    name = next(iter(state))
    with pytest.raises(ValueError, match="has shape"):
        engine.load_state(state | {name: torch.zeros(3)}, "v2", lora_config=trainer.lora_config)
    with pytest.raises(ValueError, match="does not fit the adapter"):
        engine.load_state({k: v for k, v in state.items() if k != name}, "v2", lora_config=trainer.lora_config)
    assert engine.adapter_version == "v1"
    assert all(torch.equal(before[n], t) for n, t in engine._lora_params.items())  # untouched
    full = _trained(tiny_model_dir, "full").published_state()
    with pytest.raises(ValueError, match="tensors the model does not have"):
        engine.load_state(full | {"extra.weight": torch.zeros(1)}, "v3")


def test_ignore_eos_runs_every_completion_to_max_tokens() -> None:
    engine = make_engine("hf", "tiny-s")  # warm-started: it closes its answers, then EOS
    eos = set(engine._eos)
    length = 24
    stopping = flat(engine.generate(PROMPTS, n=4, sampling=Sampling(max_tokens=length, seed=0)))
    assert any(s.finish_reason == "stop" for s in stopping)
    out = flat(engine.generate(PROMPTS, n=4, sampling=Sampling(max_tokens=length, seed=0, ignore_eos=True)))
    assert all(len(s.token_ids) == length and s.finish_reason == "length" for s in out)
    assert any(t in eos for s in out for t in s.token_ids)  # EOS drawn, and it ended nothing
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            engine.base_model, [s.prompt_token_ids for s in out], [s.token_ids for s in out], pad_id=engine._pad
        )
    for i, s in enumerate(out):
        np.testing.assert_allclose(logp[i].numpy(), s.logprobs, atol=1e-4)  # the unmasked distribution
