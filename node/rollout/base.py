"""The rollout engine interface: prompts in, completions with sampling log-probs out.

Every engine records, per completion token, the log-prob of the sampled token under the
distribution it was *actually* drawn from (after temperature, top-k and top-p). That
number travels in the packet as `logp_gen` and is the denominator of every importance
weight in F-TIS, so an engine that records anything else (raw logits, processed scores
with extra masking) silently biases training.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Sampling", "Sample", "RolloutEngine", "FinishReason", "check_request", "encode_prompts", "eos_token_ids"]

FinishReason = Literal["stop", "length"]


class Sampling(BaseModel):
    """How to sample. These values also go into the packet so a receiver scores alike."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, gt=0, description="Softmax temperature (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = off).")
    max_tokens: int = Field(32, ge=1, description="Most completion tokens, EOS included.")
    seed: int | None = Field(None, description="Seed for reproducible sampling (None = unseeded).")
    ignore_eos: bool = Field(
        False,
        description="Benchmarks only: run every completion to max_tokens. EOS is drawn like any token "
        "(the distribution is unchanged) and does not end the completion.",
    )


@dataclass(slots=True)
class Sample:
    """One completion of one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # the completion, EOS included when it stopped on one
    logprobs: np.ndarray  # float32 [len(token_ids)], log-prob under the sampling distribution
    text: str  # the completion decoded without special tokens
    finish_reason: FinishReason  # "stop": ended on EOS; "length": hit max_tokens

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")


def check_request(n: int, sampling: Sampling) -> None:
    """The argument checks every engine's `generate` starts with."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, got {type(sampling).__name__}")


def encode_prompts(
    tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]], *, use_chat_template: bool, vocab_size: int
) -> list[list[int]]:
    """Prompts to token ids, validated; text gets the chat template if `use_chat_template`.

    Every engine tokenizes through this one function, so a text prompt becomes the same
    ids (and so the same packet) whichever engine generated from it.
    """
    if all(isinstance(p, str) for p in prompts):
        out = []
        for p in prompts:
            if use_chat_template:
                p = tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                out.append(tokenizer.encode(p, add_special_tokens=False))
            else:
                out.append(tokenizer.encode(p))
    elif all(isinstance(p, (list, tuple, np.ndarray)) for p in prompts):
        out = [[int(t) for t in p] for p in prompts]
    else:
        raise TypeError("prompts must be all strings or all token-id lists")
    for i, ids in enumerate(out):
        if not ids:
            raise ValueError(f"prompt {i} is empty (encodes to no tokens)")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
    return out


def eos_token_ids(tokenizer, generation_eos: int | Sequence[int] | None) -> list[int]:
    """Every id that ends a completion: the model's generation EOS ids, then the tokenizer's.

    `generation_eos` is the model's `generation_config.eos_token_id` (an id, a list or None).
    """
    ids: list[int] = []
    for source in (generation_eos, tokenizer.eos_token_id):
        if source is None:
            continue
        for i in [source] if isinstance(source, int) else list(source):
            if i not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("the model and tokenizer define no EOS token; completions could never stop")
    return ids


class RolloutEngine(abc.ABC):
    """Generates completions and swaps policy weights in place between rounds."""

    @abc.abstractmethod
    def generate(self, prompts: list[str] | list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]:
        """Sample `n` completions for each prompt; result[i] holds prompt i's samples.

        Prompts are either all text (tokenized, with the chat template if the engine
        was built to use one) or all token-id lists (used as they are).
        """

    @abc.abstractmethod
    def load_adapter(self, path: str | Path | None, version: str) -> None:
        """Switch to the weights saved at `path` without reloading the base model.

        A peft LoRA folder is applied on top of the base; a full model folder replaces
        the weights in place; None returns to the plain base model.
        """

    #: True if `load_state` takes weights straight from the trainer's memory; otherwise the
    #: daemon writes a weights-only folder each round for `load_adapter`.
    loads_state: bool = False

    def load_state(self, state: Mapping[str, Any], version: str, *, lora_config: Any | None = None) -> None:
        """Switch to weights handed over in memory (`Trainer.published_state()`), copied in place.

        With `lora_config` (a peft LoraConfig), `state` is a LoRA adapter's tensors as peft
        names them in an adapter file; without, the full model's state dict. Only engines
        with `loads_state` implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} loads weights from folders (load_adapter)")

    @property
    @abc.abstractmethod
    def adapter_version(self) -> str:
        """The version label of the weights in use ("base" before any load)."""

    @property
    @abc.abstractmethod
    def tokenizer(self):  # a transformers tokenizer
        """The tokenizer that maps prompts to ids and completions back to text."""

    def close(self) -> None:  # noqa: B027 (optional hook: engines with nothing to release keep it)
        """Release the model and any worker processes. Safe to call twice."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
