"""The project's tiny models: small Qwen2 decoders built and warm-started locally.

They exist so that everything (tests, the local demo, the benchmarks) runs with no
download. Each is a normal Hugging Face folder (config.json, model.safetensors,
tokenizer files) in the cache, loaded with ``from_pretrained`` like any Hub model.

All use head_dim 64 (vLLM's CPU attention needs head_dim >= 32, better 64). The
three sizes share the project tokenizer, so their token ids mean the same thing and
the F-TIS token-level path applies between them; ``tiny-alt`` uses a different
tokenizer, for the cross-tokenizer path.

The folder name carries a hash of everything that decides the weights (model config,
tokenizer recipe, warm-start recipe, skill, build version), so changing any of them
builds a new folder instead of reusing a stale one.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from node.models.cache import ModelLoadError, atomic_build, models_dir
from node.models.tokenizer import ALT, PROJECT, TokenizerRecipe, save_tokenizer, tokenizer_fingerprint
from node.models.warmstart import TINY_SKILLS, Skill, WarmStartRecipe

#: Bump when the build changes in a way the recipes below do not capture.
BUILD_VERSION = 2


class TinyModelConfig(BaseModel):
    """Architecture and recipes of one tiny model."""

    model_config = ConfigDict(frozen=True)

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    intermediate_size: int
    max_position_embeddings: int = 512
    # 0.05 rather than HF's 0.02: at this width it leaves the early plateau sooner
    # (measured: reward 0.25 vs 0.11 after the same 1000 warm-start steps).
    initializer_range: float = 0.05
    init_seed: int = 0
    tokenizer: TokenizerRecipe = PROJECT
    warm_start: WarmStartRecipe = Field(default_factory=WarmStartRecipe)


TINY_MODELS: dict[str, TinyModelConfig] = {
    # ~0.56M parameters
    "tiny-s": TinyModelConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, intermediate_size=512
    ),
    # ~1.3M
    "tiny-m": TinyModelConfig(
        hidden_size=192, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=3, intermediate_size=512
    ),
    # ~1.7M: tiny-m one layer deeper, and a longer warm-start. (Wider variants, 256 and
    # 384, learnt no more in the time budget: at this scale depth and steps pay, width not.)
    "tiny-l": TinyModelConfig(
        hidden_size=192,
        num_attention_heads=3,
        num_key_value_heads=1,
        num_hidden_layers=4,
        intermediate_size=512,
        warm_start=WarmStartRecipe(steps=1200),
    ),
    # tiny-s's shape with another tokenizer (vocabulary 384, ids permuted)
    "tiny-alt": TinyModelConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        intermediate_size=512,
        tokenizer=ALT,
        init_seed=1,
    ),
}
#: The names `--model` accepts for them (a skill may follow: tiny-s:add).
TINY_NAMES: tuple[str, ...] = tuple(TINY_MODELS)


def _config(name: str) -> TinyModelConfig:
    if name not in TINY_MODELS:
        raise ModelLoadError(f"unknown tiny model {name!r}; valid: {', '.join(TINY_MODELS)}")
    return TINY_MODELS[name]


def tiny_build_key(name: str, warm_start: bool = True, skill: Skill | None = None) -> str:
    """12 hex digits naming one build; equal keys mean equal weights."""
    if skill is not None and skill not in TINY_SKILLS:
        raise ModelLoadError(f"unknown skill {skill!r}; valid skills: {', '.join(TINY_SKILLS)}")
    if skill is not None and not warm_start:
        raise ModelLoadError("a skill selects the warm-start data, so it needs warm_start=True")
    blob = json.dumps(
        {
            "config": _config(name).model_dump(mode="json"),
            "warm_start": warm_start,
            "skill": skill,
            "version": BUILD_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_folder_name(name: str, warm_start: bool = True, skill: Skill | None = None) -> str:
    label = name + (f"-{skill}" if skill else "") + ("" if warm_start else "-init")
    return f"{label}-{tiny_build_key(name, warm_start, skill)}"


def _hf_config(cfg: TinyModelConfig, tokenizer: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        # transformers' dataclass signature omits head_dim, which PreTrainedConfig keeps as an extra field
        head_dim=cfg.hidden_size // cfg.num_attention_heads,  # type: ignore[call-arg]
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _build(name: str, folder: Path, warm_start: bool, skill: Skill | None) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    from node.models.warmstart import sampled_reward
    from node.models.warmstart import warm_start as run_warm_start
    from node.tasks.toy import ToyTask

    cfg = _config(name)
    started = time.perf_counter()
    tokenizer = save_tokenizer(folder, cfg.tokenizer, model_max_length=cfg.max_position_embeddings)
    torch.manual_seed(cfg.init_seed)
    model = Qwen2ForCausalLM(_hf_config(cfg, tokenizer))
    report = run_warm_start(model, tokenizer, cfg.warm_start, skill) if warm_start else None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    # Recorded for the dashboard and for choosing models; 128 problems, one sample each at T=1.
    reward = sampled_reward(model, tokenizer, ToyTask("id"), n=128, temperature=1.0, seed=0) if warm_start else 0.0
    meta = {
        "name": name,
        "skill": skill,
        "build_key": tiny_build_key(name, warm_start, skill),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "warm_start": report.model_dump() if report else None,
        "toy_id_reward_t1": reward,
        "build_seconds": round(time.perf_counter() - started, 2),
        "config": cfg.model_dump(mode="json"),
    }
    (folder / "ftis_build.json").write_text(json.dumps(meta, indent=2) + "\n")


def build_tiny(
    name: str, cache_dir: str | Path | None = None, warm_start: bool = True, skill: Skill | None = None
) -> Path:
    """The folder of tiny model ``name``, built (once) if it is not in the cache yet.

    ``cache_dir`` replaces the models folder (default ``$FTIS_CACHE/models`` or
    ``~/.cache/ftis-node/models``). ``skill`` ("add" or "sub") warm-starts on one half
    of the toy task only. Safe to call from several processes at once.
    """
    final = models_dir(cache_dir) / tiny_folder_name(name, warm_start, skill)
    return atomic_build(final, lambda tmp: _build(name, tmp, warm_start, skill))


def build_info(folder: str | Path) -> dict[str, Any]:
    """The build record saved next to a tiny model (warm-start loss, time, fingerprint)."""
    return json.loads((Path(folder) / "ftis_build.json").read_text())
