"""Two stock reward functions with TRL's signature, for `--reward` (and the demo): the answer's
format and its correctness, as TRL's GRPO examples split them. Weighted together
(`--reward node.tasks.stock_rewards:answer_format,node.tasks.stock_rewards:answer_correct
--reward-weights 1,3`) a model is paid a little for a well-formed answer tag, which small
models learn within a few steps, and most for the right answer."""

from __future__ import annotations

from typing import Any

from node.tasks.answer import extract_tagged, tagged_reward

__all__ = ["answer_correct", "answer_format"]


def answer_format(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1 for exactly one non-empty `<answer>...</answer>` pair, else 0."""
    return [1.0 if extract_tagged(c) is not None else 0.0 for c in completions]


def answer_correct(prompts: list[str], completions: list[str], answer: list[str], **columns: Any) -> list[float]:
    """1 when that tag holds the reference answer (the tasks' own reward), else 0."""
    return [tagged_reward(c, str(a)) for c, a in zip(completions, answer)]
