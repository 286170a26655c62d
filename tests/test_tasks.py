"""Tasks: ids regenerate problems, rewards are binary and strict about the format."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from node.tasks import (
    GymTask,
    JsonlTask,
    Problem,
    TaskError,
    ToyTask,
    answers_match,
    extract_boxed,
    extract_hash_answer,
    extract_tagged,
    get_task,
    parse_number,
    tagged_reward,
    task_for_id,
    toy_completion,
)

# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("12", "12"),
        ("12.0", "12"),
        ("12.00", "12.0"),
        ("1,200", "1200"),
        ("-3", "-3.0"),
        ("3/4", "0.75"),
        ("\\frac{3}{4}", "0.75"),
        ("$42$", "42"),
        ("42.", "42"),
        ("1e3", "1000"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("50\\%", "50"),
        ("10 \\text{ cm}", "10"),
    ],
)
def test_answers_match_equivalent_spellings(predicted: str, reference: str) -> None:
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("13", "12"),
        ("1,2", "12"),
        ("0.333", "1/3"),
        ("12", "x"),
        ("", ""),
        ("1/0", "1"),
        ("-12", "12"),
        ("\\frac{3}{5}", "0.75"),
    ],
)
def test_answers_match_rejects_different_answers(predicted: str, reference: str) -> None:
    assert not answers_match(predicted, reference)


def test_parse_number_is_exact_for_decimals() -> None:
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert parse_number("abc") is None
    assert parse_number("1,234,567.5") == parse_number("1234567.5")


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<answer>19</answer>", 1.0),
        ("<answer> 19 </answer>", 1.0),
        ("We add: 12+7 is 19.\n<answer>19.0</answer>", 1.0),
        ("<answer>19</answer><|endoftext|>", 1.0),
        ("<answer>20</answer>", 0.0),  # wrong
        ("19", 0.0),  # right number, no tags
        ("<answer>19", 0.0),  # unclosed
        ("<answer></answer>", 0.0),  # empty
        ("<answer>19</answer><answer>20</answer>", 0.0),  # hedging with two answers
        ("<answer>19</answer><answer>19</answer>", 0.0),  # two pairs is bad format even if equal
        ("<ANSWER>19</ANSWER>", 0.0),
    ],
)
def test_tagged_reward(completion: str, reward: float) -> None:
    assert tagged_reward(completion, "19") == reward


def test_extractors() -> None:
    assert extract_tagged("a <answer>x\ny</answer> b") == "x\ny"
    assert extract_hash_answer("step 1\nstep 2\n#### 1,200") == "1,200"
    assert extract_hash_answer("no marker") is None
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed{unbalanced") is None


# ---------------------------------------------------------------- toy


def test_toy_ids_are_deterministic_and_self_contained() -> None:
    a, b = ToyTask("id"), ToyTask("id")
    ids1 = [p.task_id for p in a.sample_problems(random.Random(7), 20)]
    ids2 = [p.task_id for p in b.sample_problems(random.Random(7), 20)]
    assert ids1 == ids2
    assert len(set(ids1)) == 20
    # numpy generators work too, and are equally reproducible
    np_ids = [a.sample(np.random.default_rng(3)) for _ in range(2)]
    assert np_ids[0] == np_ids[1]
    for task_id in ids1:
        assert a.problem(task_id) == b.problem(task_id) == task_for_id(task_id).problem(task_id)
    # different ids, different problems (the problem space is large: ~15k distinct prompts)
    assert len({a.problem(task_id).prompt for task_id in ids1}) >= 18


def test_ids_regenerate_in_another_process() -> None:
    """A peer is another process (other hash seed, other import order): same problems."""
    ids = [ToyTask("id").sample(random.Random(i)) for i in range(5)] + ["toy/ood/9"]
    gym = get_task("gym:chain_sum?seed=2")
    ids += [gym.sample(random.Random(i)) for i in range(3)]
    code = (
        "import json, sys; from node.tasks import task_for_id; "
        "print(json.dumps([task_for_id(i).problem(i).model_dump() for i in json.loads(sys.argv[1])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(ids)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == [task_for_id(i).problem(i).model_dump() for i in ids]


def test_toy_answers_are_correct_and_format_is_short() -> None:
    for split in ("id", "add", "sub", "ood"):
        task = ToyTask(split)
        for p in task.sample_problems(random.Random(1), 200):
            expr = p.prompt.removesuffix("=")
            assert p.prompt.endswith("=") and len(p.prompt) <= 12
            assert eval(expr, {"__builtins__": {}}) == int(p.answer) >= 0
            assert task.reward(p, toy_completion(p.answer)) == 1.0
            assert task.reward(p, toy_completion(str(int(p.answer) + 1))) == 0.0
            assert task.reward(p, p.answer) == 0.0


def test_toy_splits_differ() -> None:
    rng = random.Random(0)
    ops = {s: [p.prompt for p in ToyTask(s).sample_problems(rng, 300)] for s in ("id", "add", "sub", "ood")}
    count_ops = lambda prompt: sum(prompt.count(c) for c in "+-")  # noqa: E731
    assert all(count_ops(q) == 1 for q in ops["id"]) and {"+", "-"} <= set("".join(ops["id"]))
    assert all(count_ops(q) == 2 for q in ops["ood"])  # OOD: longer expressions than ID
    assert all("-" not in q for q in ops["add"]) and all("+" not in q for q in ops["sub"])
    assert ToyTask("ood").problem("toy/ood/5") != ToyTask("id").problem("toy/id/5")


def test_toy_rejects_bad_ids() -> None:
    task = ToyTask("id")
    for bad in ["toy/ood/1", "toy/id/-1", "toy/id/01", "toy/id/x", "toy/id/99999999999", "gym/x/s0/1", "toy/id/²"]:
        with pytest.raises(TaskError):
            task.problem(bad)
    with pytest.raises(TaskError, match="valid splits"):
        ToyTask("big")


# ---------------------------------------------------------------- reasoning-gym


def test_gym_regenerates_identically_from_the_id() -> None:
    task = get_task("gym:chain_sum?seed=3&max_terms=3")
    assert isinstance(task, GymTask)
    ids = [task.sample(random.Random(i)) for i in range(8)]
    for task_id in ids:
        assert task_id.startswith("gym/chain_sum?max_terms=3/s3/")
        fresh = GymTask.from_id(task_id)  # what a receiving node does
        assert fresh.problem(task_id) == task.problem(task_id)
        assert fresh.problem(task_id).prompt.count("+") + fresh.problem(task_id).prompt.count("-") <= 2
    # the seed is part of the problem: another seed gives another problem at the same index
    other = get_task("gym:chain_sum?seed=4&max_terms=3")
    assert other.problem(other.id_prefix + "0") != task.problem(task.id_prefix + "0")
    # the spec printed as the name rebuilds the same task
    assert get_task(task.name).id_prefix == task.id_prefix


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "products", "gcd", "lcm", "gsm_symbolic"])
def test_gym_reward_uses_tags_and_the_datasets_scorer(dataset: str) -> None:
    task = get_task(f"gym:{dataset}?size=200")
    for task_id in [task.sample(random.Random(i)) for i in range(5)]:
        p = task.problem(task_id)
        assert "<answer>" in p.prompt  # the prompt states the format
        assert task.reward(p, f"Let me think.\n<answer>{p.answer}</answer>") == 1.0
        assert task.reward(p, p.answer) == 0.0  # right answer, wrong format
        assert task.reward(p, "<answer>definitely not it</answer>") == 0.0


def test_gym_numeric_tolerance_and_partial_scores_are_binary() -> None:
    task = get_task("gym:chain_sum")
    p = task.problem(task.id_prefix + "11")
    assert task.reward(p, f"<answer>{p.answer}.0</answer>") == 1.0
    # reasoning-gym's default scorer gives partial credit when the answer is contained;
    # the project's reward is binary, so that is a 0
    assert task.reward(p, f"<answer>{p.answer} or {int(p.answer) + 1}</answer>") == 0.0


def test_gym_errors_are_clear() -> None:
    with pytest.raises(TaskError, match="chain_sum"):
        get_task("gym:no_such_dataset")
    with pytest.raises(TaskError, match="valid options"):
        get_task("gym:chain_sum?bogus=1")
    with pytest.raises(TaskError, match="expected int"):
        get_task("gym:chain_sum?max_terms=three")
    with pytest.raises(TaskError, match="key=value"):
        get_task("gym:chain_sum?seed")
    with pytest.raises(TaskError, match="outside"):
        get_task("gym:chain_sum?size=10").problem("gym/chain_sum?size=10/s0/10")
    with pytest.raises(TaskError):
        GymTask.from_id("gym/chain_sum/0/1")


# ---------------------------------------------------------------- JSONL (GSM8K, MATH-500)


def _write_jsonl(path, records) -> None:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")


def test_gsm8k_from_jsonl(tmp_path) -> None:
    path = tmp_path / "train.jsonl"
    _write_jsonl(
        path,
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
            {"question": "A farm sells 1,000 eggs twice.", "answer": "1000*2=2000\n#### 2,000"},
        ],
    )
    task = get_task(f"gsm8k:{path}")
    assert isinstance(task, JsonlTask) and len(task) == 2
    p = task.problem("gsm8k/1")
    assert p.answer == "2000" and "1,000 eggs" in p.prompt and "<answer>" in p.prompt
    assert task.reward(p, "<answer>2,000</answer>") == 1.0
    assert task.reward(p, "<answer>2000.0</answer>") == 1.0
    assert task.reward(p, "#### 2000") == 0.0
    assert {task.sample(random.Random(i)) for i in range(40)} == {"gsm8k/0", "gsm8k/1"}
    assert task_for_id("gsm8k/0", known=[task]) is task
    with pytest.raises(TaskError, match="only 2 problems"):
        task.problem("gsm8k/2")
    with pytest.raises(TaskError, match="local gsm8k file"):
        task_for_id("gsm8k/0")


def test_math500_from_jsonl_answer_or_boxed(tmp_path) -> None:
    path = tmp_path / "math500.jsonl"
    _write_jsonl(
        path,
        [
            {"problem": "Simplify 6/8.", "answer": "\\frac{3}{4}", "level": 1},
            {"problem": "What is 2^3?", "solution": "We get $2^3 = \\boxed{8}$."},
        ],
    )
    task = get_task(f"math500:{path}")
    assert task.problem("math500/0").answer == "\\frac{3}{4}"
    assert task.problem("math500/1").answer == "8"
    assert task.reward(task.problem("math500/0"), "<answer>0.75</answer>") == 1.0
    assert task.reward(task.problem("math500/0"), "<answer>\\dfrac{3}{4}</answer>") == 1.0
    assert task.reward(task.problem("math500/1"), "<answer>9</answer>") == 0.0


def test_jsonl_errors_name_the_file_and_format(tmp_path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TaskError) as err:
        get_task(f"gsm8k:{missing}")
    assert str(missing) in str(err.value) and "#### 42" in str(err.value)
    with pytest.raises(TaskError, match="boxed"):
        get_task(f"math500:{missing}")
    bad = tmp_path / "bad.jsonl"
    _write_jsonl(bad, [{"question": "q", "answer": "no marker here"}])
    with pytest.raises(TaskError, match="####"):
        get_task(f"gsm8k:{bad}")
    bad.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(TaskError, match=r"bad.jsonl:1"):
        get_task(f"gsm8k:{bad}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(TaskError, match="no problems"):
        get_task(f"gsm8k:{empty}")


# ---------------------------------------------------------------- specs


@pytest.mark.parametrize("spec", ["", "nope", "toy:big", "toy:id?x=1", "gym:", "gsm8k:", "math500:"])
def test_bad_specs_list_the_valid_forms(spec: str) -> None:
    with pytest.raises(TaskError):
        get_task(spec)


def test_unknown_kind_lists_valid_forms() -> None:
    with pytest.raises(TaskError, match=r"toy\[:id\|ood\|add\|sub\].*gym:.*gsm8k:.*math500:"):
        get_task("squad:x")


def test_specs_build_the_right_tasks() -> None:
    assert get_task("toy").name == "toy:id"
    assert get_task("toy:ood").name == "toy:ood"
    assert get_task("gym:basic_arithmetic").name == "gym:basic_arithmetic?seed=0"
    assert get_task("gym:chain_sum?seed=3").id_prefix == "gym/chain_sum/s3/"
    with pytest.raises(TaskError, match="unknown kind"):
        task_for_id("squad/1")


def test_problem_is_immutable() -> None:
    p = ToyTask().problem("toy/id/3")
    assert isinstance(p, Problem)
    with pytest.raises(Exception):
        p.answer = "0"  # type: ignore[misc]
