"""How much memory a node needs, how much the machine has, and giving freed memory back.

`estimate` adds up what a round holds at its peak from the model's config and the node's
settings: the weights (the trainer's, and the engine's own copy), the optimizer state of
full fine-tuning, the training micro-batch's activations, the output head's chunk of
scores, and generation's KV cache. Its constants were fitted to `ftis-node bench memory`
(docs/benchmarks.md, "Memory"), which also reports how far off it is for every model.

Figures are in bytes; `gb` formats them as decimal gigabytes, as the benches print them.
"""

from __future__ import annotations

import ctypes
import gc
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = [
    "Estimate",
    "ModelShape",
    "estimate",
    "fit_micro_batch",
    "generate_call_sequences",
    "free_bytes",
    "gb",
    "peak_rss",
    "release_memory",
    "reset_peak_rss",
    "rss",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Python, torch, transformers and the tokenizer before any weight is loaded (measured).
RUNTIME_BYTES = 450e6
#: Floats a training token keeps per layer for the backward pass, as multiples of the hidden
#: and intermediate sizes (fitted to bench memory's micro-batch sweep).
ACT_HIDDEN, ACT_INTERMEDIATE = 10.0, 4.0
#: Fixed tensors of the micro-batch plan's chunks and allocator slack, as a share of the rest.
SLACK = 0.10
#: The micro-batch sizes `fit_micro_batch` chooses among, largest first.
MICRO_BATCH_CHOICES = (4096, 2048, 1024, 512, 256)
#: A CPU node's micro-batch: a CPU trains as many tokens a second at 256 tokens a micro-batch as
#: at 4096 (SmolLM2 LoRA, 16 x 160 tokens: 21.5, 19.6 and 21.1 CPU-s at 256, 1024 and 4096;
#: docs/benchmarks.md, "Memory"), while the activations grow with it (about 2 MB a token).
CPU_MICRO_BATCH = 256
#: Sequences per `generate` call. On a CPU 16 hold a third of 64's KV cache at about the same CPU
#: time (SmolLM2: a round peaks at 1.45 GB instead of 1.98 GB, docs/memory.md); a GPU gains from batching.
CPU_GENERATE_BATCH, GPU_GENERATE_BATCH = 16, 64


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


# ---------------------------------------------------------------------- measuring
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss() -> int:
    """This process's resident memory now, in bytes."""
    return _status_kb("VmRSS") * 1024


def peak_rss() -> int:
    """The most resident memory since the process began or the last `reset_peak_rss`."""
    return _status_kb("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Start the peak over from the current resident size (Linux; False where refused)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_memory() -> None:
    """Collect garbage, hand the allocator's free pages back to the system (glibc) and empty
    the CUDA cache: between phases, so one phase's peak is not kept for the whole run."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_bytes(device: str = "cpu") -> int:
    """What the node may still use: MemAvailable on the CPU, free memory on a CUDA device."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


# ---------------------------------------------------------------------- estimating
class ModelShape(BaseModel):
    """The sizes of a decoder-only transformer that decide its memory."""

    model_config = ConfigDict(frozen=True)

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int  # key/value width per token and layer (heads x head size)
    params: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (or its dict): Llama/Qwen2-style attention and gated MLP."""
        c = config if isinstance(config, dict) else config.to_dict()
        hidden, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or hidden // heads
        kv_dim = (c.get("num_key_value_heads") or heads) * head_dim
        per_layer = hidden * heads * head_dim * 2 + hidden * kv_dim * 2 + 3 * hidden * inter + 2 * hidden
        embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
        return cls(
            layers=layers,
            hidden=hidden,
            intermediate=inter,
            vocab=vocab,
            kv_dim=kv_dim,
            params=layers * per_layer + embeddings + hidden,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelShape:
        import json

        return cls.from_config(json.loads((Path(folder) / "config.json").read_text()))


class Estimate(BaseModel):
    """Bytes a node holds at its peak, by part; `total` is their sum plus slack."""

    parts: dict[str, float]
    total: float

    def line(self) -> str:
        parts = ", ".join(f"{k} {gb(v)}" for k, v in self.parts.items() if v >= 5e6)
        return f"about {gb(self.total)} ({parts})"


def estimate(
    shape: ModelShape,
    *,
    mode: str = "lora",
    dtype: str = "float32",
    micro_batch_tokens: int = 4096,
    gradient_checkpointing: bool = False,
    generate_sequences: int = 64,
    sequence_tokens: int = 512,
    lora_rank: int = 8,
    engine_weights: bool = True,
) -> Estimate:
    """The peak of a round: weights + optimizer + the larger of training's and generation's working set.

    `generate_sequences`: sequences in one `generate` call; `sequence_tokens`: prompt plus
    completion. `engine_weights`: the engine holds its own copy of the weights.
    """
    from node.train.logprobs import LOGIT_CHUNK_ELEMENTS

    width = _DTYPE_BYTES[dtype]
    weights = shape.params * width
    lora = shape.layers * lora_rank * (2 * shape.hidden + 2 * shape.hidden + 2 * shape.kv_dim)  # q, k, v, o
    trained = shape.params if mode == "full" else lora
    optimizer = trained * (width + 2 * 4)  # gradient + AdamW's two moments (fp32)
    per_token = (ACT_HIDDEN * shape.hidden + ACT_INTERMEDIATE * shape.intermediate) * 4
    if gradient_checkpointing:  # each layer's input, plus one layer rebuilt at a time
        activations = micro_batch_tokens * (shape.layers * shape.hidden * 4 + per_token)
    else:
        activations = micro_batch_tokens * shape.layers * per_token
    head = 5 * min(LOGIT_CHUNK_ELEMENTS, micro_batch_tokens * shape.vocab) * 4  # scores, exp, their gradients
    head += min(micro_batch_tokens, shape.hidden) * shape.vocab * 4  # softmax kept for the backward pass
    kv_cache = generate_sequences * sequence_tokens * shape.layers * 2 * shape.kv_dim * width
    step_scores = 4 * generate_sequences * shape.vocab * 4
    parts = {
        "runtime": RUNTIME_BYTES,
        "weights": float(weights),
        "engine weights": float(weights if engine_weights else 0),
        "optimizer": float(optimizer),
        "training": float(max(activations + head, kv_cache + step_scores)),
    }
    base = sum(v for k, v in parts.items() if k != "runtime")
    return Estimate(parts=parts, total=parts["runtime"] + base * (1 + SLACK))


def fit_micro_batch(shape: ModelShape, budget: float, **settings: Any) -> int | None:
    """The largest of `MICRO_BATCH_CHOICES` whose estimate fits `budget` bytes, or None."""
    for tokens in MICRO_BATCH_CHOICES:
        if estimate(shape, micro_batch_tokens=tokens, **settings).total <= budget:
            return tokens
    return None


def round_up(tokens: float) -> int:
    """`tokens` rounded up to a power of two (micro-batch sizes in messages)."""
    return 1 << max(0, math.ceil(math.log2(max(tokens, 1))))


# ---------------------------------------------------------------------- a node's plan
#: Prompt tokens assumed before the tokenizer is loaded (a chat template and a short question).
PROMPT_TOKENS = 128
#: The share of the device's memory vLLM takes for itself (its default in node.rollout.vllm).
VLLM_SHARE = {"cpu": 0.2, "cuda": 0.3}


class MemoryPlan(BaseModel):
    """What `plan` decided: the micro-batch, the estimate at it, and what the machine has."""

    micro_batch_tokens: int
    needed: float
    free: float
    estimate: Estimate
    fits: bool

    def line(self) -> str:
        return f"needs {self.estimate.line()}; {gb(self.free)} free"


def total_bytes(device: str = "cpu") -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


def generate_call_sequences(batch: int, prompts: int, group_size: int) -> int:
    """Sequences in one `generate` call: whole groups, at least one, as the hf engine batches them."""
    return min(prompts, max(1, batch // group_size)) * group_size


def plan(cfg: Any, shape: ModelShape, *, free: float | None = None) -> MemoryPlan:
    """The micro-batch for node settings `cfg` (a NodeConfig): the given one; else `CPU_MICRO_BATCH`
    on a CPU, and on a GPU the largest of `MICRO_BATCH_CHOICES` that fits its free memory.

    `fits` is False when even that micro-batch needs more than is free.
    """
    kind = "cuda" if cfg.device.startswith("cuda") else "cpu"
    available = float(free if free is not None else free_bytes(cfg.device))
    if cfg.engine == "vllm":  # vLLM reserves its share of the device for weights and KV cache
        available -= VLLM_SHARE[kind] * total_bytes(cfg.device)
    max_tokens = cfg.max_tokens or 64
    settings: dict[str, Any] = {
        "mode": cfg.train_mode,
        "dtype": cfg.dtype,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "generate_sequences": generate_call_sequences(cfg.generate_batch_size(), cfg.prompts_per_round, cfg.group_size),
        "sequence_tokens": PROMPT_TOKENS + max_tokens,
        "lora_rank": cfg.lora_rank,
        "engine_weights": False,  # hf: the engine's tensors are the trainer's; vllm: in its own share below
    }
    if cfg.micro_batch_tokens:
        tokens = cfg.micro_batch_tokens
    elif kind == "cpu":
        tokens = CPU_MICRO_BATCH
    else:
        tokens = fit_micro_batch(shape, available, **settings) or MICRO_BATCH_CHOICES[-1]
    est = estimate(shape, micro_batch_tokens=tokens, **settings)
    return MemoryPlan(
        micro_batch_tokens=tokens, needed=est.total, free=available, estimate=est, fits=est.total <= available
    )
