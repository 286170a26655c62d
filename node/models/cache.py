"""Where the project's own models are built, and how a build lands there atomically.

The cache root is ``$FTIS_CACHE`` or ``~/.cache/ftis-node``; model folders go in
``<root>/models``. This module imports nothing else from ``node.models``: the builders
(tiny, smollm) and the registry all import it, so none of them imports another's module
just for these helpers.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["ModelLoadError", "atomic_build", "cache_root", "is_model_folder", "models_dir"]


class ModelLoadError(RuntimeError):
    """A model that cannot be resolved, built or loaded, with what to do about it."""


def cache_root() -> Path:
    """``$FTIS_CACHE`` or ``~/.cache/ftis-node``."""
    return Path(os.environ.get("FTIS_CACHE") or Path.home() / ".cache" / "ftis-node").expanduser()


def models_dir(cache_dir: str | Path | None = None) -> Path:
    """The folder that holds built model folders (``cache_dir`` overrides the default)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "models"


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive lock across processes; the kernel drops it if the holder dies."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def atomic_build(final: Path, build: Callable[[Path], None]) -> Path:
    """Return ``final``, first creating it with ``build(tmp_folder)`` if it is missing.

    The build writes into a fresh temporary folder next to ``final``, which is then
    renamed into place (atomic on one filesystem): a reader sees no folder or a whole
    one. A lock file serialises builders; the second one finds the folder done.
    """
    if is_model_folder(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.parent / f".{final.name}.lock"):
        if is_model_folder(final):
            return final  # another process finished it while we waited
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a killed builder
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # not a model folder (e.g. emptied by hand): rebuild it
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache must stay readable
        try:
            build(tmp)
            if not is_model_folder(tmp):
                raise ModelLoadError(f"building {final.name} wrote no config.json")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
