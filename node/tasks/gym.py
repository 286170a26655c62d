"""reasoning-gym datasets as tasks.

reasoning-gym's procedural datasets are deterministic functions of (config, seed,
index), so an id that spells all three out lets any node regenerate the problem:

    gym/<dataset>/s<seed>/<index>                 default config
    gym/<dataset>?<key>=<value>&.../s<seed>/<index>  keys sorted, values canonical

The spec form is ``gym:<dataset>?seed=3&max_terms=3``; every key except ``seed``
goes to the dataset's own config class (``size`` included: some datasets, such as
``gsm_symbolic``, pick their templates from it, so it is part of the id when given).

Scoring uses the dataset's own ``score_answer`` on the text inside the answer tags,
kept binary (a partial score counts as wrong); for numeric references the project's
tolerant compare also accepts "214.0" for "214".
"""

from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from typing import Any

from node.console.suggest import did_you_mean
from node.tasks.answer import answers_match, extract_tagged, format_instruction, parse_number
from node.tasks.base import MAX_TASK_ID_CHARS, Problem, Rng, Task, TaskError, draw_int, parse_index

#: Datasets with short numeric answers that suit the tagged-answer reward best.
NUMERIC_GYM_DATASETS: tuple[str, ...] = (
    "basic_arithmetic",
    "chain_sum",
    "products",
    "decimal_chain_sum",
    "gcd",
    "lcm",
    "leg_counting",
    "count_bits",
    "gsm_symbolic",
)
DEFAULT_SIZE = 10_000
_VALUE_RE = re.compile(r"[A-Za-z0-9_.+\-]+")  # no '/', '&', '=' or spaces: ids stay parseable


def _registry() -> dict[str, Any]:
    import reasoning_gym  # imported lazily: it pulls sympy and friends (~1 s)
    from reasoning_gym.factory import DATASETS

    del reasoning_gym
    return DATASETS


def gym_dataset_names() -> list[str]:
    """All dataset names reasoning-gym registers."""
    return sorted(_registry())


def _parse_value(text: str) -> int | float | bool | str:
    """Config values arrive as text; give the dataclass the type it expects."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _render_value(value: int | float | bool | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def parse_query(query: str, where: str) -> dict[str, int | float | bool | str]:
    """``a=1&b=x`` -> {"a": 1, "b": "x"}; TaskError on malformed pairs or characters."""
    params: dict[str, int | float | bool | str] = {}
    if not query:
        return params
    for pair in query.split("&"):
        key, sep, raw = pair.partition("=")
        if not sep or not key or not raw:
            raise TaskError(f"{where}: expected key=value, got {pair!r}")
        if not _VALUE_RE.fullmatch(key) or not _VALUE_RE.fullmatch(raw):
            raise TaskError(f"{where}: {pair!r} has characters outside [A-Za-z0-9_.+-]")
        if key in params:
            raise TaskError(f"{where}: {key!r} given twice")
        params[key] = _parse_value(raw)
    return params


def _check_config(dataset: str, config_cls: type, config: dict[str, Any]) -> None:
    """Reject unknown keys and values whose type differs from the field's default, with
    the valid keys listed (the dataclass's own errors do not say which key is wrong)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.name != "seed"}
    for key, value in config.items():
        if key not in fields:
            raise TaskError(
                f"reasoning-gym dataset {dataset!r} has no option {key!r}; "
                f"valid options: seed, {', '.join(sorted(fields))}"
            )
        default = fields[key].default
        if default is None or default is dataclasses.MISSING:
            continue  # no default to learn the type from; the dataclass validates it
        if isinstance(default, bool) or isinstance(value, bool):
            ok = isinstance(default, bool) and isinstance(value, bool)
        elif isinstance(default, (int, float)):
            ok = isinstance(value, int) if isinstance(default, int) else isinstance(value, (int, float))
        else:
            ok = isinstance(value, type(default))
        if not ok:
            raise TaskError(
                f"reasoning-gym option {key}={_render_value(value)!r} for {dataset!r}: "
                f"expected {type(default).__name__} (default {default!r})"
            )


class GymTask(Task):
    """One reasoning-gym dataset with a fixed config and seed."""

    def __init__(self, dataset: str, seed: int = 0, **config: int | float | bool | str) -> None:
        names = _registry()
        if dataset not in names:
            raise TaskError(
                f"unknown reasoning-gym dataset {dataset!r}.{did_you_mean(dataset, names)} "
                f"Numeric ones that suit this project: "
                f"{', '.join(NUMERIC_GYM_DATASETS)}. All: {', '.join(sorted(names))}"
            )
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise TaskError(f"gym seed must be a non-negative integer, got {seed!r}")
        for key, value in config.items():
            if not _VALUE_RE.fullmatch(key) or not _VALUE_RE.fullmatch(_render_value(value)):
                raise TaskError(f"gym config {key}={value!r} has characters outside [A-Za-z0-9_.+-]")
        dataset_cls, config_cls = names[dataset]
        _check_config(dataset, config_cls, config)
        self.size = int(config.get("size", DEFAULT_SIZE))
        if self.size < 1:
            raise TaskError(f"gym size must be positive, got {self.size}")
        try:
            cfg = config_cls(**{**config, "seed": seed, "size": self.size})
            self._dataset = dataset_cls(config=cfg)
        except (TypeError, AssertionError, ValueError) as exc:
            raise TaskError(f"bad config for reasoning-gym dataset {dataset!r}: {exc}") from exc

        self.dataset, self.seed, self.config = dataset, seed, dict(sorted(config.items()))
        query = "&".join(f"{k}={_render_value(v)}" for k, v in self.config.items())
        self.id_prefix = f"gym/{dataset}{'?' + query if query else ''}/s{seed}/"
        self.name = f"gym:{dataset}?" + "&".join([f"seed={seed}", *filter(None, [query])])
        if len(self.id_prefix) + len(str(self.size)) > MAX_TASK_ID_CHARS:
            raise TaskError(f"gym config too long: its task ids would exceed {MAX_TASK_ID_CHARS} characters")

    @classmethod
    def from_id(cls, task_id: str) -> GymTask:
        """The task that issued ``task_id`` (its dataset, config and seed are in the id)."""
        parts = task_id.split("/")
        if len(parts) != 4 or parts[0] != "gym" or not parts[2].startswith("s"):
            raise TaskError(f"task id {task_id!r} is not of the form gym/<dataset>[?config]/s<seed>/<index>")
        dataset, _, query = parts[1].partition("?")
        seed = parse_index(parts[2][1:], task_id, "seed")
        return _cached_gym(dataset, seed, tuple(parse_query(query, f"task id {task_id!r}").items()))

    def sample(self, rng: Rng) -> str:
        return f"{self.id_prefix}{draw_int(rng, 0, self.size - 1)}"

    def _entry(self, task_id: str) -> dict[str, Any]:
        index = parse_index(self._check_owned(task_id), task_id)
        if index >= self.size:
            raise TaskError(f"task id {task_id!r}: index is outside this dataset's size {self.size}")
        return self._dataset[index]

    def problem(self, task_id: str) -> Problem:
        entry = self._entry(task_id)
        prompt = f"{entry['question'].rstrip()}\n{format_instruction()}"
        return Problem(
            task_id=task_id,
            prompt=prompt,
            answer=str(entry["answer"]),
            meta={"dataset": self.dataset, "question": entry["question"]},
        )

    def reward(self, problem: Problem, completion: str) -> float:
        inner = extract_tagged(completion)
        if inner is None:
            return 0.0
        entry = self._entry(problem.task_id)  # rebuilt locally: the verifier trusts only the id
        try:
            score = float(self._dataset.score_answer(inner, entry))
        except Exception:  # a dataset's scorer choking on odd model text is a wrong answer
            score = 0.0
        if score >= 1.0:
            return 1.0
        reference = str(entry["answer"])
        if parse_number(reference) is not None and answers_match(inner, reference):
            return 1.0
        return 0.0


@lru_cache(maxsize=64)
def _cached_gym(dataset: str, seed: int, config: tuple[tuple[str, Any], ...]) -> GymTask:
    return GymTask(dataset, seed=seed, **dict(config))
