"""`ftis-node demo`: a local swarm of heterogeneous nodes, as separate processes on loopback.

Each node is a real `ftis-node join` process with its own DHT peer, model, trainer and
status API. The first node starts the swarm; the others are started once it answers
(its status API lists its join addresses: it has loaded its model and joined), and join
it through its status URL. The first node serves the swarm until the others have played
their rounds, then the demo stops it. The demo only watches: it polls every node's
/status and draws one live table; a node that exits before its first round stops the
demo at once, with the node's name and the last line of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table


@dataclass(frozen=True)
class DemoNode:
    name: str
    model: str
    train_mode: str = "lora"
    lr: float | None = None


# Different sizes, one full fine-tune and LoRA ones, then a node with another tokenizer
# (the sequence-level path). All share the toy task, so all can learn from all.
# Learning rates that move these tiny models within a demo's 20 rounds (measured with
# `ftis-node train`, 2 seeds: full 1e-4 and LoRA 3e-3 rise; LoRA 1e-3 is flat, 1e-2 collapses).
ROSTER = (
    DemoNode("medium-full", "tiny-m", "full", lr=1e-4),
    DemoNode("small-lora", "tiny-s", "lora", lr=3e-3),
    DemoNode("large-lora", "tiny-l", "lora", lr=3e-3),
    DemoNode("alt-tokenizer", "tiny-alt", "lora", lr=3e-3),
)
# TRL's GRPO examples' split: a quarter for a well-formed answer tag, three quarters for the
# right answer. At T = 1 the tiny models leave about 4 in 10 tags unclosed; closing them is
# what 20 rounds can teach, and the right answers follow more slowly.
DEMO_REWARD = ("node.tasks.stock_rewards:answer_format,node.tasks.stock_rewards:answer_correct", "1,3")
SMOLLM = DemoNode("smollm2", "smollm2-135m-embedded", "lora", lr=2e-5)


class NodeFailed(RuntimeError):
    """A node of the demo exited before its first round (the message names it and its last log line)."""


WINDOW = 5  # the summary compares the mean reward of the first and the last WINDOW rounds
BOOTSTRAP_WAIT_S = 600.0  # the first node loads a model before it answers; a busy machine takes minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


class Demo:
    def __init__(
        self,
        *,
        nodes: int = 3,
        rounds: int = 20,
        round_seconds: float = 6.0,
        with_smollm: bool = False,
        loss: str = "f-tis",
        workdir: Path | None = None,
        keep_running: bool = False,
        swarm_wait: float | None = None,
        console: Console | None = None,
    ) -> None:
        if not 2 <= nodes <= len(ROSTER) + int(with_smollm):
            raise ValueError(f"--nodes must be between 2 and {len(ROSTER) + int(with_smollm)}")
        from node.config import LOSS_CHOICES

        loss = loss.strip().lower()
        if loss not in LOSS_CHOICES:
            raise ValueError(f"unknown loss {loss!r}; use one of: {', '.join(LOSS_CHOICES)}")
        roster = list(ROSTER[: nodes - int(with_smollm)]) + ([SMOLLM] if with_smollm else [])
        self.roster = roster
        self.rounds = rounds
        self.round_seconds = round_seconds
        self.loss = loss
        self.keep_running = keep_running
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="ftis-demo-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Wide enough for the table even when the output is a pipe or a CI log.
        self.console = console or Console(width=None if sys.stdout.isatty() else 140)
        self.procs: dict[str, subprocess.Popen] = {}
        self.api: dict[str, str] = {}
        self.last: dict[str, dict] = {}
        self.history: dict[str, list[dict]] = {}
        self.swarm_wait = swarm_wait  # the joiners' --swarm-wait (None: the node's default)
        self.failure: str | None = None  # why the demo stopped early, if it did

    # ------------------------------------------------------------------ processes
    def _command(self, node: DemoNode, api_port: int, bootstrap_url: str | None) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "node.console.cli",
            "join",
            "--name",
            node.name,
            "--model",
            node.model,
            "--train-mode",
            node.train_mode,
            "--task",  # named: an instruct model's default task is not toy
            "toy",
            "--reward",
            DEMO_REWARD[0],
            "--reward-weights",
            DEMO_REWARD[1],
            "--data-dir",
            str(self.workdir / node.name),
            "--swarm-id",
            "demo",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--api-host",
            "127.0.0.1",
            "--api-port",
            str(api_port),
            "--round-seconds",
            str(self.round_seconds),
            "--gather-seconds",
            str(self.round_seconds / 2),
            "--expect-peers",
            str(len(self.roster) - 1),
            "--loss",
            self.loss,
            "--threads",
            "1",
            # All of them are this demo's own nodes: no probation, so peers' samples count
            # from round 0 (the screen stays on).
            "--probation-rounds",
            "0",
        ]
        # The first node serves the swarm until the others are done (they start after it has
        # loaded and may take longer to load than a fixed number of its rounds lasts).
        if not self.keep_running and bootstrap_url:
            cmd += ["--rounds", str(self.rounds)]
        if node.lr is not None:
            cmd += ["--lr", str(node.lr)]
        if bootstrap_url:
            cmd += ["--swarm", bootstrap_url]
            if self.swarm_wait is not None:
                cmd += ["--swarm-wait", str(self.swarm_wait)]
        return cmd

    def start(self) -> None:
        """Start the first node, wait until it answers, then start the others joining it."""
        self.prepare_models()
        first, *others = self.roster
        self._spawn(first, None)
        self.console.print(f"logs and checkpoints in {self.workdir}")
        self.console.print(f"  {first.name:<14} dashboard {self.api[first.name]}/")
        self._wait_joined(first.name)
        for node in others:
            self._spawn(node, self.api[first.name])
            self.console.print(f"  {node.name:<14} dashboard {self.api[node.name]}/")

    def _spawn(self, node: DemoNode, bootstrap_url: str | None) -> None:
        env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        port = free_port()
        with open(self.workdir / f"{node.name}.log", "w") as log:
            self.procs[node.name] = subprocess.Popen(
                self._command(node, port, bootstrap_url),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the demo only; it stops the nodes itself
            )
        self.api[node.name] = f"http://127.0.0.1:{port}"

    def _wait_joined(self, name: str, timeout: float = BOOTSTRAP_WAIT_S) -> None:
        """Until `name`'s status API lists its join addresses; NodeFailed if it exits or never does."""
        started = time.monotonic()
        with self.console.status(f"starting {name}…") as spinner:
            while True:
                self.check_early_exits()
                status = _get_json(self.api[name] + "/status") or {}
                if status.get("join_addrs"):
                    break
                waited = time.monotonic() - started
                if waited > timeout:
                    raise NodeFailed(
                        f"{name} did not join its own swarm within {timeout:.0f} s; "
                        f"its last log line: {self.last_log_line(name)}"
                    )
                phase = status.get("phase") or "loading"
                spinner.update(f"starting {name} ({phase}, {waited:.0f} s); the others start once it answers…")
                time.sleep(0.5)
        self.console.print(f"{name} started the swarm ({time.monotonic() - started:.1f}s)")

    def last_log_line(self, name: str) -> str:
        try:
            lines = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        lines = [line.strip() for line in lines if line.strip()]
        return lines[-1][-300:] if lines else "(empty log)"

    def check_early_exits(self) -> None:
        """NodeFailed naming the first node that exited before finishing a round."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None or self._rounds_done(name) > 0:
                continue
            raise NodeFailed(
                f"{name} exited (code {code}) before its first round; its last log line: {self.last_log_line(name)}"
            )

    def _rounds_done(self, name: str) -> int:
        """Rounds a node finished, by its last /status or its status file (it may have exited since)."""
        seen = self.last.get(name, {}).get("rounds_done") or 0
        path = self.workdir / name / "status.json"
        if not seen and path.is_file():
            try:
                seen = json.loads(path.read_text()).get("rounds_done") or 0
            except (OSError, ValueError):
                pass
        return seen

    def prepare_models(self) -> None:
        """Build the models once, here, so the nodes do not race to build the same one."""
        from node.models import model_folder, resolve_model

        for node in self.roster:
            start = time.monotonic()
            with self.console.status(f"preparing {node.model} (built once, then cached)…"):
                model_folder(resolve_model(node.model))
            self.console.print(f"model {node.model} ready ({time.monotonic() - start:.1f}s)")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 120  # a round's phase, a last checkpoint, on a busy machine
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    # ------------------------------------------------------------------ watching
    def poll(self) -> dict[str, dict]:
        """The latest status of every node (the last one seen, once a node has exited)."""
        for name, url in self.api.items():
            code = self.procs[name].poll()  # before the poll: a node that answered has not exited unseen
            status = _get_json(url + "/status")
            if isinstance(status, dict):
                self.last[name] = status
                history = _get_json(url + "/history")
                if isinstance(history, list):
                    self.history[name] = history
            self.last.setdefault(name, {})["exit_code"] = code
        return self.last

    def read_status_files(self) -> None:
        """After the nodes stop, their own status.json files hold the final word."""
        for name in self.api:
            path = self.workdir / name / "status.json"
            if path.is_file():
                final = json.loads(path.read_text())
                self.history[name] = final.pop("history", self.history.get(name, []))
                self.last[name] = final | {"exit_code": self.procs[name].poll()}

    def table(self) -> Table:
        table = Table(title=f"ftis-node demo · {len(self.roster)} nodes · loss {self.loss}")
        for col in (
            "node",
            "model",
            "phase",
            "rounds",
            "reward",
            "own",
            "peer samples used",
            "peers",
            "filtered",
            "IS w",
            "rejected",
        ):
            table.add_column(col, justify="left" if col in ("node", "model", "phase") else "right")
        for node in self.roster:
            s = self.last.get(node.name, {})
            last = s.get("last_round") or {}
            m = last.get("metrics", {})
            phase = s.get("phase", "starting")
            if s.get("exit_code") is not None:
                phase = f"exited ({s['exit_code']})"
            table.add_row(
                node.name,
                f"{node.model} ({node.train_mode})",
                phase,
                _fmt(s.get("rounds_done")),
                _fmt(last.get("reward_mean")),
                _fmt(last.get("own_samples")),
                _fmt(sum(r.get("peer_samples", 0) for r in self.history.get(node.name, [])) if last else None),
                _fmt(last.get("peers_answered")),
                _fmt(m.get("frac_filtered")),
                _fmt(m.get("is_weight_mean")),
                _fmt(sum((s.get("rejected") or {}).values())),
            )
        return table

    def summary(self) -> dict[str, dict]:
        """Per node: rounds, reward at the start and end, peer samples used, rejections."""
        out = {}
        for node in self.roster:
            rounds = self.history.get(node.name, [])
            rewards = [r["reward_mean"] for r in rounds]
            k = max(1, min(WINDOW, len(rewards) // 2))
            s = self.last.get(node.name, {})
            out[node.name] = {
                "model": node.model,
                "train_mode": node.train_mode,
                "rounds": len(rounds),
                "reward_first": sum(rewards[:k]) / k if rewards else None,
                "reward_last": sum(rewards[-k:]) / k if rewards else None,
                "reward_best": max(rewards) if rewards else None,
                "peer_samples_used": sum(r["peer_samples"] for r in rounds),
                "peers_answered_mean": sum(r["peers_answered"] for r in rounds) / len(rounds) if rounds else 0,
                "rejected": s.get("rejected", {}),
                "exit_code": s.get("exit_code"),
            }
        return out

    def summary_table(self, summary: dict[str, dict]) -> Table:
        table = Table(title=f"summary (reward: mean of the first / last {WINDOW} rounds)")
        for col in ("node", "model", "rounds", "reward first", "reward last", "best", "peer samples used", "exit"):
            table.add_column(col, justify="left" if col in ("node", "model") else "right")
        for name, s in summary.items():
            table.add_row(
                name,
                f"{s['model']} ({s['train_mode']})",
                str(s["rounds"]),
                _fmt(s["reward_first"]),
                _fmt(s["reward_last"]),
                _fmt(s["reward_best"]),
                str(s["peer_samples_used"]),
                _fmt(s["exit_code"]),
            )
        return table

    def run(self) -> dict[str, dict]:
        """Start, watch until every node is done (or one fails before its first round), summarise."""
        first = self.roster[0].name
        try:
            self.start()
        except NodeFailed as err:
            self.failure = str(err)
        except KeyboardInterrupt:
            self.failure = "stopped (Ctrl-C) while the first node started"
        if self.failure is not None:
            self.stop()
            self.console.print(f"[red]{escape(self.failure)}[/red]")
            return self.summary()
        with Live(self.table(), console=self.console, refresh_per_second=2) as live:
            try:
                while True:
                    self.poll()
                    live.update(self.table())
                    self.check_early_exits()
                    others = [n for n in self.last if n != first]
                    if all(self.last[n].get("exit_code") is not None for n in others):
                        break  # the joiners are done: the first node stops with them
                    if self.last.get(first, {}).get("exit_code") is not None and self.keep_running:
                        break
                    time.sleep(1.0)
            except NodeFailed as err:
                self.failure = str(err)
            except KeyboardInterrupt:
                self.console.print("stopping the nodes…")
            finally:
                self.stop()
                # The nodes' own status.json files hold their last word (the last /status poll
                # may predate their final round): the table left on screen shows that, as the
                # summary below does.
                self.read_status_files()
                live.update(self.table(), refresh=True)
        if self.failure is not None:
            self.console.print(f"[red]{escape(self.failure)}[/red]")
        summary = self.summary()
        (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.console.print(self.summary_table(summary))
        self.console.print(learning_line(summary))
        return summary


def learning_line(summary: dict[str, dict]) -> str:
    """Which nodes' reward rose from their first to their last rounds (the demo's own control:
    the same node, early against late), and by how much."""
    played = {name: s for name, s in summary.items() if s["reward_first"] is not None and s["rounds"] >= 2}
    if not played:
        return "no node finished two rounds: nothing to compare"
    rose = [name for name, s in played.items() if s["reward_last"] > s["reward_first"]]
    each = ", ".join(f"{name} {s['reward_first']:.3f} -> {s['reward_last']:.3f}" for name, s in played.items())
    line = f"reward rose on {len(rose)} of {len(played)} nodes (first {WINDOW} rounds -> last {WINDOW}): {each}"
    if len(rose) < len(played):
        line += "; a few rounds are a handful of steps: --rounds 40 gives the others longer"
    return line


def _get_json(url: str) -> Any:
    """A node's JSON answer, or None while it does not answer."""
    try:
        return httpx.get(url, timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None
