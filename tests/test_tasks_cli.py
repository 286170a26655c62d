"""`ftis-node train` on your own data, reward and task, run as a user runs it: the real CLI in a
fresh process, from the folder that holds the user's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner

from node.console.cli import app
from tests.test_tasks_custom import docs_example, write_rows

REPO = Path(__file__).resolve().parents[1]
# Small rounds: the point is that they run, not what they learn.
SHORT = ["--model", "tiny-s", "--prompts-per-round", "2", "--group-size", "4", "--max-tokens", "8", "--threads", "1"]


def ftis(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "node.console.cli", "train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def train_rounds(cwd: Path, rounds: int, *args: str) -> dict:
    """`ftis-node train` with the small rounds for `rounds` rounds: its status.json, once it exited 0."""
    done = ftis(cwd, *SHORT, *args, "--rounds", str(rounds), "--data-dir", str(cwd / "n"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    status = json.loads((cwd / "n" / "status.json").read_text())
    assert status["rounds_done"] == rounds and status["phase"] == "stopped"
    return status


@pytest.mark.timeout(900)
def test_own_data_and_reward_train_two_rounds(tmp_path) -> None:
    write_rows(tmp_path / "problems.jsonl")
    (tmp_path / "my_rewards.py").write_text(docs_example("my_rewards.py"))
    status = train_rounds(tmp_path, 2, "--task", "hf:problems.jsonl?prompt=q&answer=a", "--reward", "my_rewards:exact")
    assert status["task"] == "hf:problems.jsonl?prompt=q&answer=a"
    assert status.get("reward_faults") is None  # the docs' function returned a good value every time


@pytest.mark.timeout(900)
def test_the_docs_task_trains_three_rounds(tmp_path) -> None:
    (tmp_path / "my_task.py").write_text(docs_example("my_task.py"))
    train_rounds(tmp_path, 3, "--task", "py:my_task:make?limit=20")


BAD_INPUT = {
    "module that does not import": (["--task", "py:my_nowhere:make"], "module 'my_nowhere' does not import"),
    "missing function": (["--task", "toy", "--reward", "my_rewards:nope"], "module 'my_rewards' has no 'nope'"),
    "reward module that does not import": (
        ["--task", "toy", "--reward", "my_nowhere:f"],
        "module 'my_nowhere' does not import",
    ),
    "factory that raises": (["--task", "py:my_factories:boom"], "raised ValueError: no such level"),
    "dataset without the named column": (
        ["--task", "hf:problems.jsonl?prompt=question"],
        "no column 'question' for the prompt",
    ),
    "empty dataset": (["--task", "hf:empty.jsonl?prompt=q&answer=a"], "holds no rows"),
    "chat messages as prompt": (["--task", "hf:chat.jsonl?prompt=msgs&answer=a"], "holds a list"),
    "weights without reward": (["--task", "toy", "--reward-weights", "1"], "--reward-weights needs --reward"),
}


@pytest.mark.timeout(600)
def test_bad_input_is_one_error_line_and_exit_2_before_anything_starts(tmp_path) -> None:
    write_rows(tmp_path / "problems.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "chat.jsonl").write_text('{"msgs": [{"role": "user", "content": "hi"}], "a": "1"}\n')
    (tmp_path / "my_rewards.py").write_text(docs_example("my_rewards.py"))
    (tmp_path / "my_factories.py").write_text("def boom(**kw):\n    raise ValueError('no such level')\n")

    def run(case: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        args, _ = BAD_INPUT[case]
        return case, ftis(
            tmp_path, *args, "--rounds", "1", "--data-dir", str(tmp_path / case.replace(" ", "-")), timeout=300
        )

    with ThreadPoolExecutor(4) as pool:
        results = dict(pool.map(run, BAD_INPUT))
    for case, done in results.items():
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (case, done.stdout, done.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, done.stderr)
        assert BAD_INPUT[case][1] in lines[0], (case, lines[0])
        assert not (tmp_path / case.replace(" ", "-") / "status.json").exists(), case  # nothing started


@pytest.mark.timeout(900)
def test_a_reward_that_fails_is_counted_and_the_run_goes_on(tmp_path) -> None:
    (tmp_path / "my_flaky.py").write_text(
        "def flaky(prompts, completions, **columns):\n"
        "    if len(completions[0]) % 2:\n"
        "        raise ValueError('odd length')\n"
        "    return [float('nan')]\n"
    )
    status = train_rounds(tmp_path, 2, "--task", "toy", "--reward", "my_flaky:flaky")
    faults = status["reward_faults"]
    assert faults["failed"] == 2 * 2 * 4  # every completion of both rounds
    assert "my_flaky:flaky" in faults["last"]
    # The operator sees it: a warning in the round that had them, and the count in `ftis-node status`.
    assert any("8 --reward value(s) this round were bad" in n for n in status["notices"]), status["notices"]
    shown = CliRunner().invoke(app, ["status", str(tmp_path / "n")], env={"COLUMNS": "120"})
    assert "reward faults: failed 16 (last: my_flaky:flaky raised ValueError: odd length" in shown.output or (
        "reward faults: failed 16 (last: my_flaky:flaky returned nan" in shown.output
    ), shown.output
