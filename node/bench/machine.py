"""What machine a benchmark ran on: CPU, cores, memory, GPU, library versions, date.

A figure is only comparable with another taken on the same kind of machine, so every
benchmark report carries this description next to its numbers. Everything is read from
the running system (/proc, the process's CPU affinity, package metadata) rather than
assumed; a field that cannot be read is None, never a guess.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["describe_machine"]

# The vector extensions that decide CPU kernel speed (vLLM's CPU build picks one by them).
_ISA_FLAGS = ("avx", "avx2", "avx512f", "avx512_bf16", "amx_tile")
_PACKAGES = ("torch", "transformers", "peft", "hivemind", "numpy", "vllm")


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str | None, list[str]]:
    """(model name, the ISA flags of `_ISA_FLAGS` it has) from the first processor entry."""
    try:
        text = path.read_text()
    except OSError:
        return platform.processor() or None, []
    model: str | None = None
    flags: list[str] = []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            have = set(value.split())
            flags = [f for f in _ISA_FLAGS if f in have]
        if model is not None and flags:
            break
    return model, flags


def _meminfo_gib(path: Path = Path("/proc/meminfo")) -> dict[str, float | None]:
    """Total and available memory in GiB (/proc/meminfo reports kB)."""
    out: dict[str, float | None] = {"total_gib": None, "available_gib": None}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    names = {"MemTotal": "total_gib", "MemAvailable": "available_gib"}
    for line in lines:
        key, _, value = line.partition(":")
        if key in names:
            out[names[key]] = round(int(value.split()[0]) / 2**20, 2)
    return out


def _version(package: str) -> str | None:
    # Metadata, not an import: `import hivemind` alone costs seconds and imports torch.
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _gpus() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 2)})
    return gpus


def describe_machine() -> dict[str, Any]:
    """A JSON-able description of this machine and software stack."""
    import torch

    model, isa = _cpuinfo()
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity mask to read
        usable = os.cpu_count()
    return {
        "cpu_model": model,
        "cpu_isa": isa,
        "cores_logical": os.cpu_count(),
        "cores_usable": usable,  # the affinity mask: what this process may actually run on
        "memory": _meminfo_gib(),
        "gpus": _gpus(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "versions": {p: _version(p) for p in _PACKAGES},
        "torch_threads": torch.get_num_threads(),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
