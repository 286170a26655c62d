"""Shared fixtures: the project's tiny-s model, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread, set before torch loads (and inherited by spawned nodes): the tiny
# models gain nothing from parallel kernels, and on a shared 2-core machine torch's
# thread pool fighting other processes made a 16-token generate 200x slower (5 s vs 25 ms).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF folder (config, safetensors, tokenizer) of tiny-s at its random init.

    Not warm-started: building takes about a second, and tests of the machinery (engines,
    log-prob parity, the trainer) need a real model, not a good one.
    """
    from node.models.tiny import build_tiny

    return build_tiny("tiny-s", cache_dir=tmp_path_factory.mktemp("models"), warm_start=False)
