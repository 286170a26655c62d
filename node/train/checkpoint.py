"""Atomic training checkpoints: a crash at any point leaves the last good one loadable.

Layout under a checkpoint root:

    round-00000012/
        weights/        a peft adapter folder (LoRA) or a full model folder
        optimizer.pt    the optimizer's state_dict
        rng.pt          python, numpy and torch RNG states
        meta.json       round, step, adapter version, size + sha256 of every file, and
                        the sha256 of its own other fields (an edited meta.json shows)
    latest              name of the newest complete checkpoint (one line)
    rejected-round-00000011/   a checkpoint that failed verification, set aside (kept)

A checkpoint is assembled in a hidden temp folder next to its final place and renamed
into place only once complete; `meta.json` is written last, so a folder without it, or
whose files disagree with it, is incomplete or corrupt. `latest` is replaced with
os.replace, so readers see the old or the new pointer, never a torn one. `load_latest`
follows the pointer and, if that checkpoint does not verify (or the caller's `restore`
refuses it), falls back to the newest one that does.

Retention keeps the newest `keep` checkpoints that VERIFY: a folder that fails is not
counted, so it can never cost a good checkpoint its place; once a newer good one exists
it is renamed `rejected-<name>` (out of the way of loading and pruning, left for the
operator to inspect). Verification hashes every file, so its result is remembered per
folder for as long as none of the folder's files changes (size, mtime): a node hashes a
checkpoint it wrote, or one it resumed from, once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from node.train.weights import copy_state_into, load_safetensors_into

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointWriter",
    "FileRecord",
    "NoUsableCheckpoint",
    "checkpoint_folders",
    "copy_state_into",
    "load_checkpoint",
    "load_latest",
    "load_safetensors_into",
    "verify_checkpoint",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: meta.json carries the digest of its own fields
READABLE_FORMATS = (1, 2)
LATEST = "latest"
META = "meta.json"
WEIGHTS = "weights"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
_NAME = re.compile(r"^round-(\d{8,})$")
_SCRATCH_PREFIXES = (".tmp-", ".old-")
REJECTED_PREFIX = "rejected-"


class CheckpointError(RuntimeError):
    """A checkpoint folder that is incomplete, corrupt or of another format."""


class NoUsableCheckpoint(CheckpointError):
    """Checkpoint folders exist, but none of them verifies: resuming would silently start over."""


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
    digest: str | None = Field(None, description="sha256 of the other fields (format 2 on); None while building.")

    def content_digest(self) -> str:
        """The sha256 of every field but `digest`, as canonical JSON."""
        fields = self.model_dump(mode="json", exclude={"digest"})
        return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def sealed(self) -> CheckpointMeta:
        return self.model_copy(update={"digest": self.content_digest()})


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
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # legacy=True: the (kind, keys, pos, has_gauss, gauss) tuple
    kind, keys, pos, has_gauss, gauss = legacy
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


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):  # files before the folders that list them
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            _fsync_dir(p)
    _fsync_dir(folder)


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
    write_weights: Callable[[Path], object],
    optimizer_state: dict[str, Any],
    step: int,
    mode: Literal["lora", "full"],
    adapter_version: str,
    extra: dict[str, Any] | None = None,
    keep: int = 3,
    on_stage: Callable[[str], None] | None = None,
    rng: dict[str, Any] | None = None,
) -> Checkpoint:
    """Write checkpoint `round` under `root` atomically, point `latest` at it, keep the newest `keep`.

    `write_weights(folder)` saves the adapter or model into a folder it creates.
    `rng`: the RNG states to record (`rng_state()` taken when the snapshot was; None: now).
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
        torch.save(rng if rng is not None else rng_state(), tmp / RNG)
        stage("rng")
        _fsync_tree(tmp)  # the data is on disk before meta.json says the folder is complete
        meta = CheckpointMeta(
            round=round,
            step=step,
            mode=mode,
            adapter_version=adapter_version,
            created_at=time.time(),
            files=_records(tmp),
            extra=extra or {},
        ).sealed()
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
    _remember(final, Checkpoint(final, meta))  # its files were hashed a moment ago
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
    """Keep `protect` (just written, good) and the newest `keep - 1` others that verify.

    Older folders go once `keep` good ones are counted, unverified (none of them is kept
    in the place of a good one); a folder that fails verification before then is set
    aside as `rejected-<name>`, never deleted and never counted.
    """
    good = 1
    for _, path in _round_dirs(root):
        if path == protect:
            continue
        if good >= keep:
            shutil.rmtree(path, ignore_errors=True)
            _forget(path)
            continue
        try:
            verify_checkpoint(path)
            good += 1
        except CheckpointError as error:
            _reject(root, path, error)


def _reject(root: Path, path: Path, error: CheckpointError) -> None:
    target = root / f"{REJECTED_PREFIX}{path.name}"
    if target.exists():
        target = root / f"{REJECTED_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    os.replace(path, target)
    _forget(path)
    log.warning("checkpoint %s does not verify (%s); set aside as %s", path.name, _reason(error, False), target.name)


class CheckpointWriter:
    """Writes checkpoints in a worker thread, one at a time.

    A round pays for a snapshot of the state (a memory copy); the files, their fsyncs and
    their hashes are written while the next round generates and trains. The caller
    `wait()`s before it records the next round as played, so a crash still loses at
    most `checkpoint_every` rounds. A failed write is raised by the next `wait()` or
    `submit()`, never lost.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: Checkpoint | None = None
        self.last_write_s = 0.0  # how long the newest write took in the background

    def submit(self, write: Callable[[], Checkpoint]) -> None:
        self.wait()  # one in flight: a slow disk holds the loop back, snapshots never pile up

        def run() -> None:
            start = time.perf_counter()
            try:
                self.last = write()
            except BaseException as e:  # handed to the caller's thread by wait()
                self._error = e
            self.last_write_s = time.perf_counter() - start

        self._thread = threading.Thread(target=run, name="checkpoint-writer")
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Checkpoint | None:
        """Block until the write in flight (if any) is on disk; the newest checkpoint written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last


# --------------------------------------------------------------------------- load


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verify one checkpoint folder (meta parses and is unedited, every file present with its size and hash)."""
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: no {META} (incomplete save)")
    try:
        meta = CheckpointMeta.model_validate_json(meta_file.read_text())
    except (ValidationError, ValueError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable {META}: {e}") from e
    if meta.format not in READABLE_FORMATS:
        raise CheckpointError(f"{path}: format {meta.format}, this node reads {', '.join(map(str, READABLE_FORMATS))}")
    if meta.format >= 2 and meta.digest != meta.content_digest():
        raise CheckpointError(f"{path}: {META} was edited (it does not match its digest)")
    for required in (OPTIMIZER, RNG):
        if required not in meta.files:
            raise CheckpointError(f"{path}: {META} lists no {required}")
    if not any(name.startswith(WEIGHTS + "/") for name in meta.files):
        raise CheckpointError(f"{path}: {META} lists no weights")
    for rel, record in meta.files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: missing {rel}")
        try:
            size, digest = f.stat().st_size, _sha256(f) if f.stat().st_size == record.size else ""
        except OSError as e:  # unreadable is unusable: the caller falls back, nothing is deleted
            raise CheckpointError(f"{path}: cannot read {rel}: {e}") from e
        if size != record.size:
            raise CheckpointError(f"{path}: {rel} is {size} bytes, expected {record.size}")
        if digest != record.sha256:
            raise CheckpointError(f"{path}: {rel} does not match its sha256")
    return Checkpoint(path, meta)


def checkpoint_folders(root: str | Path) -> list[Path]:
    """Every checkpoint-named folder under `root`, newest round first, verified or not."""
    root = Path(root)
    return [p for _, p in _round_dirs(root)] if root.is_dir() else []


def _candidates(root: Path) -> Iterator[Path]:
    """The `latest` pointer's folder first, then every round folder newest first."""
    pointer = root / LATEST
    named: Path | None = None
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _NAME.match(name) and (root / name).is_dir():
            named = root / name
            yield named
        else:
            log.warning("checkpoint pointer %s names %r, which is not a checkpoint folder", pointer, name)
    for path in checkpoint_folders(root):
        if path != named:
            yield path


def load_latest(
    root: str | Path,
    *,
    restore: Callable[[Checkpoint], None] | None = None,
    strict: bool = False,
) -> Checkpoint | None:
    """The newest checkpoint under `root` that verifies, or None if there is none.

    Tries the `latest` pointer first, then every round folder newest first, logging a
    warning for each one skipped and why. `restore(ckpt)`, if given, is the caller's
    use of a verified checkpoint (e.g. `Trainer.resume`); a `CheckpointError` from it
    skips that checkpoint too, and the next one is restored over whatever it left.
    `strict`: if checkpoint folders exist but none is usable, raise `NoUsableCheckpoint`
    (one line, naming the newest one's fault) instead of returning None, so a resume
    never silently starts again from scratch.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    errors: list[CheckpointError] = []
    for path in _candidates(root):
        try:
            ckpt = verify_checkpoint(path)
            if restore is not None:
                restore(ckpt)
            return ckpt
        except CheckpointError as e:
            _remember(path, e)
            errors.append(e)
            log.warning("skipping checkpoint: %s", e)
    if strict and errors:
        raise NoUsableCheckpoint(
            f"none of the {len(errors)} checkpoint(s) in {root} can be resumed (newest: {_reason(errors[0])}); "
            f"refusing to start again from scratch over them: move {root} away to start afresh, "
            "or put a good checkpoint back"
        )
    return None


# --------------------------------------------------------------------------- verification cache

# folder -> (size and mtime of every file in it, its verdict: the Checkpoint or the error)
_VERIFIED: dict[Path, tuple[tuple[tuple[str, int, int], ...], Checkpoint | CheckpointError]] = {}


def _fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for p in sorted(path.rglob("*")):
        if p.is_file():
            st = p.stat()
            out.append((p.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns))
    return tuple(out)


def verify_checkpoint(path: str | Path) -> Checkpoint:
    """`load_checkpoint(path)`, remembered: the files are hashed again only if one of them changed."""
    path = Path(path)
    key = path.resolve()
    fingerprint = _fingerprint(path)
    known = _VERIFIED.get(key)
    if known is not None and known[0] == fingerprint:
        verdict = known[1]
    else:
        try:
            verdict = load_checkpoint(path)
        except CheckpointError as e:
            verdict = e
        _VERIFIED[key] = (fingerprint, verdict)
    if isinstance(verdict, CheckpointError):
        raise verdict
    return Checkpoint(path, verdict.meta)


def _remember(path: Path, verdict: Checkpoint | CheckpointError) -> None:
    _VERIFIED[path.resolve()] = (_fingerprint(path), verdict)


def _forget(path: Path) -> None:
    _VERIFIED.pop(path.resolve(), None)


def _reason(error: Exception, named: bool = True) -> str:
    """An error's message with its leading folder path cut to the folder's name (`named`) or dropped."""
    text = str(error)
    path, sep, rest = text.partition(": ")
    if not (sep and os.sep in path):
        return text
    return f"{Path(path).name}: {rest}" if named else rest
