"""Your own data (`hf:`), reward (`--reward`) and task (`py:`), in process: what each builds,
the ids peers check, and the values a reward function gets wrong."""

from __future__ import annotations

import json
import math
import random
import re
import sys
from pathlib import Path

import pytest

from node.tasks import HfTask, RewardedTask, TaskError, get_task, task_for_id, with_rewards

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"


def docs_example(filename: str) -> str:
    """The code block of docs/tasks.md that starts with `# <filename>`: the tests run what users copy."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    return next(b for b in blocks if b.startswith(f"# {filename}\n"))


def write_rows(path: Path, n: int = 16) -> Path:
    path.write_text(
        "".join(json.dumps({"q": f"What is {i} + {i}?", "a": str(2 * i), "level": i % 3}) + "\n" for i in range(n))
    )
    return path


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """A folder importable as the working directory, as for a user's own module."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("my_", "bad_"))]:
        del sys.modules[name]


# ---------------------------------------------------------------- hf:


def test_hf_jsonl_rows_are_problems_named_by_row_and_digest(tmp_path) -> None:
    task = get_task(f"hf:{write_rows(tmp_path / 'p.jsonl')}?prompt=q&answer=a")
    assert isinstance(task, HfTask) and len(task) == 16
    assert re.fullmatch(r"hf/[0-9a-f]{12}/", task.id_prefix)
    p = task.problem(f"{task.id_prefix}3")
    assert p.prompt.startswith("What is 3 + 3?\n") and "<answer>" in p.prompt and p.answer == "6"
    assert p.meta["columns"] == {"q": "What is 3 + 3?", "a": "6", "level": 0}
    assert task.reward(p, "<answer>6</answer>") == 1.0 and task.reward(p, "<answer>7</answer>") == 0.0
    assert {task.sample(random.Random(i)) for i in range(200)} == {f"{task.id_prefix}{i}" for i in range(16)}
    with pytest.raises(TaskError, match="only 16 rows"):
        task.problem(f"{task.id_prefix}16")
    assert task_for_id(f"{task.id_prefix}3", known=[task]) is task
    with pytest.raises(TaskError, match="needs the local data"):
        task_for_id(f"{task.id_prefix}3")


def test_same_rows_in_any_format_are_the_same_task_other_rows_are_not(tmp_path) -> None:
    import datasets

    rows = [{"q": f"{i}+{i}", "a": str(2 * i)} for i in range(5)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_csv(str(tmp_path / "p.csv"), index=False)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefixes = {
        get_task(f"hf:{tmp_path / name}?prompt=q&answer=a").id_prefix
        for name in ("p.csv", "p.parquet", "saved", "p.jsonl")
    }
    assert len(prefixes) == 1  # peers holding the same rows in other files own each other's ids
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    other = get_task(f"hf:{tmp_path / 'other.jsonl'}?prompt=q&answer=a")
    assert other.id_prefix not in prefixes and not other.owns(f"{prefixes.pop()}0")
    plain = get_task(f"hf:{tmp_path / 'p.jsonl'}?prompt=q&answer=a&instruction=none")
    assert plain.problem(f"{plain.id_prefix}1").prompt == "1+1"


@pytest.mark.parametrize(
    ("query", "rows", "message"),
    [
        (
            "prompt=question&answer=a",
            None,
            r"no column 'question' for the prompt; its columns: q, a, level\. Name one with \?prompt=",
        ),
        ("prompt=q&answer=solution", None, r"no column 'solution' for the answer"),
        ("prompt=q&answer=a", "", r"holds no rows"),
        ("prompt=q&answer=a&split=test", None, r"no split 'test'"),
        ("prompt=q&answer=a&colour=red", None, r"unknown option\(s\) colour"),
        (
            "prompt=msgs&answer=a",
            '{"msgs": [{"role": "user", "content": "hi"}], "a": "1"}\n',
            r"column 'msgs' holds a list",
        ),
    ],
)
def test_hf_bad_data_says_what_to_type(tmp_path, query, rows, message) -> None:
    path = write_rows(tmp_path / "p.jsonl")
    if rows is not None:
        path.write_text(rows)
    with pytest.raises(TaskError, match=message):
        get_task(f"hf:{path}?{query}")


def test_hf_missing_file_names_the_forms(tmp_path) -> None:
    with pytest.raises(TaskError, match=r"no data at .*nope.jsonl; give a .jsonl"):
        get_task(f"hf:{tmp_path / 'nope.jsonl'}?prompt=q")


# ---------------------------------------------------------------- --reward


def test_reward_functions_get_trl_arguments_and_are_weighted(on_path) -> None:
    (on_path / "my_rewards.py").write_text(
        "seen = []\n"
        "def exact(prompts, completions, answer, **columns):\n"
        "    seen.append((prompts, completions, answer, columns))\n"
        "    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]\n"
        "def short(prompts, completions, **columns):\n"
        "    return [1.0 if len(c) < 10 else 0.0 for c in completions]\n"
    )
    base = get_task(f"hf:{write_rows(on_path / 'p.jsonl')}?prompt=q&answer=a")
    task = with_rewards(base, "my_rewards:exact,my_rewards:short", "3,1")
    assert isinstance(task, RewardedTask) and task.id_prefix == base.id_prefix and task.name == base.name
    p = task.problem(f"{task.id_prefix}2")
    assert task.reward(p, "4") == 1.0
    assert task.reward(p, "the answer is 4") == pytest.approx(0.75)
    assert task.reward(p, "5") == pytest.approx(0.25)
    import my_rewards

    prompts, completions, answer, columns = my_rewards.seen[0]
    assert (
        prompts == [p.prompt]
        and completions == ["4"]
        and answer == ["4"]
        and columns == {"q": ["What is 2 + 2?"], "a": ["4"], "level": [2]}
    )
    assert task.fault_summary() is None
    toy = with_rewards(get_task("toy"), "my_rewards:exact")  # other tasks pass their answer
    q = toy.problem(toy.sample(random.Random(0)))
    assert toy.reward(q, f"= {q.answer}") == 1.0


def test_bad_reward_values_score_zero_or_clamp_and_are_counted(on_path) -> None:
    (on_path / "my_wild.py").write_text(
        "import math\n"
        "def wild(prompts, completions, **columns):\n"
        "    c = completions[0]\n"
        "    if c == 'raise': raise RuntimeError('boom')\n"
        "    return {'nan': [math.nan], 'none': [None], 'big': [7.0], 'neg': [-2], 'two': [1.0, 1.0],\n"
        "            'text': ['1'], 'tuple': (0.5,)}.get(c, [0.25])\n"
    )
    task = with_rewards(get_task("toy"), "my_wild:wild")
    p = task.problem(task.sample(random.Random(1)))
    got = {c: task.reward(p, c) for c in ("raise", "nan", "none", "big", "neg", "two", "text", "tuple", "ok")}
    assert got == {
        "raise": 0.0,
        "nan": 0.0,
        "none": 0.0,
        "big": 1.0,
        "neg": 0.0,
        "two": 0.0,
        "text": 0.0,
        "tuple": 0.5,
        "ok": 0.25,
    }
    assert all(math.isfinite(v) for v in got.values())
    summary = task.fault_summary()
    assert {k: summary[k] for k in ("failed", "none", "clamped")} == {"failed": 4, "none": 1, "clamped": 2}
    assert "my_wild:wild" in summary["last"]


@pytest.mark.parametrize(
    ("reward", "weights", "message"),
    [
        ("my_nowhere:f", None, r"module 'my_nowhere' does not import .*run from its folder or install it"),
        ("my_rewards:nope", None, r"module 'my_rewards' has no 'nope'; it has THING, exact"),
        ("my_rewards", None, r"not of the form <module>:<name>"),
        ("my_rewards:exact", "1,2", r"2 weight\(s\) for 1 reward function"),
        ("my_rewards:exact", "-1", r"non-negative"),
        ("my_rewards:THING", None, r"is a int, not a function"),
        ("bad_syntax:f", None, r"module 'bad_syntax' does not import \(SyntaxError"),
    ],
)
def test_bad_reward_specs_fail_before_the_run(on_path, reward, weights, message) -> None:
    (on_path / "my_rewards.py").write_text("THING = 3\ndef exact(prompts, completions, **kw):\n    return [1.0]\n")
    (on_path / "bad_syntax.py").write_text("def f(:\n")
    with pytest.raises(TaskError, match=message):
        with_rewards(get_task("toy"), reward, weights)


# ---------------------------------------------------------------- py:


def test_the_docs_task_example_builds_regenerates_and_scores(on_path) -> None:
    source = docs_example("my_task.py")
    assert len(source.strip().splitlines()) <= 20
    (on_path / "my_task.py").write_text(source)
    task = get_task("py:my_task:make?limit=50")
    ids = {task.sample(random.Random(i)) for i in range(100)}
    assert ids <= {f"double/50/{n}" for n in range(51)} and len(ids) > 30
    again = get_task("py:my_task:make?limit=50")  # a peer rebuilds the same problem from the id
    assert again.problem("double/50/21") == task.problem("double/50/21")
    assert task.reward(task.problem("double/50/21"), "<answer>42</answer>") == 1.0
    assert not get_task("py:my_task:make?limit=9").owns("double/50/21")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("py:my_factories:boom", r"task factory 'my_factories:boom' raised ValueError: no such level"),
        ("py:my_factories:not_a_task", r"returned dict, not a node.tasks.Task"),
        ("py:my_factories:missing", r"has no 'missing'"),
        ("py:my_factories:boom?x", r"key=value"),
        ("py:", r"names no factory"),
    ],
)
def test_bad_task_factories_say_what_is_wrong(on_path, spec, message) -> None:
    (on_path / "my_factories.py").write_text(
        "def boom(**kw):\n    raise ValueError('no such level')\ndef not_a_task(**kw):\n    return {}\n"
    )
    with pytest.raises(TaskError, match=message):
        get_task(spec)


def test_an_installed_package_adds_a_task_kind(on_path) -> None:
    # What `pip install` leaves for an entry point: a dist-info folder on the path.
    (on_path / "my_task.py").write_text(
        docs_example("my_task.py") + "\n\ndef from_spec(rest):\n    return make(rest)\n"
    )
    info = on_path / "my_task-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-task\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ftis_node.tasks]\ndouble = my_task:from_spec\n")
    task = get_task("double:30")
    assert task.id_prefix == "double/30/" and task.problem("double/30/4").answer == "8"
    with pytest.raises(TaskError, match=r"unknown task kind 'triple'"):
        get_task("triple:30")


def test_stock_rewards_pay_for_the_tag_and_for_the_answer():
    from node.tasks import get_task, with_rewards
    from node.tasks.stock_rewards import answer_correct, answer_format

    texts = ["<answer>19</answer>", "<answer>19", "<answer>18</answer>", "<answer>1</answer><answer>19</answer>"]
    assert answer_format([""] * 4, texts) == [1.0, 0.0, 1.0, 0.0]
    assert answer_correct([""] * 4, texts, answer=["19"] * 4) == [1.0, 0.0, 0.0, 0.0]
    # As the demo weighs them (1, 3): a quarter for the tag, the rest for the right answer.
    task = with_rewards(
        get_task("toy"),
        "node.tasks.stock_rewards:answer_format,node.tasks.stock_rewards:answer_correct",
        "1,3",
    )
    problem = task.problem("toy/id/7")
    right = f"<answer>{problem.answer}</answer>"
    assert [task.reward(problem, t) for t in (right, right[:-9], "<answer>x</answer>")] == [1.0, 0.0, 0.25]
