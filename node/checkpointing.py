"""When a node writes its durable checkpoint: after its first trained round (so a young node
can be exported), every `checkpoint_every` rounds, and at stop, so a crash loses at most that
many rounds. A round's checkpoint is a snapshot written in the background while the next
round runs; it is on disk before that next round is recorded as played."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class CheckpointSchedule:
    def __init__(self, trainer, ckpt_dir: Path, every: int, extra: dict[str, Any]) -> None:
        from node.train.checkpoint import CheckpointWriter  # torch: not at the daemon's import

        self.trainer, self.ckpt_dir, self.every, self.extra = trainer, ckpt_dir, every, extra
        self.writer = CheckpointWriter()
        self.dirty = False  # trained since the last checkpoint
        self.unsaved = 0  # rounds played since the last checkpoint
        self.has_one = False  # none yet: the first trained round writes one

    def round_played(self) -> bool:
        """Count a played round; True if a checkpoint is due now. Waits for the previous
        round's background write first, so that one is on disk before this round counts."""
        self.unsaved += 1
        self.writer.wait()
        return self.dirty and (self.unsaved >= self.every or not self.has_one)

    def write(self, r: int, *, background: bool = False) -> None:
        """A durable, atomic checkpoint of round `r`: weights, optimizer, RNG and hashes.
        `background`: snapshot the state now and write it while the loop goes on."""
        job = self.trainer.checkpoint_job(self.ckpt_dir, r, extra=self.extra, snapshot=background)
        self.writer.wait()
        if background:
            self.writer.submit(job)
        else:
            job()
        self.dirty, self.unsaved, self.has_one = False, 0, True

    def final(self, round_done: int | None) -> None:
        """At stop: the background write finished (or written again if it failed), and a last
        checkpoint if anything was trained since."""
        try:
            self.writer.wait()
        except Exception as e:  # the final checkpoint below writes it again
            logger.error("the last background checkpoint failed: %s", e)
            self.dirty = True
        if self.dirty and round_done is not None:
            self.write(round_done)
