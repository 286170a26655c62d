"""Checkpoint verification, fallback and retention, in process on real trainers.

(The same faults through real node processes, SIGKILL included, are in
test_checkpoint_faults.py.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.train.checkpoint import (
    CheckpointError,
    NoUsableCheckpoint,
    load_checkpoint,
    load_latest,
    verify_checkpoint,
)
from node.train.trainer import Trainer, TrainerConfig
from node.train.weights import full_digest, weights_version


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _edit_meta(folder: Path, **fields) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(fields)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def _truncate_weights(folder: Path) -> None:
    weights = next((folder / "weights").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-9])


@pytest.fixture
def trainer(tiny_model_dir: Path) -> Trainer:
    return Trainer(tiny_model_dir, TrainerConfig(lr=3e-3))


def test_an_edited_meta_json_does_not_verify(trainer: Trainer, tmp_path: Path) -> None:
    ckpt = trainer.save_checkpoint(tmp_path, round=4)
    assert ckpt.meta.digest == ckpt.meta.content_digest()
    assert load_checkpoint(ckpt.path).meta == ckpt.meta
    _edit_meta(ckpt.path, step=9)  # every file still matches its sha256; only the meta lies
    with pytest.raises(CheckpointError, match="meta.json was edited"):
        load_checkpoint(ckpt.path)


def test_format_1_checkpoints_still_resume(tiny_model_dir: Path, trainer: Trainer, tmp_path: Path) -> None:
    """A checkpoint of the previous format (no digest; the version a full-content hash) resumes."""
    ckpt = trainer.save_checkpoint(tmp_path, round=1)
    _edit_meta(ckpt.path, format=1, digest=None, adapter_version=full_digest(list(trainer.published_state().items())))
    other = Trainer(tiny_model_dir, TrainerConfig(lr=3e-3, seed=5))
    other.resume(load_checkpoint(ckpt.path))
    assert other.adapter_version == trainer.adapter_version


def test_retention_never_drops_a_good_checkpoint_for_a_bad_one(trainer: Trainer, tmp_path: Path, caplog) -> None:
    for r in (1, 2):
        trainer.save_checkpoint(tmp_path, round=r)
    # Two bad folders numbered above every good one (a copied folder, an edited meta).
    for r, spoil in ((8, _truncate_weights), (9, lambda f: _edit_meta(f, round=9))):
        shutil.copytree(tmp_path / "round-00000002", tmp_path / f"round-{r:08d}")
        spoil(tmp_path / f"round-{r:08d}")
    with caplog.at_level(logging.WARNING):
        trainer.save_checkpoint(tmp_path, round=3)  # keep=3: round 3 and the two good ones before it
    assert _names(tmp_path) == [
        "latest",
        "rejected-round-00000008",
        "rejected-round-00000009",
        "round-00000001",
        "round-00000002",
        "round-00000003",
    ]
    assert "round-00000008 does not verify" in caplog.text and "set aside as rejected-round-00000008" in caplog.text
    trainer.save_checkpoint(tmp_path, round=4)
    kept = [n for n in _names(tmp_path) if n.startswith("round-")]
    assert kept == ["round-00000002", "round-00000003", "round-00000004"]
    assert load_latest(tmp_path).round == 4


def test_load_latest_falls_back_past_a_checkpoint_restore_refuses(trainer: Trainer, tmp_path: Path, caplog) -> None:
    for r in (1, 2):
        trainer.save_checkpoint(tmp_path, round=r)
    tried = []

    def restore(ckpt) -> None:
        tried.append(ckpt.round)
        if ckpt.round == 2:
            raise CheckpointError(f"{ckpt.path}: restored weights do not hash to the recorded version")

    with caplog.at_level(logging.WARNING):
        assert load_latest(tmp_path, restore=restore).round == 1
    assert tried == [2, 1]
    assert "skipping checkpoint" in caplog.text and "do not hash" in caplog.text


def test_strict_load_refuses_when_no_checkpoint_is_usable(trainer: Trainer, tmp_path: Path) -> None:
    assert load_latest(tmp_path / "none", strict=True) is None  # nothing there: a fresh start is fine
    saved = [trainer.save_checkpoint(tmp_path, round=r) for r in (1, 2)]
    for ckpt in saved:
        _truncate_weights(ckpt.path)
    assert load_latest(tmp_path) is None
    with pytest.raises(NoUsableCheckpoint) as err:
        load_latest(tmp_path, strict=True)
    message = str(err.value)
    assert "\n" not in message
    assert "none of the 2 checkpoint(s)" in message and "round-00000002" in message and "bytes, expected" in message
    assert _names(tmp_path) == ["latest", "round-00000001", "round-00000002"]  # loading changes nothing


def test_a_verdict_is_remembered_until_a_file_changes(trainer: Trainer, tmp_path: Path) -> None:
    ckpt = trainer.save_checkpoint(tmp_path, round=1)
    assert verify_checkpoint(ckpt.path).meta == ckpt.meta
    optimizer = ckpt.path / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, new content (and a new mtime)
    optimizer.write_bytes(bytes(data))
    os.utime(optimizer, ns=(0, 10**9))
    with pytest.raises(CheckpointError, match="optimizer.pt does not match its sha256"):
        verify_checkpoint(ckpt.path)


def test_adapter_version_follows_the_weights_and_is_the_same_in_another_process(
    tiny_model_dir: Path, trainer: Trainer
) -> None:
    from test_trainer import make_batch

    batch = make_batch(tiny_model_dir)
    twin = Trainer(tiny_model_dir, TrainerConfig(lr=3e-3))
    assert twin.adapter_version == trainer.adapter_version  # same init, same id
    script = (
        "from node.train.trainer import Trainer, TrainerConfig;"
        f"print(Trainer({str(tiny_model_dir)!r}, TrainerConfig(lr=3e-3)).adapter_version)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == trainer.adapter_version
    trainer.step(batch)
    assert trainer.adapter_version != twin.adapter_version
    # The id reads every element of a small tensor and a fixed sample of a large one.
    named = list(trainer.published_state().items())
    small = dict(named)
    name = next(n for n, t in named if t.numel() <= 1024)
    changed = [(n, t.clone()) for n, t in named]
    changed[[n for n, _ in changed].index(name)][1].view(-1)[-1] += 1.0
    assert weights_version(changed, 1) != weights_version(named, 1) == trainer.adapter_version
    assert weights_version(named, 2) != weights_version(named, 1)  # a step is a new version
    assert torch.equal(small[name], dict(trainer.published_state())[name])  # live tensors, untouched
