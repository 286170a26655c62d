"""What a restarted node tells its operator: the checkpoint it went on from and the rounds
played after it that are lost, or, with no checkpoint, that the earlier run's rounds are lost.
The rounds played come from the status.json the earlier run left behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def rounds_played(node_dir: Path) -> list[int]:
    """The rounds the previous run recorded in status.json (none if it left no file)."""
    try:
        history = json.loads((node_dir / "status.json").read_text()).get("history") or []
        return [int(h["round"]) for h in history]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


def resumed(ckpt, played: list[int], checkpoint_every: int) -> tuple[str, dict[str, Any]]:
    """The log line and the status's `resumed_from` for a resume from `ckpt` (a `LoadedCheckpoint`)."""
    after = [r for r in played if r > ckpt.round]
    lost = (
        f"{len(after)} round(s) played after it (up to round {max(after)}) were lost"
        if after
        else "nothing played after it was lost"
    )
    line = (
        f"resumed from checkpoint {ckpt.path.name} (round {ckpt.round}, step {ckpt.meta.step}, "
        f"adapter {ckpt.meta.adapter_version}); {lost} (a checkpoint every {checkpoint_every} rounds)"
    )
    return line, {
        "round": ckpt.round,
        "step": ckpt.meta.step,
        "adapter_version": ckpt.meta.adapter_version,
        "lost_rounds": len(after),
    }


def started_fresh(ckpt_dir: Path, played: list[int], checkpoint_every: int) -> tuple[str, dict[str, Any]] | None:
    """The warning and the status's `started_fresh` when no checkpoint was found but an earlier
    run played rounds; None when there was no earlier run."""
    if not played:
        return None
    message = (
        f"no checkpoint in {ckpt_dir}: the {len(played)} round(s) the earlier run played "
        f"(up to round {max(played)}) are lost; starting fresh from the model's own weights "
        f"(a checkpoint is written every {checkpoint_every} rounds)"
    )
    return message, {"lost_rounds": len(played), "last_round": max(played)}
