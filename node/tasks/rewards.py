"""The user's own reward functions (`--reward module:function[,...]`, `--reward-weights`).

Each function has TRL's reward-function signature::

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``columns`` are the problem's data as lists, one item per completion: every column of the
row for an ``hf:`` task, and ``answer``, the reference (unless the row has its own ``answer``).
The node calls it with one completion at a time (a peer's samples are re-scored one by one
as they are admitted).

A completion's reward is the weighted mean of the functions' values, sum(w*r) / sum(w), so
it stays in [0, 1] like the built-in reward. A value that is not usable never ends a round:

- the function raises, returns no list, a list of the wrong length, or a value that is
  not a number, or NaN: that function's value is 0 (counted as ``failed``);
- None ("no opinion", as in TRL, which sums the others): 0 (counted as ``none``);
- a number outside [0, 1]: clamped to the range (counted as ``clamped``).

``RewardedTask.faults`` holds the counts; the node shows them in its status.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from node.tasks.base import Problem, Rng, Task, TaskError

__all__ = ["RewardedTask", "import_object", "load_rewards", "with_rewards"]

RewardFunction = Callable[..., Any]
Rewards = list[tuple[str, RewardFunction, float]]


def import_object(spec: str, what: str) -> Any:
    """The object ``module:name`` names, the module importable from the working directory or an
    installed package; TaskError saying what to fix when it is not there."""
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"{what} {spec!r} is not of the form <module>:<name>, e.g. my_rewards:exact_match")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # `python -m` puts it there; the ftis-node script does not
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module's own code failing
        raise TaskError(
            f"{what} {spec!r}: module {module_name!r} does not import ({type(err).__name__}: {err}); "
            "run from its folder or install it"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(name for name in vars(module) if not name.startswith("_"))
        raise TaskError(
            f"{what} {spec!r}: module {module_name!r} has no {attr!r}; it has {', '.join(public) or 'nothing public'}"
        ) from None


def _weights(text: str | Sequence[float] | None, n: int) -> list[float]:
    hint = "--reward-weights takes one non-negative number per --reward function, not all zero, e.g. 1,0.5"
    if text is None or (isinstance(text, str) and not text.strip()):
        return [1.0] * n
    try:
        weights = [float(w) for w in (text.replace(",", " ").split() if isinstance(text, str) else text)]
    except ValueError:
        raise TaskError(f"--reward-weights {text!r}: {hint}") from None
    if len(weights) != n:
        raise TaskError(f"--reward-weights gives {len(weights)} weight(s) for {n} reward function(s); {hint}")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise TaskError(f"--reward-weights {text!r}: {hint}")
    return weights


def load_rewards(specs: str | Sequence[str], weights: str | Sequence[float] | None = None) -> Rewards:
    """(spec, function, weight) for each ``module:function``; TaskError on a bad one."""
    parts = [specs] if isinstance(specs, str) else list(specs)
    items = [item.strip() for part in parts for item in part.split(",") if item.strip()]
    if not items:
        raise TaskError("--reward names no function; e.g. --reward my_rewards:exact_match")
    weights = _weights(weights, len(items))
    loaded = []
    for spec, weight in zip(items, weights, strict=True):
        function = import_object(spec, "--reward")
        if not callable(function):
            raise TaskError(f"--reward {spec!r} is a {type(function).__name__}, not a function")
        loaded.append((spec, function, float(weight)))
    return loaded


class RewardedTask(Task):
    """Another task's problems, scored by the user's functions instead of the task's own reward."""

    def __init__(self, inner: Task, rewards: Rewards) -> None:
        self.inner, self.rewards = inner, rewards
        self.name, self.id_prefix = inner.name, inner.id_prefix
        self.faults: Counter[str] = Counter()
        self.last_fault = ""  # one example, so the user sees why

    def owns(self, task_id: str) -> bool:
        return self.inner.owns(task_id)

    def sample(self, rng: Rng) -> str:
        return self.inner.sample(rng)

    def problem(self, task_id: str) -> Problem:
        return self.inner.problem(task_id)

    def reward(self, problem: Problem, completion: str) -> float:
        # `answer` is the reference whatever its column is called (TRL's examples read `answer`).
        columns = {"answer": problem.answer, **(problem.meta.get("columns") or {})}
        kwargs = {str(k): [v] for k, v in columns.items() if k not in ("prompts", "completions")}
        total = sum(
            weight * self._value(spec, fn, problem.prompt, completion, kwargs) for spec, fn, weight in self.rewards
        )
        return total / sum(weight for _, _, weight in self.rewards)

    def _value(
        self, spec: str, function: RewardFunction, prompt: str, completion: str, kwargs: dict[str, Any]
    ) -> float:
        try:
            out = function(prompts=[prompt], completions=[completion], **kwargs)
        except Exception as err:  # the user's code: count it, score 0, go on with the round
            return self._fault("failed", f"{spec} raised {type(err).__name__}: {err}")
        if not isinstance(out, (list, tuple)) or len(out) != 1:
            return self._fault(
                "failed", f"{spec} returned {type(out).__name__}, not a list of one value per completion"
            )
        value = out[0]
        if value is None:
            return self._fault("none", f"{spec} returned None")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return self._fault("failed", f"{spec} returned {value!r}, not a finite number")
        if not 0.0 <= value <= 1.0:
            self._fault("clamped", f"{spec} returned {value!r}, outside [0, 1]")
            return min(1.0, max(0.0, float(value)))
        return float(value)

    def _fault(self, kind: str, why: str) -> float:
        self.faults[kind] += 1
        self.last_fault = why[:300]
        return 0.0

    def fault_summary(self) -> dict[str, Any] | None:
        """The counts and one reason, for the status; None while every value was good."""
        return {**self.faults, "last": self.last_fault} if self.faults else None


def with_rewards(task: Task, reward: str | Sequence[str] | None, weights: str | Sequence[float] | None = None) -> Task:
    """``task`` scored by the ``--reward`` functions, or ``task`` itself when none are given."""
    if not reward:
        if weights:
            raise TaskError("--reward-weights needs --reward")
        return task
    return RewardedTask(task, load_rewards(reward, weights))
