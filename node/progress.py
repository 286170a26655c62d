"""What a node prints: a spinner while loading, the join line, one line per round, a summary."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.table import Table

from node.config import NodeConfig


class RoundPrinter:
    def __init__(self, config: NodeConfig, *, solo: bool, console: Console | None = None) -> None:
        self.config = config
        self.solo = solo
        self.console = console or Console(stderr=False, highlight=False, soft_wrap=True)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        what = "loading model and engine" if self.solo else "loading model, engine and joining the swarm"
        if self.console.is_terminal:
            with self.console.status(f"[bold]{self.config.name}[/]: {what}…"):
                yield
        else:
            self.console.print(f"{self.config.name}: {what}…")
            yield

    def ready(self, node) -> None:
        c = self.config
        if node.swarm is not None:
            addrs = node.swarm.join_addrs()
            self.console.print(f"[bold]{c.name}[/] peer id {node.swarm.peer_id}")
            if not c.swarm:
                self.console.print("started a new swarm; others join with:")
            else:
                self.console.print("joined; others can also join through this node:")
            for addr in addrs[:3]:
                self.console.print(f"  ftis-node join --model <model> --swarm {addr}", soft_wrap=True)
        if node.api is not None:
            self.console.print(f"dashboard: {node.api.url}/   status: {node.api.url}/status")
        sys.stdout.flush()

    def round(self, result) -> None:
        m = result.metrics
        line = (
            f"round {result.round:>6}  reward {result.reward_mean:.3f}  own {result.own_samples:>4}"
            f"  peer {result.peer_samples:>4}  peers {result.peers_answered}"
            f"  loss {m.get('loss', float('nan')):+.4f}  filtered {m.get('frac_filtered', 0.0):.2f}"
            f"  w {m.get('is_weight_mean', 1.0):.3f}  {result.seconds:5.1f}s"
        )
        self.console.print(line, soft_wrap=True)
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
