"""Greedy pass@1 of a node's current policy on a fixed, seeded set of problems.

The evaluation uses the node's own rollout engine, so it measures exactly the weights
the node generates with (the adapter hot-reloaded after the last step), tokenizes
prompts the way its rollouts do (`Admission.prompt_ids`) and scores with the task's own
verifier. Greedy decoding is top-k = 1 sampling: the engine records log-probs under the
transform it samples with, and with k = 1 that transform is the argmax.

The problem set is a pure function of (task spec, size, seed): every variant, seed and
round of an experiment is scored on the same problems, so accuracy curves differ only
by the weights. A file-backed task (GSM8K, MATH-500) is evaluated on its first `n`
problems, in file order, which is how those benchmarks are usually reported.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from node.tasks import Problem, Task, get_task

__all__ = ["EvalSet", "eval_set", "greedy_pass_at_1", "sampled_reward_mean"]

# The eval seed is salted so that an eval set never equals the stream of training prompts
# a node with the same seed draws (`Node` seeds each round with "<seed>/prompts/<round>").
_EVAL_SALT = "ftis-eval"


@dataclass(frozen=True)
class EvalSet:
    """A named, fixed list of problems and the task whose verifier scores them."""

    name: str  # the split's label in reports, e.g. "id" or "ood"
    task: Task
    problems: tuple[Problem, ...]

    def __len__(self) -> int:
        return len(self.problems)


def eval_set(name: str, task_spec: str, n: int, seed: int = 0) -> EvalSet:
    """`n` problems of `task_spec`: the first `n` of a file-backed task, else `n` seeded draws."""
    if n < 1:
        raise ValueError(f"an eval set needs at least one problem, got n={n}")
    task = get_task(task_spec)
    size = _task_size(task)
    if size is not None:
        ids = [f"{task.id_prefix}{i}" for i in range(min(n, size))]
    else:
        rng = random.Random(f"{_EVAL_SALT}/{task_spec}/{seed}")
        ids, seen = [], set()
        for _ in range(100 * n):  # distinct problems while the task has enough of them
            task_id = task.sample(rng)
            if task_id not in seen:
                seen.add(task_id)
                ids.append(task_id)
                if len(ids) == n:
                    break
    return EvalSet(name=name, task=task, problems=tuple(task.problem(i) for i in ids))


def _task_size(task: Task) -> int | None:
    try:
        return len(task)  # type: ignore[arg-type]
    except TypeError:
        return None  # generated tasks have no end


def greedy_pass_at_1(node, evals: EvalSet, max_tokens: int) -> float:
    """The fraction of `evals` a set-up `node.daemon.Node` answers right with greedy decoding."""
    from node.rollout import Sampling

    greedy = Sampling(temperature=1.0, top_k=1, top_p=1.0, max_tokens=max_tokens, seed=0)
    return _mean_reward(node, evals, greedy, n=1)


def sampled_reward_mean(node, evals: EvalSet, max_tokens: int, n: int = 4, seed: int = 0) -> float:
    """Mean reward of `n` seeded samples per problem under the node's own sampling settings:
    the quantity RL maximises (greedy pass@1 only moves when an argmax flips)."""
    sampling = node.sampling.model_copy(update={"max_tokens": max_tokens, "seed": seed})
    return _mean_reward(node, evals, sampling, n)


def _mean_reward(node, evals: EvalSet, sampling, n: int) -> float:
    """Mean verifier reward of `n` completions per problem, sampled by the node's own engine."""
    if node.engine is None:
        raise RuntimeError("the node has no engine: call node.setup() before evaluating it")
    prompts = [node.admission.prompt_ids(p.prompt) for p in evals.problems]
    samples = node.engine.generate(prompts, n=n, sampling=sampling)
    total = sum(float(evals.task.reward(p, s.text)) for p, group in zip(evals.problems, samples) for s in group)
    return total / (n * len(evals))
