"""Toy arithmetic: short problems the project's tiny models can learn in seconds.

Prompts are raw expressions such as ``12+7=`` and the expected completion is
``<answer>19</answer>``; the tiny models learn that format during their warm-start, so
no instruction is spent on it in the prompt.

Splits:

- ``id``:  a+b or a-b, each operand 1 or 2 digits (equally likely), a-b never negative;
- ``add`` / ``sub``: the two halves of ``id`` (for pairs of nodes with different skills);
- ``ood``: three 1-2 digit operands (``12+7-3=``), never negative: a longer expression
  than any the models saw during warm-start.

Ids are ``toy/<split>/<n>`` with n in [0, 2**31). The problem is a pure function of the
id: the id string itself seeds the generator (``random.Random`` hashes str seeds with
SHA-512, independent of PYTHONHASHSEED), so every node derives the same problem.
"""

from __future__ import annotations

import random
from typing import Literal, get_args

from node.tasks.base import Problem, Rng, Task, TaskError, draw_int, parse_index

ToySplit = Literal["id", "add", "sub", "ood"]
TOY_SPLITS: tuple[str, ...] = get_args(ToySplit)
ID_SPACE = 2**31
MAX_OPERAND = 99


def toy_completion(answer: str) -> str:
    """The completion a perfect model writes (the warm-start teaches exactly this)."""
    return f"<answer>{answer}</answer>"


def _operand(rng: random.Random) -> int:
    """A 1-digit or a 2-digit number, each half the time: single digits are common enough
    that a small model gets some problems right early, and the rest leave room to learn."""
    return rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(10, MAX_OPERAND)


def _two_operands(rng: random.Random, op: str) -> tuple[str, int]:
    a, b = _operand(rng), _operand(rng)
    if op == "+":
        return f"{a}+{b}=", a + b
    a, b = max(a, b), min(a, b)  # keep results non-negative: no sign tokens to learn
    return f"{a}-{b}=", a - b


def _three_operands(rng: random.Random) -> tuple[str, int]:
    while True:  # rejection keeps the distribution simple; ~3/4 of draws are accepted
        a, b, c = (_operand(rng) for _ in range(3))
        op1, op2 = rng.choice("+-"), rng.choice("+-")
        value = a + b if op1 == "+" else a - b
        value = value + c if op2 == "+" else value - c
        if value >= 0:
            return f"{a}{op1}{b}{op2}{c}=", value


class ToyTask(Task):
    """Seeded arithmetic; see the module docstring for the splits."""

    def __init__(self, split: str = "id") -> None:
        if split not in TOY_SPLITS:
            raise TaskError(f"unknown toy split {split!r}; valid splits: {', '.join(TOY_SPLITS)}")
        self.split = split
        self.name = f"toy:{split}"
        self.id_prefix = f"toy/{split}/"

    def task_id(self, n: int) -> str:
        if not 0 <= n < ID_SPACE:
            raise TaskError(f"toy problem number {n} is outside [0, {ID_SPACE})")
        return f"{self.id_prefix}{n}"

    def sample(self, rng: Rng) -> str:
        return self.task_id(draw_int(rng, 0, ID_SPACE - 1))

    def problem(self, task_id: str) -> Problem:
        n = parse_index(self._check_owned(task_id), task_id, "problem number")
        if n >= ID_SPACE:
            raise TaskError(f"task id {task_id!r}: problem number is outside [0, {ID_SPACE})")
        rng = random.Random(task_id)
        if self.split == "ood":
            prompt, value = _three_operands(rng)
        else:
            op = {"add": "+", "sub": "-"}.get(self.split) or rng.choice("+-")
            prompt, value = _two_operands(rng, op)
        return Problem(task_id=task_id, prompt=prompt, answer=str(value), meta={"split": self.split})
