"""Atomic training checkpoints: a crash at any point leaves the last good one loadable.

Layout under a checkpoint root:

    round-00000012/
        weights/        a peft adapter folder (LoRA) or a full model folder
        optimizer.pt    the optimizer's state_dict
        rng.pt          python, numpy and torch RNG states
        meta.json       round, step, adapter version, and size + sha256 of every file
    latest              name of the newest complete checkpoint (one line)

A checkpoint is assembled in a hidden temp folder next to its final place and renamed
into place only once complete; `meta.json` is written last, so a folder without it, or
whose files disagree with it, is incomplete or corrupt. `latest` is replaced with
os.replace, so readers see the old or the new pointer, never a torn one. `load_latest`
follows the pointer and, if that checkpoint does not verify, falls back to the newest
one that does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load_file

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointMeta",
    "FileRecord",
    "load_checkpoint",
    "load_latest",
    "load_safetensors_into",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST = "latest"
META = "meta.json"
WEIGHTS = "weights"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
_NAME = re.compile(r"^round-(\d{8,})$")
_SCRATCH_PREFIXES = (".tmp-", ".old-")


class CheckpointError(RuntimeError):
    """A checkpoint folder that is incomplete, corrupt or of another format."""


class FileRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0)
    sha256: str


class CheckpointMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT_VERSION
    round: int = Field(ge=0)
    step: int = Field(ge=0, description="Optimizer steps taken when the checkpoint was written.")
    mode: Literal["lora", "full"]
    adapter_version: str
    created_at: float
    files: dict[str, FileRecord] = Field(description="Every file but meta.json, by path relative to the folder.")
    extra: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint folder."""

    path: Path
    meta: CheckpointMeta

    @property
    def round(self) -> int:
        return self.meta.round

    @property
    def weights_dir(self) -> Path:
        return self.path / WEIGHTS

    @property
    def optimizer_path(self) -> Path:
        return self.path / OPTIMIZER

    @property
    def rng_path(self) -> Path:
        return self.path / RNG


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch RNG states, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- weights


def load_safetensors_into(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy a model folder's safetensors into `model`'s existing tensors, in place.

    Names and shapes are all checked before the first copy, so a bad folder leaves the
    model untouched. Tied weights (lm_head = embed_tokens) are stored once in the file
    and need no second copy.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    current = model.state_dict()
    unexpected = sorted(set(state) - set(current))
    if unexpected:
        raise ValueError(f"{folder}: tensors the model does not have: {unexpected[:5]}")
    for name, tensor in state.items():
        if tensor.shape != current[name].shape:
            raise ValueError(
                f"{folder}: {name} has shape {tuple(tensor.shape)}, the model {tuple(current[name].shape)}"
            )
    # named_parameters() lists a tied tensor once, so only truly absent weights show here.
    missing = sorted({name for name, _ in model.named_parameters()} - set(state))
    if missing:
        raise ValueError(f"{folder}: weights missing from the folder: {missing[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            current[name].copy_(tensor)


# --------------------------------------------------------------------------- files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _records(folder: Path) -> dict[str, FileRecord]:
    return {
        p.relative_to(folder).as_posix(): FileRecord(size=p.stat().st_size, sha256=_sha256(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != META
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _round_dirs(root: Path) -> list[tuple[int, Path]]:
    """(round, folder) of every checkpoint-named folder, newest first."""
    found = []
    for p in root.iterdir():
        if p.is_dir() and (m := _NAME.match(p.name)):
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


# --------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | Path,
    round: int,
    *,
    write_weights: Callable[[Path], None],
    optimizer_state: dict[str, Any],
    step: int,
    mode: Literal["lora", "full"],
    adapter_version: str,
    extra: dict[str, Any] | None = None,
    keep: int = 3,
    on_stage: Callable[[str], None] | None = None,
) -> Checkpoint:
    """Write checkpoint `round` under `root` atomically, point `latest` at it, keep the newest `keep`.

    `write_weights(folder)` saves the adapter or model into a folder it creates.
    `on_stage(name)` is called after each stage ("weights", "optimizer", "rng", "meta",
    "done"): a progress hook, and the place a test can interrupt a save.
    """
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_scratch(root)
    stage = on_stage or (lambda _name: None)
    name = f"round-{round:08d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        write_weights(tmp / WEIGHTS)
        stage("weights")
        torch.save(optimizer_state, tmp / OPTIMIZER)
        stage("optimizer")
        torch.save(rng_state(), tmp / RNG)
        stage("rng")
        meta = CheckpointMeta(
            round=round,
            step=step,
            mode=mode,
            adapter_version=adapter_version,
            created_at=time.time(),
            files=_records(tmp),
            extra=extra or {},
        )
        _write_durably(tmp / META, meta.model_dump_json(indent=1))  # last: marks the folder complete
        stage("meta")
        if final.exists():  # re-saving a round: move the old one aside, then swap
            old = root / f".old-{name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        pointer = root / f".tmp-{LATEST}-{uuid.uuid4().hex[:8]}"
        _write_durably(pointer, name + "\n")
        os.replace(pointer, root / LATEST)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep, protect=final)
    stage("done")
    return Checkpoint(final, meta)


def _remove_scratch(root: Path) -> None:
    """Delete temp folders a crashed save left behind (one writer per root is assumed)."""
    for p in root.iterdir():
        if p.name.startswith(_SCRATCH_PREFIXES):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _prune(root: Path, keep: int, protect: Path) -> None:
    for _, path in _round_dirs(root)[keep:]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- load


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verify one checkpoint folder (meta parses, every file present with its size and hash)."""
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: no {META} (incomplete save)")
    try:
        meta = CheckpointMeta.model_validate_json(meta_file.read_text())
    except (ValidationError, ValueError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable {META}: {e}") from e
    if meta.format != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {meta.format}, this node reads {FORMAT_VERSION}")
    for required in (OPTIMIZER, RNG):
        if required not in meta.files:
            raise CheckpointError(f"{path}: {META} lists no {required}")
    if not any(name.startswith(WEIGHTS + "/") for name in meta.files):
        raise CheckpointError(f"{path}: {META} lists no weights")
    for rel, record in meta.files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: missing {rel}")
        if f.stat().st_size != record.size:
            raise CheckpointError(f"{path}: {rel} is {f.stat().st_size} bytes, expected {record.size}")
        if _sha256(f) != record.sha256:
            raise CheckpointError(f"{path}: {rel} does not match its sha256")
    return Checkpoint(path, meta)


def load_latest(root: str | Path) -> Checkpoint | None:
    """The newest checkpoint under `root` that verifies, or None if there is none.

    Tries the `latest` pointer first, then every round folder newest first, logging why
    each skipped one was skipped.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates: list[Path] = []
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _NAME.match(name) and (root / name).is_dir():
            candidates.append(root / name)
        else:
            log.warning("checkpoint pointer %s names %r, which is not a checkpoint folder", pointer, name)
    candidates += [p for _, p in _round_dirs(root) if p not in candidates]
    for path in candidates:
        try:
            return load_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
    return None
