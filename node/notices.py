"""The warnings a round leaves on the console, the dashboard and /status: each says what
went wrong and what to type about it."""

from __future__ import annotations

import time
from typing import Any


def no_signal(own) -> str:
    """`own`: the round's own groups, every one of whose rewards is the same."""
    values = sorted({s.reward for g in own for s in g.sequences}) or [0.0]
    return (
        f"no learning signal: all rewards equal (every sample in every group scored "
        f"{values[0]:.3g}), so this round changes nothing; an easier task, more --max-tokens or "
        "a larger --group-size gives the groups rewards that differ"
    )


def foreign_task(groups: int, why: str) -> str:
    return (
        f"{groups} peer group(s) rejected as another task ({why}): a swarm learns "
        "together only on one task; restart with the swarm's --task (a peer's printed join line names it)"
    )


def overrun_of(r: int, started: float, dht_time: float, cfg, status) -> str | None:
    """Round r (begun at `started`) ran past its bucket, or buckets passed unplayed: what happened
    and what to change (`overrun_advice` reads the phases' times on `status`); None if on time."""
    from node.console.progress import overrun_advice
    from protocol.keys import round_at

    seconds, bucket = time.time() - started, cfg.round_seconds
    late = round_at(dht_time, bucket) - r - 1  # buckets that passed unplayed
    if seconds <= bucket and late <= 0:
        return None
    advice = overrun_advice(status.phase_seconds(), seconds, bucket, cfg)
    skipped = f", so {late} round(s) of the swarm went by without this node" if late > 0 else ""
    return f"this round took {seconds:.3g} s, longer than its {bucket:g} s bucket{skipped}: {advice}"


class RewardFaults:
    """A warning in the rounds whose --reward values were bad (they scored 0 or were clamped)."""

    def __init__(self) -> None:
        self.seen = 0  # bad values counted before this round

    def notices(self, faults: dict[str, Any] | None) -> list[str]:
        counts = {k: v for k, v in (faults or {}).items() if k != "last"}
        new, self.seen = sum(counts.values()) - self.seen, sum(counts.values())
        if new <= 0 or faults is None:
            return []
        so_far = ", ".join(f"{k} {v}" for k, v in counts.items())
        return [
            f"{new} --reward value(s) this round were bad and scored 0 (outside [0, 1]: clamped); "
            f"so far {so_far}; last: {faults['last']}"
        ]
