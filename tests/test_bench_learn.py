"""The learning benchmark through the real CLI, at tiny settings: a sweep of two learning
rates, each a solo node's real rounds with a held-out eval before and after."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_bench_learn_sweeps_learning_rates_from_one_start(tmp_path):
    out = tmp_path / "learn.json"
    args = ["bench", "learn", "--model", "tiny-s", "--rounds", "2", "--eval-every", "1"]
    args += ["--eval-problems", "4", "--eval-samples", "2", "--lr", "2e-4", "--lr", "1e-3", "--json-out", str(out)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "node.console.cli", *args], capture_output=True, text=True, timeout=280, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())

    assert [run["settings"]["lr"] for run in result["runs"]] == [2e-4, 1e-3]
    for run in result["runs"]:
        # tiny-s has no chat template: the plain defaults, toy task, as `train` would pick.
        assert run["settings"]["task"] == "toy" and run["settings"]["chat_template"] is False
        assert [e["after_rounds"] for e in run["eval"]] == [0, 1, 2]
        assert all(0.0 <= e["reward_mean"] <= 1.0 for e in run["eval"])
        assert len(run["per_round"]) == 2 and all(p["grad_norm"] >= 0 for p in run["per_round"])
        assert run["eval_gain"] == pytest.approx(run["eval"][-1]["reward_mean"] - run["eval"][0]["reward_mean"])
    # Both runs start from the same weights and are scored on the same seeded problems and
    # samples, so their first evals agree exactly: the sweep compares learning rates alone.
    assert result["runs"][0]["eval_before"] == result["runs"][1]["eval_before"]
    # The table names both runs and their curves.
    assert "lr 0.0002" in done.stdout and "lr 0.001" in done.stdout and "eval gain" in done.stdout
    # Progress goes to stderr, one line per round and per eval.
    assert done.stderr.count("round 2/2") == 2
