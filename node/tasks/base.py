"""What a task is: problems named by ids that any node can regenerate.

A task id is the whole contract between nodes. A packet names the task ids its
completions answer; the receiver rebuilds the prompt and the reference answer from the
id with its own code and re-scores the completion with its own verifier, so no node
ever trusts a peer's prompt, answer or reward.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from node.tasks.answer import tagged_reward

Rng = random.Random | np.random.Generator
#: Ids travel in every packet group; the protocol bounds names at 256 characters.
MAX_TASK_ID_CHARS = 200


class TaskError(ValueError):
    """A task spec or a task id that cannot be used, with the reason in the message."""


class Problem(BaseModel):
    """One problem: the prompt shown to the model and the reference answer."""

    model_config = ConfigDict(frozen=True)

    task_id: str = Field(description="Self-describing id; regenerates this exact problem.")
    prompt: str
    answer: str = Field(description="Reference answer, as text (the verifier parses it).")
    meta: dict[str, Any] = Field(default_factory=dict)


class Task(ABC):
    """A family of problems. Subclasses define ids, prompts and (optionally) the verifier."""

    #: The spec this task was built from, e.g. "toy:id" or "gym:chain_sum?seed=3".
    name: str
    #: The leading part of every id this task issues, e.g. "toy/id/".
    id_prefix: str

    @abstractmethod
    def problem(self, task_id: str) -> Problem:
        """Rebuild the problem ``task_id`` names; raises TaskError for a foreign or bad id."""

    @abstractmethod
    def sample(self, rng: Rng) -> str:
        """Draw one task id with ``rng`` (the caller owns seeding)."""

    def reward(self, problem: Problem, completion: str) -> float:
        """Binary reward: 1.0 for one well-formed ``<answer>`` tag holding the right answer."""
        return tagged_reward(completion, problem.answer)

    def owns(self, task_id: str) -> bool:
        """Whether ``task_id`` was issued by a task of this kind and configuration."""
        return task_id.startswith(self.id_prefix)

    def sample_problems(self, rng: Rng, n: int) -> list[Problem]:
        """``n`` problems drawn with ``rng`` (ids may repeat when the task is small)."""
        return [self.problem(self.sample(rng)) for _ in range(n)]

    def _check_owned(self, task_id: str) -> str:
        """The part of ``task_id`` after this task's prefix; TaskError if the id is foreign."""
        if not isinstance(task_id, str) or not task_id.startswith(self.id_prefix):
            raise TaskError(
                f"task id {task_id!r} does not belong to task {self.name!r} (its ids start with {self.id_prefix!r})"
            )
        return task_id[len(self.id_prefix) :]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def draw_int(rng: Rng, low: int, high: int) -> int:
    """A uniform integer in [low, high] from either kind of generator."""
    if isinstance(rng, random.Random):
        return rng.randint(low, high)
    if isinstance(rng, np.random.Generator):
        return int(rng.integers(low, high + 1))
    raise TypeError(f"rng must be random.Random or numpy.random.Generator, not {type(rng).__name__}")


def text_options(query: str, spec: str) -> dict[str, str]:
    """``a=1&b=x`` -> {"a": "1", "b": "x"} (values kept as text); TaskError naming ``spec`` on a malformed pair."""
    from urllib.parse import parse_qsl

    try:
        return dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise TaskError(f"task spec {spec!r}: options are key=value pairs joined by '&'") from None


def parse_index(text: str, task_id: str, what: str = "index") -> int:
    """A non-negative decimal integer from an id field, or TaskError naming the id."""
    # ASCII only and no leading zeros, so each index has exactly one spelling.
    if re.fullmatch(r"0|[1-9][0-9]*", text) is None:
        raise TaskError(f"task id {task_id!r}: {what} {text!r} is not a non-negative integer")
    return int(text)
