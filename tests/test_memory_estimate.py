"""The memory estimate, the micro-batch it picks, and the one-line error when a model cannot fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from node.bench.memory import _QWEN_COMMON, QWEN_SHAPES
from node.config import NodeConfig
from node.console.preflight import PreflightError, check_memory
from node.memory import (
    CPU_MICRO_BATCH,
    MICRO_BATCH_CHOICES,
    ModelShape,
    estimate,
    fit_micro_batch,
    peak_rss,
    plan,
    release_memory,
    reset_peak_rss,
)


def _params_of(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(QWEN_SHAPES))
def test_shape_counts_the_parameters_of_the_published_configs(name: str) -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(**QWEN_SHAPES[name], **_QWEN_COMMON)
    shape = ModelShape.from_config(config)
    assert shape.params == pytest.approx(_params_of(config), rel=2e-3)  # biases of q/k/v left out
    assert shape.vocab == 151936


def test_shape_of_a_project_model(tiny_model_dir: Path) -> None:
    shape = ModelShape.from_folder(tiny_model_dir)
    assert shape.params == pytest.approx(_params_of(AutoConfig.from_pretrained(tiny_model_dir)), rel=2e-2)


def test_estimate_grows_with_what_it_should() -> None:
    shape = ModelShape.from_config({**QWEN_SHAPES["qwen2.5-0.5b-random"], **_QWEN_COMMON})
    base = estimate(shape, micro_batch_tokens=1024).total
    assert estimate(shape, micro_batch_tokens=4096).total > base
    assert estimate(shape, micro_batch_tokens=1024, gradient_checkpointing=True).total < base
    assert estimate(shape, micro_batch_tokens=1024, mode="full").total > base + 3 * shape.params * 4
    assert estimate(shape, micro_batch_tokens=1024, engine_weights=False).total < base


def _cfg(model: str, **settings) -> NodeConfig:
    return NodeConfig(model=model, **settings)


def test_fit_picks_the_largest_micro_batch_that_fits() -> None:
    """What a GPU node gets: the largest micro-batch whose estimate fits the free memory."""
    shape = ModelShape.from_config({**QWEN_SHAPES["qwen2.5-0.5b-random"], **_QWEN_COMMON})
    needs = {t: estimate(shape, micro_batch_tokens=t).total for t in (1024, 2048)}
    assert fit_micro_batch(shape, (needs[1024] + needs[2048]) / 2) == 1024
    assert fit_micro_batch(shape, 1e12) == MICRO_BATCH_CHOICES[0]
    assert fit_micro_batch(shape, 1e8) is None


def test_plan_on_a_cpu(tiny_model_dir: Path) -> None:
    shape = ModelShape.from_config({**QWEN_SHAPES["qwen2.5-0.5b-random"], **_QWEN_COMMON})
    chosen = plan(_cfg(str(tiny_model_dir)), shape, free=1e12)
    assert chosen.fits and chosen.micro_batch_tokens == CPU_MICRO_BATCH
    assert chosen.estimate.parts["engine weights"] == 0  # the hf engine runs on the trainer's tensors
    assert not plan(_cfg(str(tiny_model_dir)), shape, free=1e8).fits
    given = plan(_cfg(str(tiny_model_dir), micro_batch_tokens=4096), shape, free=chosen.needed)
    assert given.micro_batch_tokens == 4096 and not given.fits


def test_a_model_too_big_for_the_machine_stops_with_one_line(tmp_path: Path) -> None:
    """A folder with a config too big for any machine: check_memory says what it needs and what to try."""
    folder = tmp_path / "huge"
    folder.mkdir()
    config = {**_QWEN_COMMON, **QWEN_SHAPES["qwen2.5-1.5b-random"], "num_hidden_layers": 4000, "model_type": "qwen2"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PreflightError) as err:
        check_memory(_cfg(str(folder), micro_batch_tokens=1024))
    message = str(err.value)
    assert "needs about" in message and "free" in message and "--micro-batch-tokens 512" in message
    fitted, memory = check_memory(_cfg("tiny-s"))  # a model that fits: the micro-batch is decided
    assert memory is not None and fitted.micro_batch_tokens == memory.micro_batch_tokens


def test_the_cli_prints_one_error_line(tmp_path: Path) -> None:
    folder = tmp_path / "huge"
    folder.mkdir()
    config = {**_QWEN_COMMON, **QWEN_SHAPES["qwen2.5-1.5b-random"], "num_hidden_layers": 4000, "model_type": "qwen2"}
    (folder / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.console.cli",
            "train",
            "--model",
            str(folder),
            "--rounds",
            "1",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "needs about" in lines[0] and "a smaller model" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_peak_reset_forgets_an_earlier_peak() -> None:
    """What bench memory relies on: after a reset the peak is the present, not the past."""
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
    high = peak_rss()
    del block
    release_memory()
    assert reset_peak_rss()
    assert peak_rss() < high - 32 * 2**20
