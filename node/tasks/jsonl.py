"""GSM8K and MATH-500 read from local JSON Lines files.

No package ships these datasets, so the user points the node at files they hold:

- GSM8K: one object per line, ``{"question": "...", "answer": "... #### 42"}``
  (the layout of openai/gsm8k's train.jsonl / test.jsonl);
- MATH-500: ``{"problem": "...", "answer": "..."}`` or, without ``answer``,
  ``{"problem": "...", "solution": "... \\boxed{...} ..."}`` (HuggingFaceH4/MATH-500).

Ids are ``gsm8k/<line index>`` and ``math500/<line index>``, counting non-blank lines
from 0. Every node of a swarm must hold the same file; ``JsonlTask.digest`` (SHA-256
of the file) lets nodes check that they do.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from node.tasks.answer import extract_boxed, extract_hash_answer, format_instruction
from node.tasks.base import Problem, Rng, Task, TaskError, draw_int, parse_index

JsonlKind = Literal["gsm8k", "math500"]

_FORMATS: dict[str, str] = {
    "gsm8k": '{"question": "...", "answer": "... #### 42"}',
    "math500": '{"problem": "...", "answer": "..."} or {"problem": "...", "solution": "... \\boxed{42}"}',
}


def _reference(kind: str, record: dict, where: str) -> tuple[str, str]:
    """(question, reference answer) of one record, or TaskError saying what is missing."""
    if kind == "gsm8k":
        question, solution = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise TaskError(f"{where}: a GSM8K record needs string fields 'question' and 'answer'")
        answer = extract_hash_answer(solution)
        if answer is None:
            raise TaskError(f"{where}: GSM8K 'answer' has no '#### <number>' line")
        return question, answer.replace(",", "")
    question = record.get("problem")
    if not isinstance(question, str):
        raise TaskError(f"{where}: a MATH-500 record needs a string field 'problem'")
    answer = record.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        solution = record.get("solution")
        answer = extract_boxed(solution) if isinstance(solution, str) else None
        if answer is None:
            raise TaskError(f"{where}: a MATH-500 record needs 'answer', or a 'solution' with \\boxed{{...}}")
    return question, answer.strip()


class JsonlTask(Task):
    """Problems read once from a local JSONL file."""

    def __init__(self, kind: JsonlKind, path: str | Path) -> None:
        if kind not in _FORMATS:
            raise TaskError(f"unknown JSONL task kind {kind!r}; valid kinds: {', '.join(_FORMATS)}")
        path = Path(path).expanduser()
        expected = f"Expected a JSON Lines file, one object per line: {_FORMATS[kind]}"
        if not path.is_file():
            raise TaskError(f"{kind} file not found: {path}. {expected}")
        raw = path.read_bytes()
        self.digest = hashlib.sha256(raw).hexdigest()
        self._items: list[tuple[str, str]] = []
        for lineno, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{where}: not valid JSON ({exc.msg}). {expected}") from exc
            if not isinstance(record, dict):
                raise TaskError(f"{where}: each line must be a JSON object. {expected}")
            self._items.append(_reference(kind, record, where))
        if not self._items:
            raise TaskError(f"{kind} file {path} holds no problems. {expected}")
        self.kind, self.path = kind, path
        self.name = f"{kind}:{path}"
        self.id_prefix = f"{kind}/"

    def __len__(self) -> int:
        return len(self._items)

    def sample(self, rng: Rng) -> str:
        return f"{self.id_prefix}{draw_int(rng, 0, len(self._items) - 1)}"

    def problem(self, task_id: str) -> Problem:
        index = parse_index(self._check_owned(task_id), task_id)
        if index >= len(self._items):
            raise TaskError(f"task id {task_id!r}: {self.path} has only {len(self._items)} problems")
        question, answer = self._items[index]
        prompt = f"{question.strip()}\n{format_instruction()}"
        return Problem(task_id=task_id, prompt=prompt, answer=answer, meta={"source": str(self.path)})
