"""A task from the user's own local data, read with Hugging Face's `datasets`:

    hf:<path>[?split=S&prompt=<column>&answer=<column>&instruction=none]

``<path>`` is a JSON Lines / JSON or CSV file, a parquet file or a folder of them, or a
folder written by ``Dataset.save_to_disk``. Nothing is downloaded. ``prompt`` and ``answer``
name the columns (default: ``prompt`` and ``answer``; ``answer=`` with no value for data
without references, when a ``--reward`` scores on its own). Unless ``instruction=none``,
each prompt ends with the sentence asking for an ``<answer>`` tag, as the default reward
reads the answer there.

Ids are ``hf/<digest>/<row index>``: the digest (12 hex of SHA-256 over the chosen columns and
every row) is part of each id, so a peer holding other data, or the same data read with other
columns, does not own our ids and its groups are rejected as another task's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from node.tasks.answer import format_instruction
from node.tasks.base import Problem, Rng, Task, TaskError, draw_int, parse_index

__all__ = ["HfTask"]

_OPTIONS = ("split", "prompt", "answer", "instruction")
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_FORMS = "a .jsonl, .json, .csv or .parquet file, a folder of parquet files, or a save_to_disk folder"


def _load(path: Path, split: str | None) -> Any:
    """The `datasets.Dataset` at ``path`` (one split), or TaskError saying what is there instead."""
    try:
        import datasets
    except ImportError:
        raise TaskError("hf: tasks need the datasets library: pip install 'ftis-node[tasks]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if not path.exists():
        raise TaskError(f"no data at {path}; give {_FORMS}")
    try:
        if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir() and any(path.glob("**/*.parquet")):
            loaded = datasets.load_dataset("parquet", data_dir=str(path))
        elif path.is_file() and path.suffix.lower() in _FILE_BUILDERS:
            loaded = datasets.load_dataset(_FILE_BUILDERS[path.suffix.lower()], data_files=str(path))
        else:
            raise TaskError(f"{path} is not {_FORMS}")
    except TaskError:
        raise
    except Exception as err:
        if path.is_file() and not path.read_bytes().strip():
            raise TaskError(
                f"{path} holds no rows; a task needs at least one problem"
            ) from None  # the library's own reasons: a malformed file, a bad folder
        raise TaskError(f"{path} could not be read as a dataset ({type(err).__name__}: {err})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None:
            if len(splits) > 1 and "train" not in splits:
                raise TaskError(f"{path} has splits {', '.join(splits)}; pick one with ?split=<name>")
            split = "train" if "train" in splits else splits[0]
        if split not in loaded:
            raise TaskError(f"{path} has no split {split!r}; its splits: {', '.join(splits)}")
        return loaded[split]
    if split is not None and split != "train":
        raise TaskError(f"{path} holds one split; drop ?split={split}")
    return loaded


def _text(value: Any, column: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list):  # TRL's conversational layout
        raise TaskError(
            f"{where}: column {column!r} holds a list (chat messages?); give a column of text "
            "(--chat-template wraps it as the user's message)"
        )
    raise TaskError(f"{where}: column {column!r} holds {type(value).__name__}, not text")


class HfTask(Task):
    """Rows of a local dataset; every row is one problem."""

    def __init__(self, path: str, options: dict[str, str]) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TaskError(f"unknown option(s) {', '.join(unknown)}; hf: takes {', '.join(_OPTIONS)}")
        instruction = options.get("instruction", "tagged")
        if instruction not in ("tagged", "none"):
            raise TaskError(f"instruction={instruction}: use instruction=none, or leave it out")
        self.path = Path(path).expanduser()
        dataset = _load(self.path, options.get("split"))
        self.prompt_column = options.get("prompt", "prompt")
        self.answer_column = options.get("answer", "answer") or None
        for role, column in (("prompt", self.prompt_column), ("answer", self.answer_column)):
            if column is not None and column not in dataset.column_names:
                raise TaskError(
                    f"{self.path} has no column {column!r} for the {role}; its columns: "
                    f"{', '.join(dataset.column_names)}. Name one with ?{role}=<column>"
                )
        self.rows: list[dict[str, Any]] = dataset.to_list()
        if not self.rows:
            raise TaskError(f"{self.path} holds no rows; a task needs at least one problem")
        for i, row in enumerate(self.rows):  # a bad cell fails now, not in the middle of a round
            _text(row[self.prompt_column], self.prompt_column, f"{self.path} row {i}")
            if self.answer_column is not None:
                _text(row[self.answer_column], self.answer_column, f"{self.path} row {i}")
        self.instruction = instruction == "tagged"
        digest = hashlib.sha256(json.dumps([self.prompt_column, self.answer_column, instruction]).encode())
        for row in self.rows:  # values as text: a CSV's 6 and a JSONL's "6" are the same data
            canonical = {k: v if isinstance(v, (list, dict)) else str(v) for k, v in row.items()}
            digest.update(json.dumps(canonical, sort_keys=True, default=str).encode() + b"\n")
        self.digest = digest.hexdigest()
        self.name = f"hf:{path}"
        self.id_prefix = f"hf/{self.digest[:12]}/"

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, rng: Rng) -> str:
        return f"{self.id_prefix}{draw_int(rng, 0, len(self.rows) - 1)}"

    def problem(self, task_id: str) -> Problem:
        index = parse_index(self._check_owned(task_id), task_id)
        if index >= len(self.rows):
            raise TaskError(f"task id {task_id!r}: {self.path} has only {len(self.rows)} rows")
        row = self.rows[index]
        prompt = _text(row[self.prompt_column], self.prompt_column, task_id).strip()
        if self.instruction:
            prompt = f"{prompt}\n{format_instruction()}"
        answer = "" if self.answer_column is None else _text(row[self.answer_column], self.answer_column, task_id)
        return Problem(task_id=task_id, prompt=prompt, answer=answer.strip(), meta={"columns": dict(row)})
