"""The round's training step. A peer's groups that break it cost that peer its groups for
the round, never the node its round loop: the step is retried without the peers to blame
(those whose groups alone fail the trainer's checks, else every peer in the batch)."""

from __future__ import annotations

import logging
from typing import Any

from node.groups import SELF, ScoredGroup, to_train_batch

logger = logging.getLogger(__name__)


def train_step(trainer, groups: list[ScoredGroup]) -> dict[str, Any]:
    """One F-TIS step on `groups` (advantages within each group); {} for no groups, and
    `step_skipped` where the trainer refused the step (a non-finite loss or gradient)."""
    batch = to_train_batch(groups)
    if batch is None:
        return {}
    metrics = trainer.step(batch)
    if "skipped" in metrics:
        logger.warning("training step skipped: %s", metrics["skipped"])
        return metrics | {"step_skipped": 1}
    return metrics


def step_blaming_peers(trainer, used: list[ScoredGroup]) -> tuple[dict[str, Any], dict[str, int], str]:
    """`train_step(used)`; if it raises or skips with peers' groups in the batch, again without
    the blamed peers. Returns the metrics, the blamed peers with the samples each lost, and
    why (empty when nothing was blamed)."""
    steps = trainer.steps
    try:
        metrics = train_step(trainer, used)
        trouble = metrics.get("skipped")
    except Exception as err:
        if all(g.source == SELF for g in used):
            raise  # our own samples: a bug to see, not a peer to blame
        metrics, trouble = {}, f"{type(err).__name__}: {err}"
    peers = sorted({g.source for g in used if g.source != SELF})
    if trouble is None or not peers or trainer.steps != steps:
        return metrics, {}, ""
    blamed = _untrainable(trainer, used) or set(peers)
    lost = {peer: sum(len(g.sequences) for g in used if g.source == peer) for peer in sorted(blamed)}
    kept = [g for g in used if g.source not in blamed]
    return train_step(trainer, kept) | {"peer_groups_dropped": len(used) - len(kept)}, lost, str(trouble)


def _untrainable(trainer, used: list[ScoredGroup]) -> set[str]:
    """The peers whose groups alone fail the trainer's checks."""
    bad = set()
    for source in {g.source for g in used if g.source != SELF}:
        try:
            batch = to_train_batch([g for g in used if g.source == source])
            if batch is not None:
                trainer.check(batch)
        except Exception:
            bad.add(source)
    return bad
