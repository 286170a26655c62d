"""Checkpoint faults through real `ftis-node` processes: SIGKILL, edited and corrupt checkpoints.

- a node SIGKILLed mid-round and restarted on its data dir resumes from its last
  checkpoint with the same peer id and adapter version, and says what it lost;
- checkpoints follow `--checkpoint-every` (not one per round), through a kill and resume;
- a newest checkpoint whose meta.json was edited is skipped with a warning for the one
  before, and retention sets bad folders aside instead of pruning good ones for them;
- when no checkpoint verifies, `train --resume` and `join` refuse to start (one `error:`
  line, exit 2) and leave the folder as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port as _free_port
from tests.procs import p2pd_pids as _p2pd_pids

SMALL = ["--model", "tiny-s", "--task", "toy", "--prompts-per-round", "2", "--group-size", "4", "--max-tokens", "8"]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
MID_ROUND = {"generating", "publishing", "gathering", "training", "loading weights", "checkpointing"}


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.console.cli", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def _spawn(log: Path, *args: str) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "node.console.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=ENV
    )


def _wait(predicate, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; log:\n{log.read_text()[-3000:]}")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _rounds(ckpts: Path) -> list[str]:
    return sorted(p.name for p in ckpts.iterdir() if p.name.startswith("round-"))


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory) -> Path:
    """A data dir after `train --rounds 3 --checkpoint-every 1`: checkpoints of rounds 0, 1, 2."""
    from node.models import model_folder, resolve_model

    model_folder(resolve_model("tiny-s"))  # built once, not inside a timed process
    data = tmp_path_factory.mktemp("trained") / "node"
    done = _cli("train", *SMALL, "--data-dir", str(data), "--rounds", "3", "--checkpoint-every", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _rounds(data / "checkpoints") == ["round-00000000", "round-00000001", "round-00000002"]
    return data


def _copy(data: Path, tmp_path: Path) -> Path:
    target = tmp_path / "node"
    shutil.copytree(data, target)
    return target


# --------------------------------------------------------------------------- kill and resume


@pytest.mark.timeout(600)
def test_sigkill_mid_round_resumes_with_the_same_peer_id_and_adapter(tmp_path):
    from node.models import model_folder, resolve_model

    model_folder(resolve_model("tiny-s"))
    data = tmp_path / "node"

    def join(log: Path) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        proc = _spawn(
            log,
            "join",
            *SMALL,
            "--name",
            "k",
            "--data-dir",
            str(data),
            "--swarm-id",
            "faults",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--api-port",
            str(port),
            "--round-seconds",
            "1",
            "--gather-seconds",
            "0.2",
            "--checkpoint-every",
            "2",
        )
        return proc, f"http://127.0.0.1:{port}/status"

    def status(url: str) -> dict:
        try:
            return httpx.get(url, timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return {}

    first_log = tmp_path / "first.log"
    proc, url = join(first_log)
    try:
        _wait(lambda: (status(url).get("rounds_done") or 0) >= 3, 240, "three rounds", first_log)
        _wait(lambda: any((data / "checkpoints").glob("round-*")), 60, "a checkpoint", first_log)
        first = _wait(lambda: (s := status(url)).get("phase") in MID_ROUND and s, 60, "a round in progress", first_log)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Nothing of the killed node survives it (its DHT child and p2pd follow it down).
    _wait(lambda: not _p2pd_pids(data), 60, "the killed node's p2pd to exit", first_log)
    # Its status.json was written mid-round by a process that is gone: read as stopped.
    seen = _cli("status", str(data), "--json", timeout=120)
    assert seen.returncode == 0, seen.stderr
    gone = json.loads(seen.stdout)
    assert gone["phase"] == "stopped" and gone["running"] is False and gone["phase_at_exit"] != "stopped"

    from node.train.checkpoint import load_latest

    newest = load_latest(data / "checkpoints")
    assert newest is not None
    history = [h["round"] for h in _json(data / "status.json").get("history") or []]
    played, lost = max(history), sum(r > newest.round for r in history)
    assert lost <= 2  # the cadence: at most 2 rounds were played after the newest checkpoint

    second_log = tmp_path / "second.log"
    proc, url = join(second_log)
    try:
        resumed = _wait(lambda: status(url).get("resumed_from"), 240, "the resumed node's API", second_log)
        _wait(lambda: (status(url).get("rounds_done") or 0) >= 1, 120, "a round after the resume", second_log)
        after = status(url)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, second_log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert after["peer_id"] == first["peer_id"]
    assert resumed["round"] == newest.round and resumed["step"] == newest.meta.step
    assert resumed["adapter_version"] == newest.meta.adapter_version and resumed["lost_rounds"] == lost
    # The engine samples with the restored weights: the trainer's log-probs of its samples agree.
    assert after["last_round"]["metrics"]["mean_abs_delta"] < 1e-4
    assert after["last_round"]["round"] > played
    text = second_log.read_text()
    assert f"resumed from checkpoint {newest.path.name}" in text
    assert (f"{lost} round(s) played after it" if lost else "nothing played after it was lost") in text


@pytest.mark.timeout(600)
def test_checkpoints_follow_the_cadence_through_a_kill_and_resume(tmp_path):
    from node.models import model_folder, resolve_model

    model_folder(resolve_model("tiny-s"))
    data = tmp_path / "node"
    args = ["train", *SMALL, "--data-dir", str(data), "--checkpoint-every", "4"]
    log = tmp_path / "first.log"
    proc = _spawn(log, *args, "--rounds", "40")
    try:
        _wait(lambda: (_json(data / "status.json").get("rounds_done") or 0) >= 6, 240, "six rounds", log)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    played = max(h["round"] for h in _json(data / "status.json")["history"])
    made = _rounds(data / "checkpoints")
    # One after the first round (a young node can be exported), then every 4 (0, 4, 8, ...).
    assert made == [f"round-{r:08d}" for r in range(0, played + 1, 4)][-3:], (made, played)
    last = int(made[-1].removeprefix("round-"))

    again = _cli(*args, "--rounds", str(last + 6), "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from checkpoint {made[-1]}" in again.stderr
    lost = f"{played - last} round(s) played after it (up to round {played}) were lost"
    # the kill may land right after a checkpoint round, and then nothing was lost
    assert (lost if played > last else "nothing played after it was lost") in again.stderr
    # The console counts rounds from 1 (internal round r is "round r+1/N"), solo runs go on counting.
    total = last + 6
    assert f"round {last + 2}/{total}" in again.stdout and f"round {last + 1}/{total}" not in again.stdout
    # Counting starts again at the resume: round last+4, then the stop's checkpoint at last+5.
    assert _rounds(data / "checkpoints")[-2:] == [f"round-{last + 4:08d}", f"round-{last + 5:08d}"]


def test_a_restart_without_checkpoints_says_what_it_lost(three_checkpoints, tmp_path):
    """The earlier run's status.json knows the rounds it played; with its checkpoints gone,
    --resume refuses and a plain restart says how many rounds are lost and that it starts fresh."""
    data = _copy(three_checkpoints, tmp_path)
    shutil.rmtree(data / "checkpoints")
    from typer.testing import CliRunner

    from node.console.cli import app

    refused = CliRunner().invoke(app, ["train", *SMALL, "--data-dir", str(data), "--rounds", "4", "--resume"])
    assert refused.exit_code == 2 and "--resume: no checkpoint in" in refused.output
    fresh = _cli("train", *SMALL, "--data-dir", str(data), "--rounds", "1")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "the 3 round(s) the earlier run played (up to round 2) are lost; starting fresh" in fresh.stderr
    assert "round 1/1" in fresh.stdout


# --------------------------------------------------------------------------- bad checkpoints


@pytest.mark.timeout(600)
def test_an_edited_newest_meta_is_skipped_and_bad_folders_never_cost_a_good_one(three_checkpoints, tmp_path):
    data = _copy(three_checkpoints, tmp_path)
    ckpts = data / "checkpoints"
    meta = json.loads((ckpts / "round-00000002" / "meta.json").read_text())
    meta["step"] += 5
    (ckpts / "round-00000002" / "meta.json").write_text(json.dumps(meta))
    # ... and a bad folder numbered above every good one (a copy whose weights were cut short).
    shutil.copytree(ckpts / "round-00000001", ckpts / "round-00000009")
    weights = next((ckpts / "round-00000009" / "weights").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-5])

    done = _cli("train", *SMALL, "--data-dir", str(data), "--rounds", "4", "--checkpoint-every", "1", "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "round-00000002: meta.json was edited" in done.stderr
    assert "round-00000009: weights/adapter_model.safetensors is" in done.stderr
    assert "resumed from checkpoint round-00000001" in done.stderr
    assert "round 3/4" in done.stdout and "round 4/4" in done.stdout and "round 2/4" not in done.stdout
    # The edited round 2 was rewritten by the replayed round 2; the bad round 9 is set aside,
    # not counted: the three newest GOOD checkpoints stay.
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["latest", "rejected-round-00000009", "round-00000001", "round-00000002", "round-00000003"]
    assert (ckpts / "latest").read_text().strip() == "round-00000003"


@pytest.mark.timeout(600)
def test_no_usable_checkpoint_refuses_to_start(three_checkpoints, tmp_path):
    data = _copy(three_checkpoints, tmp_path)
    ckpts = data / "checkpoints"
    for folder in ckpts.glob("round-*"):
        optimizer = folder / "optimizer.pt"
        optimizer.write_bytes(optimizer.read_bytes()[:-3])
    before = {p.relative_to(data): p.stat().st_size for p in data.rglob("*") if p.is_file()}

    def one_error_line(result: subprocess.CompletedProcess) -> str:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        return errors[0]

    line = one_error_line(_cli("train", *SMALL, "--data-dir", str(data), "--rounds", "5", "--resume"))
    assert "none of the 3 checkpoint(s)" in line and "round-00000002: optimizer.pt is" in line
    assert "refusing to start again from scratch" in line
    # Corrupt or not, checkpoints are never trained over unasked (refused before any loading).
    from typer.testing import CliRunner

    from node.console.cli import app

    unasked = CliRunner().invoke(app, ["train", *SMALL, "--data-dir", str(data), "--rounds", "5"])
    assert unasked.exit_code == 2 and "pass --resume to continue" in unasked.output
    line = one_error_line(
        _cli(
            "join",
            *SMALL,
            "--data-dir",
            str(data),
            "--swarm-id",
            "faults",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--api-port",
            "0",
            "--rounds",
            "1",
        )
    )
    assert "none of the 3 checkpoint(s)" in line
    after = {p.relative_to(data): p.stat().st_size for p in data.rglob("*") if p.is_file()}
    assert {k: v for k, v in after.items() if k.parts[0] == "checkpoints"} == {
        k: v for k, v in before.items() if k.parts[0] == "checkpoints"
    }
