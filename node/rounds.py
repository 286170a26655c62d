"""A round as the daemon hands it on: `OpenRound` between its two halves (own samples made
and published; peers gathered and trained on), `RoundResult` once it is done, and the line
the status history keeps of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from node.groups import SELF, ScoredGroup
from node.serving.status import RoundRecord


@dataclass
class RoundResult:
    round: int
    reward_mean: float
    own_samples: int
    peer_samples: int
    peers_answered: int
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)
    round_in_run: int | None = None  # 1, 2, ... counted from this run's start (`round` is the bucket)
    notices: list[str] = field(default_factory=list)  # what the user should know about this round

    @classmethod
    def of(cls, opened: OpenRound, used, answered: int, metrics: dict, left_out: int, with_signal: int, notices):
        """A finished round: own samples' reward, what was trained on, the step's numeric metrics."""
        own_rewards = np.concatenate([g.rewards for g in opened.own]) if opened.own else np.zeros(0)
        return cls(
            round=opened.round,
            reward_mean=float(own_rewards.mean()) if own_rewards.size else 0.0,
            own_samples=int(own_rewards.size),
            peer_samples=sum(len(g.sequences) for g in used if g.source != SELF),
            peers_answered=answered,
            seconds=time.time() - opened.started_at,
            metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            | {"peer_groups_capped": left_out, "groups_with_signal": with_signal / len(used) if used else 0.0},
            round_in_run=opened.round_in_run,
            notices=notices,
        )

    def record(self, started_at: float) -> RoundRecord:
        """The status history's line for this round."""
        return RoundRecord(
            round=self.round,
            started_at=started_at,
            seconds=round(self.seconds, 3),
            reward_mean=self.reward_mean,
            own_samples=self.own_samples,
            peer_samples=self.peer_samples,
            peers_answered=self.peers_answered,
            metrics={k: float(v) for k, v in self.metrics.items()},
            round_in_run=self.round_in_run,
        )


@dataclass
class OpenRound:
    """A round between `begin_round` and `finish_round`."""

    round: int
    started_at: float
    own: list[ScoredGroup] = field(default_factory=list)
    round_in_run: int | None = None
