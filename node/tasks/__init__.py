"""Tasks: problems named by self-describing ids, and their local verifiers.

Specs (what a user passes to ``--task``):

    toy                          toy arithmetic, in-distribution split
    toy:ood | toy:add | toy:sub  the other toy splits
    gym:<dataset>[?seed=S&k=v]   a reasoning-gym dataset, e.g. gym:chain_sum?seed=3
    gsm8k:<path.jsonl>           GSM8K from a local file
    math500:<path.jsonl>         MATH-500 from a local file
    mix:<spec>,<spec>,...        prompts drawn from several tasks (node/tasks/mix.py)
    hf:<path>[?prompt=C&answer=C&split=S]  the user's local data (node/tasks/hf.py)
    py:<module>:<factory>[?k=v]  the user's own Task (node/tasks/plugin.py)
    <kind>:<rest>                a kind an installed package adds (entry points ftis_node.tasks)

``with_rewards(task, "module:function")`` scores a task with the user's functions
(node/tasks/rewards.py); docs/tasks.md is the guide.

``get_task(spec)`` builds the task; ``task_for_id(task_id)`` rebuilds the task that
issued an id received from a peer (toy and gym ids are self-contained; file-backed
ids need the local task passed in ``known``).
"""

from __future__ import annotations

from collections.abc import Iterable

from node.console.suggest import did_you_mean
from node.tasks.answer import (
    answers_match,
    extract_boxed,
    extract_hash_answer,
    extract_tagged,
    format_instruction,
    parse_number,
    tagged_reward,
)
from node.tasks.base import Problem, Rng, Task, TaskError, text_options
from node.tasks.gym import NUMERIC_GYM_DATASETS, GymTask, gym_dataset_names, parse_query
from node.tasks.hf import HfTask
from node.tasks.jsonl import JsonlTask
from node.tasks.mix import MixTask
from node.tasks.plugin import entry_point_task, installed_task_kinds, plugin_task
from node.tasks.rewards import RewardedTask, with_rewards
from node.tasks.toy import TOY_SPLITS, ToyTask, toy_completion

TASK_KINDS: tuple[str, ...] = ("toy", "gym", "gsm8k", "math500", "mix", "hf", "py")
_SPEC_HELP = (
    "toy[:id|ood|add|sub], gym:<dataset>[?seed=N&key=value], gsm8k:<file.jsonl>, math500:<file.jsonl>, "
    "mix:<spec>,<spec>,..., hf:<file>?prompt=<column>&answer=<column>, py:<module>:<factory>"
)


def get_task(spec: str) -> Task:
    """Build the task a spec names; TaskError with the valid forms when it is malformed."""
    if not isinstance(spec, str) or not spec.strip():
        raise TaskError(f"empty task spec; valid forms: {_SPEC_HELP}")
    kind, _, rest = spec.strip().partition(":")
    if kind == "toy":
        split, _, query = rest.partition("?")
        if query:
            raise TaskError(f"task spec {spec!r}: toy takes no options")
        return ToyTask(split or "id")
    if kind == "gym":
        dataset, _, query = rest.partition("?")
        if not dataset:
            raise TaskError(
                f"task spec {spec!r} names no dataset; e.g. gym:chain_sum. "
                f"Numeric datasets: {', '.join(NUMERIC_GYM_DATASETS)}"
            )
        params = parse_query(query, f"task spec {spec!r}")
        seed = params.pop("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TaskError(f"task spec {spec!r}: seed must be an integer")
        return GymTask(dataset, seed=seed, **params)
    if kind == "mix":
        parts = [part.strip() for part in rest.split(",") if part.strip()]
        if any(part.partition(":")[0] == "mix" for part in parts):
            raise TaskError(f"task spec {spec!r}: a mix cannot hold another mix")
        return MixTask([get_task(part) for part in parts], spec.strip())
    if kind in ("gsm8k", "math500"):
        if not rest:
            raise TaskError(f"task spec {spec!r} names no file; e.g. {kind}:/data/{kind}.jsonl")
        return JsonlTask(kind, rest)  # type: ignore[arg-type]
    if kind == "hf":
        path, _, query = rest.partition("?")
        if not path:
            raise TaskError(f"task spec {spec!r} names no data; e.g. hf:problems.jsonl?prompt=question&answer=answer")
        return HfTask(path, text_options(query, spec))
    if kind == "py":
        if not rest:
            raise TaskError(f"task spec {spec!r} names no factory; e.g. py:my_task:make_task")
        return plugin_task(rest)
    if kind in installed_task_kinds():
        return entry_point_task(kind, rest)
    raise TaskError(
        f"unknown task kind {kind!r} in spec {spec!r}.{did_you_mean(kind, TASK_KINDS)} Valid forms: {_SPEC_HELP}"
    )


def task_for_id(task_id: str, known: Iterable[Task] = ()) -> Task:
    """The task able to regenerate ``task_id``: one of ``known`` that owns it, else one
    rebuilt from the id itself (toy and gym); TaskError when neither works."""
    for task in known:
        if task.owns(task_id):
            return task
    kind = task_id.split("/", 1)[0] if isinstance(task_id, str) else ""
    if kind == "toy":
        parts = task_id.split("/")
        if len(parts) != 3:
            raise TaskError(f"task id {task_id!r} is not of the form toy/<split>/<n>")
        return ToyTask(parts[1])
    if kind == "gym":
        return GymTask.from_id(task_id)
    if kind in ("gsm8k", "math500"):
        raise TaskError(
            f"task id {task_id!r} needs the local {kind} file: build the task with "
            f'get_task("{kind}:<file.jsonl>") and pass it in known'
        )
    if kind == "hf":
        raise TaskError(
            f"task id {task_id!r} needs the local data it was drawn from: build the task with "
            'get_task("hf:<path>?prompt=<column>&answer=<column>") and pass it in known'
        )
    raise TaskError(f"task id {task_id!r} has an unknown kind; valid kinds: {', '.join(TASK_KINDS)}")


__all__ = [
    "NUMERIC_GYM_DATASETS",
    "TASK_KINDS",
    "TOY_SPLITS",
    "GymTask",
    "HfTask",
    "JsonlTask",
    "Problem",
    "RewardedTask",
    "Rng",
    "Task",
    "TaskError",
    "ToyTask",
    "answers_match",
    "extract_boxed",
    "extract_hash_answer",
    "extract_tagged",
    "format_instruction",
    "get_task",
    "gym_dataset_names",
    "parse_number",
    "tagged_reward",
    "task_for_id",
    "toy_completion",
    "with_rewards",
]
