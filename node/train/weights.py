"""Weights in memory: copying a state into a model in place, and the id of a set of weights.

`copy_state_into` serves both ways weights reach a model without reloading it: a model
folder's safetensors (`load_safetensors_into`, checkpoints and the hf engine's full-folder
loads) and the trainer's live tensors handed to the hf engine each round.

`weights_version` is the adapter version peers see in packet headers, cheap enough to
compute every round on a 3B model.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

__all__ = ["VERSION_SAMPLES", "copy_state_into", "full_digest", "load_safetensors_into", "weights_version"]


def load_safetensors_into(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy a model folder's safetensors into `model`'s existing tensors, in place (`copy_state_into`)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    copy_state_into(model, state, source=str(folder))


def copy_state_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, source: str = "state") -> None:
    """Copy `state` (name -> tensor, as `model.state_dict()` names them) into `model`'s tensors, in place.

    Names and shapes are all checked before the first copy, so a bad state leaves the
    model untouched. Tied weights (lm_head = embed_tokens) are written once: a file
    stores them once, and a live state dict that lists both names is copied once.
    """
    current = model.state_dict()
    unexpected = sorted(set(state) - set(current))
    if unexpected:
        raise ValueError(f"{source}: tensors the model does not have: {unexpected[:5]}")
    for name, tensor in state.items():
        if tensor.shape != current[name].shape:
            raise ValueError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the model {tuple(current[name].shape)}"
            )
    # named_parameters() lists a tied tensor once, so only truly absent weights show here.
    missing = sorted({name for name, _ in model.named_parameters()} - set(state))
    if missing:
        raise ValueError(f"{source}: weights missing: {missing[:5]}")
    written: set[int] = set()
    with torch.no_grad():
        for name, tensor in state.items():
            target = current[name]
            if target.data_ptr() in written:  # the second name of a tied weight
                continue
            target.copy_(tensor)
            written.add(target.data_ptr())


# How many elements of each tensor the adapter version reads (all of a smaller tensor).
VERSION_SAMPLES = 1024
_GOLDEN = 0.6180339887498949


def _sample_index(numel: int, device: torch.device) -> torch.Tensor:
    """Fixed positions spread over a flat tensor of `numel` elements (the same in every process):
    the golden-ratio sequence, which no stride or row length aliases with."""
    key = (numel, str(device))
    index = _INDEX_CACHE.get(key)
    if index is None:
        if numel <= VERSION_SAMPLES:
            positions = np.arange(numel, dtype=np.int64)
        else:
            positions = np.floor((np.arange(VERSION_SAMPLES) * _GOLDEN) % 1.0 * numel).astype(np.int64)
        index = _INDEX_CACHE[key] = torch.from_numpy(positions).to(device)
    return index


_INDEX_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def weights_version(named: list[tuple[str, torch.Tensor]], steps: int) -> str:
    """A 16-hex id of the published weights that costs ~nothing per round, even for a 3B model.

    It hashes the step count, every tensor's name, shape and dtype, and a fixed sample of
    `VERSION_SAMPLES` values per tensor (all of a small one), gathered on the tensors'
    device and moved to the CPU in one transfer: kilobytes, where hashing everything
    moved and read the whole state every round (gigabytes for a full fine-tune). The
    same weights after the same number of steps give the same id in any process, which
    is what peers see in packet headers and what a resumed checkpoint is checked against;
    an optimizer step changes it through the step count even where the sample would miss
    the change. The checkpoint's per-file sha256 is the full-content check.
    """
    h = hashlib.sha256(f"steps:{steps}\n".encode())
    picks: list[torch.Tensor] = []
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
        flat = t.detach().reshape(-1)
        picks.append(flat[_sample_index(flat.numel(), flat.device)].to(torch.float64))  # exact for every float
    if picks:
        by_device: dict[str, list[torch.Tensor]] = defaultdict(list)
        for p in picks:
            by_device[str(p.device)].append(p)
        for device in sorted(by_device):
            h.update(torch.cat(by_device[device]).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def full_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """The version format-1 checkpoints recorded: every byte of every tensor (resume checks only)."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
