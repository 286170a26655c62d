"""Rollout engines: sample completions and record their sampling log-probs.

`make_engine("hf", path)` is the entry point; each engine implements `RolloutEngine`.
Engines are imported when asked for, so vLLM (an optional dependency) is only needed
by `make_engine("vllm", ...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node.rollout.base import FinishReason, RolloutEngine, Sample, Sampling

__all__ = ["ENGINES", "FinishReason", "RolloutEngine", "Sample", "Sampling", "make_engine"]

ENGINES = ("hf", "vllm")


def make_engine(name: str, model: str | Path, **kwargs: Any) -> RolloutEngine:
    """Build the engine called `name` for `model` (an alias, a local folder or a hub id).

    Keyword arguments go to the engine's constructor (for "hf": dtype, device,
    tokenizer, use_chat_template, max_batch_sequences; for "vllm": dtype, device,
    tokenizer, use_chat_template, max_lora_rank, max_model_len, gpu_memory_utilization,
    reference_logprobs, self_check_tolerance and `vllm.LLM` arguments).
    """
    if name == "hf":
        from node.rollout.hf import HFEngine  # imports torch/transformers only when asked for

        return HFEngine.from_pretrained(model, **kwargs)
    if name == "vllm":
        from node.rollout.vllm import VLLMEngine  # raises a clear ImportError without vLLM

        return VLLMEngine(model, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; available: {', '.join(ENGINES)}")
