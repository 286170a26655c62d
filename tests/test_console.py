"""What a user sees while a node runs: run-relative round numbers, the phase line, and the
notices for a round with nothing to learn or a round longer than its bucket."""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import numpy as np
import pytest
from rich.spinner import Spinner

from node.config import NodeConfig
from node.console.progress import phase_text, round_label
from node.daemon import Node
from node.serving.api import ApiServer
from node.serving.status import NodeStatus
from node.tasks import get_task


def _config(tmp_path, **kw) -> NodeConfig:
    base = dict(
        name="c", data_dir=tmp_path / "c", model="tiny-s", prompts_per_round=2, group_size=4, threads=1, api_port=None
    )
    return NodeConfig(**(base | kw))


def test_round_labels_and_phase_lines():
    assert round_label(3, 10, 179628180, solo=False) == "round 3/10 [179628180]"
    assert round_label(3, None, 179628180, solo=False) == "round 3 [179628180]"
    assert round_label(3, 10, 2, solo=True) == "round 3/10"
    now = 1000.0
    view = {"phase": "generating", "phase_detail": {"done": 3, "total": 8}, "phase_since": now - 12}
    assert phase_text(view, now) == "generating 3/8 prompts · 12 s"
    view = {"phase": "gathering", "phase_detail": {"deadline": now + 4.2}, "phase_since": now}
    assert phase_text(view, now) == "gathering peers' packets · 4 s left"
    view["phase_detail"]["peers"] = 2  # what the daemon sets as each peer's packet arrives
    assert phase_text(view, now) == "gathering peers' packets · 2 answered · 4 s left"
    view = {"phase": "training", "phase_detail": {"samples": 96}, "phase_since": now - 2}
    assert phase_text(view, now) == "training on 96 samples · 2 s"


def test_phase_detail_and_round_in_run_reach_the_api():
    status = NodeStatus(name="n", model="tiny-s", task="toy", loss="f-tis")
    server = ApiServer(status, host="127.0.0.1", port=0).start()
    try:
        status.set_phase("generating", 179628180, round_in_run=3, done=2, total=8)
        since = status.phase_view()["phase_since"]
        status.set_phase("generating", 179628180, done=5, total=8)  # progress inside a phase keeps its start
        with httpx.Client(base_url=server.url, timeout=5) as client:
            s = client.get("/status").json()
            assert s["round"] == 179628180 and s["round_in_run"] == 3
            assert s["phase_detail"] == {"done": 5, "total": 8} and s["phase_since"] == since
            assert client.get("/openapi.json").status_code == 200
            assert client.get("/docs").status_code == 404  # its page needs a CDN; the schema is enough
    finally:
        server.stop()


def test_a_round_with_equal_rewards_says_there_is_no_signal(tmp_path):
    # One token cannot hold <answer>N</answer>: every reward is 0, so every advantage is 0.
    node = Node(_config(tmp_path, rounds=1, max_tokens=1), use_swarm=False).setup()
    seen = []
    node.on_round = seen.append
    results = node.run()
    assert len(results) == 1 and results[0].round_in_run == 1
    assert results[0].metrics["groups_with_signal"] == 0.0
    assert any(n.startswith("no learning signal: all rewards equal") for n in results[0].notices)
    status = json.loads((tmp_path / "c" / "status.json").read_text())
    assert any("no learning signal" in n for n in status["notices"])


def test_a_round_longer_than_its_bucket_is_named_with_the_fix(tmp_path):
    from node.experiment.exchange import ExchangeHub

    hub = ExchangeHub()
    cfg = _config(tmp_path, rounds=2, round_seconds=0.05, gather_seconds=0)
    node = Node(cfg, exchange=hub.endpoint("solo")).setup()
    rollout = node.rollout

    def slow_rollout(r):  # a round of the tiny model can fit 50 ms; this one surely does not
        time.sleep(0.2)
        return rollout(r)

    node.rollout = slow_rollout
    results = node.run()
    assert [r.round_in_run for r in results] == [1, 2]
    notice = next(n for n in results[0].notices if "longer than its" in n)
    assert "--round-seconds" in notice and "took 0 s" not in notice  # sub-second rounds keep their digits


def test_peers_on_another_task_are_named_with_the_fix(tmp_path):
    """Two nodes in lockstep on one exchange, each on its own task: every group the other
    sends is rejected, and each node's round says why and what to pass."""
    from node.experiment.exchange import ExchangeHub

    hub = ExchangeHub()
    tasks = {"a": "toy", "b": "gym:chain_sum?max_terms=2&max_digits=1"}
    nodes = {
        name: Node(
            _config(tmp_path, name=name, data_dir=tmp_path / name, rounds=1, task=task, gather_seconds=0.5),
            exchange=hub.endpoint(name),
        ).setup()
        for name, task in tasks.items()
    }
    try:
        opened = {name: node.begin_round(0) for name, node in nodes.items()}
        results = {name: node.finish_round(0, opened[name]) for name, node in nodes.items()}
    finally:
        for node in nodes.values():
            node.close()
    for name, result in results.items():
        assert result.peers_answered == 1 and result.peer_samples == 0
        notice = next(n for n in result.notices if "rejected as another task" in n)
        assert notice.startswith("2 peer group(s)") and "--task" in notice  # the peer sent 2 prompts' groups
        assert f"is not of task {get_task(tasks[name]).name!r}" in notice


def test_chat_template_is_applied_alike_to_own_and_peers_prompts(tmp_path):
    """An instruct model's prompts go through its chat template, in the one place prompts are
    tokenized; a peer's packet is rebuilt with the same ids as our own prompts."""
    from node.models import model_folder, resolve_model

    folder = tmp_path / "tiny-chat"
    shutil.copytree(model_folder(resolve_model("tiny-s")), folder)
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    config_path.write_text(json.dumps(tok_config))
    node = Node(_config(tmp_path, model=str(folder), rounds=1), use_swarm=False).setup()
    try:
        assert node.generation.chat_template and node.generation.max_tokens == 64
        assert node.task.name.startswith("gym:chain_sum") and node.status.info["task"] == node.generation.task
        own = node.rollout(0)
        text = node.tokenizer.decode(own[0].prompt_ids)
        assert text.startswith("user: State the final answer") and text.endswith("assistant: ")
        from node.groups import to_packet
        from protocol import PacketHeader, SamplingParams, encode

        header = PacketHeader.create(
            swarm_id=node.cfg.swarm_id,
            round=0,
            sender_peer_id="peerX",
            base_model_id="tiny-chat",
            adapter_version=node.engine.adapter_version,
            tokenizer_fingerprint=node.fingerprint,
            vocab_size=len(node.tokenizer),
        )
        params = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, max_tokens=node.sampling.max_tokens)
        admitted = node.admission.admit("peerX", encode(to_packet(own, header, params)), 0)
        assert admitted.groups and [g.prompt_ids for g in admitted.groups] == [g.prompt_ids for g in own]
        assert all(np.isfinite(s.logp_gen).all() for g in admitted.groups for s in g.sequences)
    finally:
        node.close()
    # and --no-chat-template turns it off
    plain = NodeConfig(**(_config(tmp_path).model_dump() | {"chat_template": False})).generation(True)
    assert not plain.chat_template


@pytest.mark.parametrize("has_template", [False, True])
def test_generation_defaults_follow_the_model_and_flags_win(has_template):
    cfg = NodeConfig(api_port=None)
    gen = cfg.generation(has_template)
    assert gen.chat_template is has_template
    assert (gen.max_tokens, gen.temperature) == ((64, 0.7) if has_template else (32, 1.0))
    # an instruct model gets sums it can sometimes get right (SmolLM2-135M scores 0 on toy)
    assert gen.task == ("gym:chain_sum?max_terms=2&max_digits=1" if has_template else "toy")
    get_task(gen.task)
    given = NodeConfig(api_port=None, max_tokens=12, temperature=1.3, task="toy:add").generation(has_template)
    assert (given.max_tokens, given.temperature, given.task) == (12, 1.3, "toy:add")


SPINNER_FRAMES = set(Spinner("dots").frames)  # the spinner rich's `Console.status` draws


def _run_in_terminal(args: list[str]) -> str:
    """The bytes a terminal receives from the real `ftis-node` (stdout is a pty, 250 columns)."""
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    env = os.environ | {"COLUMNS": "250", "LINES": "50", "TERM": "xterm", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.console.cli", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.timeout(400)
def test_a_terminal_sees_one_spinner_at_a_time(tmp_path):
    """Preparing the model, loading it and every phase of the rounds share one live line.
    Two live displays at once make rich draw two lines and move the cursor up between them
    (ESC [1A), which a terminal shows as two flickering spinners."""
    screen = _run_in_terminal(
        ["train", "--model", "tiny-s", "--rounds", "2", "--prompts-per-round", "2", "--group-size", "4",
         "--threads", "1", "--data-dir", str(tmp_path / "node")]
    )  # fmt: skip
    # A live display hides the cursor while it runs and shows it when it stops; inside one, the
    # cursor never moves up. (At its stop rich moves up once to erase the line: that is outside.)
    toggles = re.findall(r"\x1b\[\?25([lh])", screen)
    assert len(toggles) >= 4 and toggles == ["l", "h"] * (len(toggles) // 2)  # strictly one, then the next
    sessions = [chunk.split("\x1b[?25h")[0] for chunk in screen.split("\x1b[?25l")[1:]]
    assert not any("\x1b[1A" in s or "\x1b[A" in s for s in sessions), "two live lines were drawn"
    redraws = [part for chunk in screen.split("\n") for part in chunk.split("\r")]
    spun = [part for part in redraws if SPINNER_FRAMES & set(part)]
    assert spun, "no spinner was drawn at all"
    assert all(sum(ch in SPINNER_FRAMES for ch in part) == 1 for part in spun), spun[:5]
    words = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", part).strip("".join(SPINNER_FRAMES) + " ") for part in spun]
    assert all(words), "a spinner with no words beside it"
    # the spinner covered the stages before the rounds and the rounds themselves
    assert any("loading model" in part for part in spun) and any("round " in part for part in spun)
    assert "round 2/2  reward" in screen  # the round lines are printed above the live line
