"""A LoRA node holds its base weights once: the engine uses the trainer's frozen tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from node.rollout import Sampling, make_engine
from node.train.trainer import Trainer, TrainerConfig
from tests.test_trainer import make_batch

SAMPLING = Sampling(temperature=0.9, max_tokens=10, seed=5)
PROMPTS = ["1 + 2 =", "7"]


def _draw(engine) -> list[tuple[list[int], np.ndarray]]:
    return [(s.token_ids, s.logprobs) for g in engine.generate(PROMPTS, n=3, sampling=SAMPLING) for s in g]


def _same(a, b, atol: float = 0.0) -> None:
    assert len(a) == len(b)
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        np.testing.assert_allclose(la, lb, rtol=0, atol=atol)


def test_engine_shares_the_lora_trainers_base_and_samples_the_same(tiny_model_dir: Path) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig(seed=1))
    shared, alone = make_engine("hf", tiny_model_dir), make_engine("hf", tiny_model_dir)
    before = _draw(shared)
    freed = shared.share_base_weights(trainer.model)
    base = {p.data_ptr() for p in trainer.model.get_base_model().parameters() if not p.requires_grad}
    engine_ptrs = {p.data_ptr() for p in shared.base_model.parameters()}
    assert freed == sum(p.numel() * p.element_size() for p in shared.base_model.parameters())
    assert engine_ptrs <= base
    _same(before, _draw(shared))

    # A training step and the hand-over: the shared engine samples what a private one does.
    trainer.step(make_batch(tiny_model_dir, n=3))
    for engine in (shared, alone):
        engine.load_state(trainer.published_state(), trainer.adapter_version, lora_config=trainer.lora_config)
    _same(_draw(shared), _draw(alone))
    assert {p.data_ptr() for n, p in shared.base_model.named_parameters() if "lora_" not in n} <= base


def test_a_full_load_into_a_sharing_engine_leaves_the_trainer_alone(tiny_model_dir: Path) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig(seed=1))
    engine = make_engine("hf", tiny_model_dir)
    engine.share_base_weights(trainer.model)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    noisy = {n: p.detach() + 0.5 for n, p in engine.base_model.state_dict().items()}
    engine.load_state(noisy, "noisy")
    for n, p in trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    key = next(iter(noisy))
    assert torch.equal(engine.base_model.state_dict()[key], noisy[key])


def test_an_engine_built_on_the_trainers_tensors_allocates_no_weights(tiny_model_dir: Path) -> None:
    """`share_with`: no second load at all; samples as an engine that loaded its own copy."""
    from node.rollout.hf import HFEngine

    trainer = Trainer(tiny_model_dir, TrainerConfig(seed=1))
    built = HFEngine.from_pretrained(tiny_model_dir, share_with=trainer.model, tokenizer=trainer.tokenizer)
    loaded = make_engine("hf", tiny_model_dir)
    base = {p.data_ptr() for p in trainer.model.get_base_model().parameters() if not p.requires_grad}
    assert {p.data_ptr() for p in built.base_model.parameters()} <= base
    assert not any(p.is_meta for p in built.base_model.parameters())
    assert not any(b.is_meta for b in built.base_model.buffers())
    # Float rounding only (5e-7 seen): the tensors are the same values, the modules built apart.
    _same(_draw(built), _draw(loaded), atol=1e-5)
    trainer.step(make_batch(tiny_model_dir, n=3))
    for engine in (built, loaded):
        engine.load_state(trainer.published_state(), trainer.adapter_version, lora_config=trainer.lora_config)
    _same(_draw(built), _draw(loaded), atol=1e-5)


def test_a_full_trainers_engine_samples_each_steps_weights(tiny_model_dir: Path) -> None:
    """Full fine-tuning shares too: the hand-over of the trainer's state copies nothing, and the
    engine samples what a private engine given the same state does."""
    from node.rollout.hf import HFEngine

    trainer = Trainer(tiny_model_dir, TrainerConfig(mode="full", lr=1e-3, seed=1))
    built = HFEngine.from_pretrained(tiny_model_dir, share_with=trainer.model)
    loaded = make_engine("hf", tiny_model_dir)
    trainer.step(make_batch(tiny_model_dir, n=3))
    for engine in (built, loaded):
        engine.load_state(trainer.published_state(), trainer.adapter_version)
    assert {p.data_ptr() for p in built.base_model.parameters()} <= {p.data_ptr() for p in trainer.model.parameters()}
    _same(_draw(built), _draw(loaded), atol=1e-5)


def test_a_full_node_plays_rounds_on_one_copy_of_its_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The daemon's wiring: a full fine-tuning node's engine samples from the trainer's own tensors."""
    from node.bench.rounds import solo_node

    node = solo_node(tmp_path / "node", "full", model=str(tiny_model_dir), train_mode="full", lr=1e-3, seed=3)
    try:
        trained = {p.data_ptr() for p in node.trainer.model.parameters()}
        for r in range(2):
            node.finish_round(r, node.begin_round(r))
            assert node.trainer.steps == r + 1
            assert node.engine.adapter_version == node.trainer.adapter_version
            assert {p.data_ptr() for p in node.engine.base_model.parameters()} <= trained
    finally:
        node.close()
