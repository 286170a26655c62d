"""What every rollout engine must do alike, checked by each engine's test file."""

from __future__ import annotations

import pytest

from node.rollout import Sample, Sampling

PROMPTS = ["1 + 2 =", "33 + 44 = 77 and 5 + 6 =", "7"]


def flat(groups: list[list[Sample]]) -> list[Sample]:
    return [s for g in groups for s in g]


def assert_rejects_bad_requests(engine) -> None:
    """Bad arguments to `generate` raise a clear error (the tiny models have 512 positions)."""
    with pytest.raises(TypeError, match="must be a Sampling"):
        engine.generate(PROMPTS, n=1, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="n must be >= 1"):
        engine.generate(PROMPTS, n=0, sampling=Sampling())
    with pytest.raises(TypeError, match="all strings or all token-id lists"):
        engine.generate(["a", [1, 2]], n=1, sampling=Sampling())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 99999]], n=1, sampling=Sampling())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], n=1, sampling=Sampling())
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        engine.generate([[1] * 500], n=1, sampling=Sampling(max_tokens=20))
    assert engine.generate([], n=2, sampling=Sampling()) == []
