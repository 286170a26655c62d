"""What a node prints: one spinner while it starts, the join line, a live phase line inside
each round, one line per finished round (with warnings), and a summary.

Only one live element is ever on screen: the printer owns a single rich `Status` and
every stage (preparing the model, starting, each round's phases) updates its text. The
text comes from the node's `NodeStatus` (phase, round, phase detail), read by a small
ticker thread, so the round loop never waits on the terminal. Without a terminal (a log
file, the demo's node logs) there is no spinner: a long phase prints a plain line every
`LOG_EVERY_S` seconds instead.
"""

from __future__ import annotations

import contextlib
import math
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from node.config import NodeConfig

if TYPE_CHECKING:
    from rich.status import Status

LOG_EVERY_S = 15.0
_TICK_S = 0.25


def round_label(round_in_run: int | None, total: int | None, bucket: int | None, solo: bool) -> str:
    """`round 3/10 [179628180]`: counted from this run's start; the DHT bucket in brackets.
    Solo, rounds are the node's own (a resumed run goes on counting, as --rounds does)."""
    if round_in_run is None:
        return "round –"
    label = f"round {round_in_run}" + (f"/{total}" if total else "")
    return label if solo or bucket is None else f"{label} [{bucket}]"


def phase_text(view: dict[str, Any], now: float | None = None) -> str:
    """The live line's words for a phase: `generating 3/8 prompts`, `gathering · 4 s left`, ..."""
    now = time.time() if now is None else now
    phase, detail = view.get("phase", ""), view.get("phase_detail") or {}
    elapsed = max(0.0, now - (view.get("phase_since") or now))
    if phase == "generating" and "total" in detail:
        return f"generating {detail.get('done', 0)}/{detail['total']} prompts · {elapsed:.0f} s"
    if phase == "gathering":
        parts = ["gathering peers' packets"]
        if "peers" in detail:
            parts.append(f"{detail['peers']} answered")
        if "deadline" in detail:
            parts.append(f"{max(0.0, detail['deadline'] - now):.0f} s left")
        return " · ".join(parts)
    if phase == "waiting for round" and "starts_at" in detail:
        return f"waiting for the next round · {max(0.0, detail['starts_at'] - now):.0f} s"
    if phase == "serving last packet" and "until" in detail:
        left = max(0.0, detail["until"] - now)
        return f"done; serving the last round's packet to peers still fetching it · {left:.0f} s"
    if phase == "training" and "samples" in detail:
        return f"training on {detail['samples']} samples · {elapsed:.0f} s"
    return f"{phase} · {elapsed:.0f} s" if elapsed >= 1 else phase


# The phases of a round, and what shortens each one (the settings named in the overrun warning).
_PHASE_FIX = {
    "generating": "fewer --prompts-per-round (now {prompts_per_round}) or --max-tokens (now {max_tokens})",
    "publishing": "a smaller packet: fewer --prompts-per-round (now {prompts_per_round}) or --group-size",
    "gathering": "a shorter --gather-seconds (now {gather_seconds:g}) or --expect-peers (ends the gather early)",
    "training": "fewer samples per step: fewer --prompts-per-round (now {prompts_per_round}) or --group-size "
    "(now {group_size}), or a smaller --peer-share (now {peer_share:g})",
    "loading weights": "--train-mode lora (a smaller set of weights to load), or a longer --round-seconds",
    "checkpointing": "a larger --checkpoint-every (now {checkpoint_every})",
}


def overrun_advice(phase_seconds: dict[str, float], seconds: float, round_seconds: float, config: NodeConfig) -> str:
    """What to change when a round outlasts its bucket, from where its time went: the phase
    that took longest and the setting that shortens it, and a round length that would fit."""
    spent = {p: t for p, t in phase_seconds.items() if p in _PHASE_FIX and t >= 0.05}
    suggest = max(round_seconds * 2, math.ceil(seconds * 1.5 / 10) * 10)
    if not spent:
        return f"pass a longer --round-seconds (e.g. {suggest:g})"
    ranked = sorted(spent.items(), key=lambda kv: -kv[1])
    where = ", ".join(f"{p} {t:.3g} s" for p, t in ranked[:3])
    worst = ranked[0][0]
    values = {
        k: getattr(config, k, None) for k in ("prompts_per_round", "max_tokens", "group_size", "checkpoint_every")
    }
    values |= {"gather_seconds": config.gather_seconds, "peer_share": config.peer_share}
    if values["max_tokens"] is None:
        values["max_tokens"] = "the model's default"
    fix = _PHASE_FIX[worst].format(**values)
    return f"{where}; {worst} took longest: pass {fix}, or a longer --round-seconds (e.g. {suggest:g})"


class RoundPrinter:
    def __init__(self, config: NodeConfig, *, solo: bool, console: Console | None = None) -> None:
        self.config = config
        self.solo = solo
        self.console = console or Console(stderr=False, highlight=False, soft_wrap=True)
        self._status: Status | None = None  # the one rich Status on screen, if any
        self._live: Status | None = None  # the ticker's status line, between watch() and stop()
        self._node: Any = None  # the Node that watch() shows
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_log = 0.0

    # ------------------------------------------------------------------ the one live line
    @contextlib.contextmanager
    def spinner(self, text: str) -> Iterator[None]:
        """A spinner with `text` (a plain line without a terminal) for a stage before the rounds."""
        if self.console.is_terminal and self._status is None:
            with self.console.status(f"[bold]{escape(self.config.name)}[/]: {escape(text)}") as status:
                self._status = status
                try:
                    yield
                finally:
                    self._status = None
        else:
            self.console.print(f"{self.config.name}: {text}")
            yield

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        what = "loading model and engine" if self.solo else "loading model, engine and joining the swarm"
        with self.spinner(what + "…"):
            yield

    def watch(self, node) -> None:
        """Show `node`'s phase from now on (the ticker thread); `stop()` ends it."""
        self._node = node
        self._stop.clear()
        if self.console.is_terminal:
            self._live = self.console.status(f"[bold]{escape(self.config.name)}[/] starting the rounds")
            self._live.start()
        self._ticker = threading.Thread(target=self._tick, name="ftis-progress", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
            self._ticker = None
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _tick(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                view = self._node.status.phase_view()
            except Exception:  # the node is shutting down: nothing to show
                continue
            if view.get("round_in_run") is None and view.get("phase") in ("ready", "starting"):
                continue
            line = f"{self.label(view)}  {phase_text(view)}"
            if self._live is not None:
                self._live.update(f"[bold]{escape(self.config.name)}[/] {escape(line)}")
            elif time.time() - max(self._last_log, view.get("phase_since") or 0) >= LOG_EVERY_S:
                self._last_log = time.time()
                self.console.print(f"{self.config.name} {line}")
                sys.stdout.flush()

    def label(self, view: dict[str, Any]) -> str:
        number = view["round"] + 1 if self.solo and view.get("round") is not None else view.get("round_in_run")
        return round_label(number, self.config.rounds, view.get("round"), self.solo)

    # ------------------------------------------------------------------ lines
    def ready(self, node) -> None:
        c = self.config
        gen = getattr(node, "generation", None)
        if node.swarm is not None:
            addrs = node.swarm.join_addrs()
            self.console.print(f"[bold]{escape(c.name)}[/] peer id {node.swarm.peer_id}")
            if not c.swarm:
                self.console.print("started a new swarm; others join with:")
            else:
                self.console.print("joined; others can also join through this node:")
            targets = [f"http://{_reachable_host(c.api_host)}:{node.api.port}"] if node.api is not None else []
            task = gen.task if gen is not None else c.task
            for target in targets + addrs[:2]:
                self.console.print(f"  {escape(join_line(c.model, task, target))}", soft_wrap=True)
        if node.api is not None:
            self.console.print(f"dashboard: {node.api.url}/   status: {node.api.url}/status")
        if gen is not None:
            self.console.print(
                f"task {gen.task}; sampling: temperature {gen.temperature}, up to {gen.max_tokens} tokens, "
                f"chat template {'on' if gen.chat_template else 'off'}",
                soft_wrap=True,
            )
        sys.stdout.flush()

    def round(self, result) -> None:
        m = result.metrics
        number = result.round + 1 if self.solo else getattr(result, "round_in_run", None)
        label = round_label(number, self.config.rounds, result.round, self.solo)
        line = (
            f"{label}  reward {result.reward_mean:.3f}  own {result.own_samples:>4}"
            f"  peer {result.peer_samples:>4}  peers {result.peers_answered}"
            f"  loss {m.get('loss', float('nan')):+.4f}  filtered {m.get('frac_filtered', 0.0):.2f}"
            f"  w {m.get('is_weight_mean', 1.0):.3f}  {result.seconds:5.1f}s"
        )
        self.console.print(escape(line), soft_wrap=True)
        for notice in getattr(result, "notices", []):
            self.console.print(f"  [yellow]warning:[/] {escape(notice)}", soft_wrap=True)
        status = getattr(self._node, "status", None)
        for failures in status.failure_lines() if status is not None else []:  # every kind, with its rate
            self.console.print(f"  {escape(failures)}", soft_wrap=True)
        sys.stdout.flush()

    def summary(self, results) -> None:
        if not results:
            self.console.print("no round finished")
            return
        table = Table(title=f"{self.config.name}: {len(results)} rounds")
        for col in ("first reward", "last reward", "best reward", "peer samples", "mean s/round"):
            table.add_column(col, justify="right")
        rewards = [r.reward_mean for r in results]
        table.add_row(
            f"{rewards[0]:.3f}",
            f"{rewards[-1]:.3f}",
            f"{max(rewards):.3f}",
            str(sum(r.peer_samples for r in results)),
            f"{sum(r.seconds for r in results) / len(results):.1f}",
        )
        self.console.print(table)


def join_model(model: str) -> str:
    """The `--model` to suggest to others: this node's own when others can have it too (an
    alias or a Hub id), else a model every machine can build (a local folder is only here)."""
    from node.models import ModelLoadError, resolve_model

    try:
        kind = resolve_model(model).kind
    except ModelLoadError:
        kind = "local"
    return "tiny-s" if kind == "local" else model


def join_line(model: str, task: str | None, target: str) -> str:
    """The command others run to join: this node's task named, since a model's default task
    may differ from it (a peer on another task has every group rejected as foreign)."""
    parts = ["ftis-node", "join", "--model", join_model(model)]
    if task is not None:
        parts += ["--task", task]
    return shlex.join([*parts, "--swarm", target])


def _reachable_host(api_host: str) -> str:
    """The host to print in a status URL: a wildcard bind is not an address others can type."""
    if api_host in ("0.0.0.0", "::", ""):
        import socket

        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return api_host
