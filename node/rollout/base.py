"""The rollout engine interface: prompts in, completions with sampling log-probs out.

Every engine records, per completion token, the log-prob of the sampled token under the
distribution it was *actually* drawn from (after temperature, top-k and top-p). That
number travels in the packet as `logp_gen` and is the denominator of every importance
weight in F-TIS, so an engine that records anything else (raw logits, processed scores
with extra masking) silently biases training.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Sampling", "Sample", "RolloutEngine", "FinishReason"]

FinishReason = Literal["stop", "length"]


class Sampling(BaseModel):
    """How to sample. These values also go into the packet so a receiver scores alike."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, gt=0, description="Softmax temperature (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = off).")
    max_tokens: int = Field(32, ge=1, description="Most completion tokens, EOS included.")
    seed: int | None = Field(None, description="Seed for reproducible sampling (None = unseeded).")


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


class RolloutEngine(abc.ABC):
    """Generates completions and swaps policy weights in place between rounds."""

    @abc.abstractmethod
    def generate(
        self, prompts: list[str] | list[list[int]], n: int, sampling: Sampling
    ) -> list[list[Sample]]:
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

    @property
    @abc.abstractmethod
    def adapter_version(self) -> str:
        """The version label of the weights in use ("base" before any load)."""

    @property
    @abc.abstractmethod
    def tokenizer(self):  # a transformers tokenizer
        """The tokenizer that maps prompts to ids and completions back to text."""

    def close(self) -> None:
        """Release the model and any worker processes. Safe to call twice."""

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
