"""`ftis-node export DATA_DIR OUT`: a node's newest good checkpoint as a folder other tools load.

A LoRA node exports its adapter (peft format), the tokenizer beside it and a model card.
`adapter_config.json` names a base that resolves on another machine: the Hub id for a
Hub model, or `base`, a copy of the base model inside the export, for the project's own
models and local folders (which exist on this machine only). So either of

    AutoPeftModelForCausalLM.from_pretrained(OUT)          # Hub base
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT / "base"), OUT)

works, and vLLM takes `LLM(model=<base>, enable_lora=True)` with `LoRARequest(..., OUT)`.
`--merge` (and any full fine-tune) writes plain full weights instead: a folder that
`AutoModelForCausalLM.from_pretrained(OUT)` and `vllm.LLM(model=OUT)` load directly.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["ExportError", "export_checkpoint"]

BASE_DIR = "base"  # inside the export: a copy of a base model that is not on the Hub
_BASE_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")


class ExportError(RuntimeError):
    """Nothing to export, or a checkpoint that does not say which base model it trained."""


def _checkpoints(data_dir: Path) -> Path:
    for candidate in (data_dir / "checkpoints", data_dir):
        if candidate.is_dir() and (any(candidate.glob("round-*")) or (candidate / "latest").exists()):
            return candidate
    raise ExportError(f"{data_dir}: no checkpoints (expected {data_dir / 'checkpoints'}/round-*); is it a --data-dir?")


def _read_status(data_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((data_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _copy_model_files(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in _BASE_FILES:
        for path in source.glob(pattern):
            if path.is_file() and not path.name.startswith("ftis_"):
                shutil.copy2(path, dest / path.name)


def _base_for_others(model: str) -> tuple[str, Path | None]:
    """(the base id others can load, a local folder to copy into the export or None)."""
    from node.models import model_folder, resolve_model

    spec = resolve_model(model)
    if spec.kind == "hub" and spec.hf_id is not None:
        return spec.hf_id, None
    return BASE_DIR, Path(model_folder(spec, progress=False))


def _rounds_at(history: list[dict[str, Any]], round_id: int) -> str:
    """Rounds the node had played when it wrote the checkpoint of `round_id` (a time bucket, not a count)."""
    played = next((h.get("round_in_run") for h in history if h.get("round") == round_id), None)
    return "? rounds" if played is None else f"{played} round{'' if played == 1 else 's'}"


def _card(status: dict[str, Any], meta: Any, base_id: str, merged: bool, mode: str) -> str:
    history = status.get("history") or []
    rewards = [r.get("reward_mean") for r in history if r.get("reward_mean") is not None]
    peers = status.get("peers") or {}
    base_shown = base_id if base_id != BASE_DIR else f"the copy in ./base ({status.get('model')})"
    kind = "merged full weights" if merged or mode == "full" else "a LoRA adapter (peft)"
    lines = [
        "---",
        f"base_model: {base_id}" if base_id != BASE_DIR else "base_model: ./base",
        *(["library_name: peft"] if kind.startswith("a LoRA") else []),
        "tags: [ftis-node, f-tis, grpo, reinforcement-learning]",
        "---",
        "",
        f"# {status.get('name', 'ftis-node')}: {status.get('model', '?')} trained with ftis-node",
        "",
        f"This folder holds {kind}, exported from checkpoint round {meta.round} (adapter version "
        f"{meta.adapter_version}, {meta.step} optimizer steps).",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {base_shown} |",
        f"| swarm | {status.get('swarm_id') or '–'} (peer {status.get('peer_id') or '–'}, {len(peers)} peers seen) |",
        f"| task | {status.get('task', meta.extra.get('task', '?'))} |",
        f"| loss | {status.get('loss', '?')} |",
        f"| trained | {_rounds_at(history, meta.round)}, {meta.step} optimizer steps (checkpoint of round "
        f"{meta.round}) |",
        f"| reward, first / last round | {_fmt(rewards[0] if rewards else None)} / "
        f"{_fmt(rewards[-1] if rewards else None)} |",
        f"| exported | {time.strftime('%Y-%m-%d %H:%M:%S')} |",
        "",
        "## Loading",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
    ]
    if kind.startswith("a LoRA"):
        base_path = '"' + base_id + '"' if base_id != BASE_DIR else 'OUT + "/base"'
        lines += [
            "from peft import PeftModel",
            f"base = AutoModelForCausalLM.from_pretrained({base_path})",
            "model = PeftModel.from_pretrained(base, OUT)",
            "tokenizer = AutoTokenizer.from_pretrained(OUT)",
            "```",
            "",
            f"vLLM: `LLM(model={base_path}, enable_lora=True)` and `LoRARequest('ftis', 1, OUT)`.",
        ]
        if base_id == BASE_DIR:  # a relative id: peft resolves it from the working directory
            lines += [
                "",
                "`AutoPeftModelForCausalLM.from_pretrained(OUT)` reads the base id `./base` relative to the",
                "current folder: run it from inside OUT, or load the base first as above.",
            ]
    else:
        lines += [
            "model = AutoModelForCausalLM.from_pretrained(OUT)",
            "tokenizer = AutoTokenizer.from_pretrained(OUT)",
            "```",
            "",
            "vLLM: `LLM(model=OUT)`.",
        ]
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _merge(weights: Path, base_source: str, base_copy: Path | None, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    source = str(base_copy) if base_copy is not None else base_source
    dtype = getattr(AutoConfig.from_pretrained(source), "dtype", None) or torch.float32
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)  # merge in full precision
    merged = PeftModel.from_pretrained(base, str(weights)).merge_and_unload()
    merged.to(dtype if isinstance(dtype, torch.dtype) else torch.float32).save_pretrained(out)


def export_checkpoint(data_dir: str | Path, out: str | Path, *, merge: bool = False) -> Path:
    """Write the newest good checkpoint of `data_dir` to `out` (which must not exist or be empty)."""
    from node.models.registry import load_tokenizer
    from node.train.checkpoint import load_latest

    data_dir, out = Path(data_dir).expanduser(), Path(out).expanduser()
    ckpt = load_latest(_checkpoints(data_dir))
    if ckpt is None:
        raise ExportError(f"{data_dir}: no checkpoint verifies (each one failed its hash check)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty; pick a new folder")
    meta, weights = ckpt.meta, ckpt.weights_dir
    status = _read_status(data_dir)
    model = meta.extra.get("model") or status.get("model")
    if not model:
        raise ExportError(f"{ckpt.path}: the checkpoint does not record its base model")
    base_id, base_copy = _base_for_others(model)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if meta.mode == "full":
            _copy_model_files(weights, tmp)
        elif merge:
            _merge(weights, base_id, base_copy, tmp)
        else:
            _copy_model_files(weights, tmp)
            config_path = tmp / "adapter_config.json"
            config = json.loads(config_path.read_text())
            config["base_model_name_or_path"] = base_id  # not this machine's cache path
            config_path.write_text(json.dumps(config, indent=2) + "\n")
            if base_copy is not None:
                _copy_model_files(base_copy, tmp / BASE_DIR)
        if not (tmp / "tokenizer_config.json").exists():
            load_tokenizer(str(base_copy) if base_copy is not None else base_id).save_pretrained(tmp)
        (tmp / "README.md").write_text(_card(status, meta, base_id, merge, meta.mode))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
