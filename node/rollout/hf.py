"""The Hugging Face transformers engine: `generate` with KV cache, on CPU or one GPU.

Log-probs are computed from the RAW logits with the same temperature / top-k / top-p
transform the sampler applied (`sampling_logprobs`), not read from `scores`: those are
the fully processed scores, which include any extra masking (min length, suppressed
tokens) that is not part of the policy distribution. They are taken step by step
(`_StepLogprobs`: a forward hook keeps the last raw logits, a stopping-criteria call
scores the token just drawn), so generation holds [batch, steps] floats, never the
[batch, steps, vocab] logits `output_logits` would keep.

The engine owns its sampling distribution: the model's own `generation_config.json`
(repetition penalty, default top-k 50, min-p ...) is replaced by a neutral one at load,
so nothing beyond what `Sampling` says can shape the draw.

Weights switch in place. A LoRA adapter is injected into the loaded base modules
(peft), and the previous adapter is deleted so only one is ever held; a full model
folder is copied into the existing parameters. The base model is never reloaded.
Between rounds the daemon hands the trainer's weights over in memory (`load_state`):
the full state, or the LoRA tensors into an adapter injected once with the trainer's
LoraConfig, copied into the engine's own tensors (no file, no new modules).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteria, StoppingCriteriaList

from node.rollout.base import (
    FinishReason,
    RolloutEngine,
    Sample,
    Sampling,
    check_request,
    encode_prompts,
    eos_token_ids,
)
from node.train.logprobs import sampling_logprobs
from node.train.weights import copy_state_into, load_safetensors_into

if TYPE_CHECKING:
    from peft import PeftMixedModel, PeftModel

__all__ = ["HFEngine"]

# The adapter name of weights handed over by `load_state` (folder loads use numbered slots):
# peft's default, the trainer's, so the tensors have the same names on both sides.
STATE_ADAPTER = "default"


def _eos_ids(model: PreTrainedModel, tokenizer) -> list[int]:
    """Every id that ends a completion: the model's generation EOS ids and the tokenizer's."""
    return eos_token_ids(tokenizer, getattr(model.generation_config, "eos_token_id", None))


def _model_on(other: torch.nn.Module) -> PreTrainedModel:
    """A model of `other`'s architecture whose parameters ARE `other`'s base tensors (built
    on the meta device, so nothing is allocated); its small buffers are copied."""
    from transformers import AutoModelForCausalLM

    # torch types Module.__getattr__ as Tensor | Module, so peft's get_base_model reads as a Tensor
    lm = other.get_base_model() if hasattr(other, "get_base_model") else other  # type: ignore[operator]
    params = {n.replace(".base_layer", ""): p for n, p in lm.named_parameters(remove_duplicate=False)}
    buffers = {n.replace(".base_layer", ""): b for n, b in lm.named_buffers(remove_duplicate=False)}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(lm.config))
    for name, _ in list(model.named_parameters(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(params[name].data, requires_grad=False)
    for name, _ in list(model.named_buffers(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buffers[name].detach().clone()
    model.generation_config = copy.deepcopy(lm.generation_config)
    return model.eval()


class _StepLogprobs(StoppingCriteria):
    """Records, at every step of `generate`, the sampling log-prob of the token just drawn.

    A forward hook on the model keeps the raw logits of the last position (the values
    `output_logits` would store); `generate` calls its stopping criteria right after it
    appends the sampled tokens, and that call scores them through `sampling_logprobs`.
    It never stops anything.
    """

    def __init__(self, model: torch.nn.Module, sampling: Sampling) -> None:
        self.sampling = sampling
        self.steps: list[torch.Tensor] = []
        self._logits: torch.Tensor | None = None
        self._hook = model.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self._logits = output.logits[:, -1, :]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        assert self._logits is not None, "generate sampled a token without a forward pass"
        s = self.sampling
        self.steps.append(sampling_logprobs(self._logits, input_ids[:, -1], s.temperature, s.top_k, s.top_p).float())
        self._logits = None  # the step's [batch, vocab] scores go as soon as they are used
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def close(self) -> torch.Tensor:
        """Remove the hook; the log-probs as [batch, steps]."""
        self._hook.remove()
        self._logits = None
        return torch.stack(self.steps, dim=1)


class HFEngine(RolloutEngine):
    """Rollouts with `transformers.generate`.

    `max_batch_sequences` bounds how many sequences (prompts x n) share one `generate`
    call, and so the KV cache's size.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        *,
        use_chat_template: bool = False,
        max_batch_sequences: int = 64,
    ) -> None:
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {max_batch_sequences}")
        if use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("use_chat_template=True but the tokenizer has no chat template")
        self._base: PreTrainedModel | None = model.eval()
        self._tokenizer = tokenizer
        self._peft: PeftModel | PeftMixedModel | None = None  # wraps self._base while an adapter is loaded
        self._slot = 0  # peft adapter names must be module-safe, so versions map to slots
        self._state_lora: dict[str, Any] | None = None  # the LoraConfig of the STATE_ADAPTER in place, as a dict
        self._state_lora_config: Any = None  # ... and the object it came from (the usual, cheap match)
        self._lora_params: dict[str, torch.Tensor] = {}  # its tensors, by the trainer's names
        self._version = "base"
        self._shared: list[str] = []  # names of base weights that are another model's tensors
        self.use_chat_template = use_chat_template
        self.max_batch_sequences = max_batch_sequences
        self._eos = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self._pad = int(pad) if pad is not None else self._eos[0]
        self._vocab = int(cast(torch.Tensor, model.get_input_embeddings().weight).shape[0])
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        model.generation_config = GenerationConfig(
            eos_token_id=self._eos, pad_token_id=self._pad, bos_token_id=model.generation_config.bos_token_id
        )

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        tokenizer=None,
        use_chat_template: bool = False,
        max_batch_sequences: int = 64,
        share_with: torch.nn.Module | None = None,
    ) -> HFEngine:
        """Load a model by alias (`tiny-s`, `qwen2.5-1.5b`), local folder or hub id.

        `share_with`: a model of the same weights whose tensors this engine uses instead of
        loading its own: no second copy is ever made, not even while loading. A LoRA
        trainer's frozen base (see `share_base_weights`), or a full trainer's live weights:
        then `load_state` of those same tensors copies nothing, and the engine samples
        from each step's weights as soon as the step is taken.
        """
        from node.models.registry import load_model, load_tokenizer, model_folder, resolve_model

        if share_with is not None:
            loaded = _model_on(share_with)
            if tokenizer is None:
                tokenizer = load_tokenizer(model_folder(resolve_model(model)))
            loaded_tokenizer = tokenizer
            engine = cls(
                loaded, loaded_tokenizer, use_chat_template=use_chat_template, max_batch_sequences=max_batch_sequences
            )
            engine._shared = [n.replace(".base_layer", "") for n, _ in loaded.named_parameters()]
            return engine
        loaded, loaded_tokenizer = load_model(model, dtype=dtype, device=device)
        return cls(
            loaded,
            tokenizer if tokenizer is not None else loaded_tokenizer,
            use_chat_template=use_chat_template,
            max_batch_sequences=max_batch_sequences,
        )

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def adapter_version(self) -> str:
        return self._version

    @property
    def base_model(self) -> PreTrainedModel:
        """The transformers model whose modules generate (LoRA layers live inside it)."""
        if self._base is None:
            raise RuntimeError("the engine is closed")
        return self._base

    @property
    def device(self) -> torch.device:
        return next(self.base_model.parameters()).device

    # ------------------------------------------------------------------ generation
    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Prompts to token ids, validating them; text gets the chat template if enabled."""
        return encode_prompts(
            self._tokenizer, prompts, use_chat_template=self.use_chat_template, vocab_size=self._vocab
        )

    @contextlib.contextmanager
    def _seeded(self, seed: int | None) -> Iterator[None]:
        """Seed sampling without disturbing the process-wide RNG streams."""
        if seed is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        n: int,
        sampling: Sampling,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[list[Sample]]:
        """As `RolloutEngine.generate`; `on_progress(prompts_done)` is called after each batch."""
        check_request(n, sampling)
        if not prompts:
            return []
        ids = self.encode(prompts)
        if self._max_positions is not None:
            longest = max(len(p) for p in ids) + sampling.max_tokens
            if longest > self._max_positions:
                raise ValueError(f"prompt + max_tokens = {longest} exceeds the model's {self._max_positions} positions")
        per_call = max(1, self.max_batch_sequences // n)
        results: list[list[Sample]] = []
        with self._seeded(sampling.seed), torch.inference_mode():
            for start in range(0, len(ids), per_call):
                results.extend(self._generate_chunk(ids[start : start + per_call], n, sampling))
                if on_progress is not None:
                    on_progress(len(results))
        return results

    def _generate_chunk(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        config = GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,  # 0 = off (HF's own default would be 50)
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=n,
            # ignore_eos: no stop id at all (min_new_tokens would mask EOS instead,
            # which changes the distribution); EOS is then sampled and kept like any token.
            eos_token_id=[] if sampling.ignore_eos else self._eos,  # None would mean "the model's"
            pad_token_id=self._pad,
            use_cache=True,
        )
        recorder = _StepLogprobs(self.base_model, sampling)
        try:
            # transformers 5 types PreTrainedModel without GenerationMixin (a causal LM class has it),
            # so torch's Module.__getattr__ types `generate` as a Tensor
            sequences = self.base_model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([recorder]),
            )
        finally:
            steps = recorder.close()
        generated = sequences[:, width:].cpu()
        logprobs = steps.cpu().numpy()
        assert logprobs.shape == tuple(generated.shape), "one log-prob per generated token"
        eos = torch.tensor(self._eos)

        samples: list[list[Sample]] = []
        for i, prompt in enumerate(prompts):
            group = []
            for row in range(i * n, (i + 1) * n):  # generate repeats each prompt n times in a row
                tokens = generated[row]
                hits: torch.Tensor | list[int] = torch.isin(tokens, eos).nonzero() if not sampling.ignore_eos else []
                reason: FinishReason
                if len(hits):  # cut after the first EOS; what follows is padding
                    length, reason = int(hits[0]) + 1, "stop"
                else:
                    length, reason = len(tokens), "length"
                token_ids = tokens[:length].tolist()
                group.append(
                    Sample(
                        prompt_token_ids=list(prompt),
                        token_ids=token_ids,
                        logprobs=logprobs[row, :length].astype(np.float32),
                        text=self._tokenizer.decode(token_ids, skip_special_tokens=True),
                        finish_reason=reason,
                    )
                )
            samples.append(group)
        return samples

    # ------------------------------------------------------------------ weights
    def share_base_weights(self, model: torch.nn.Module) -> int:
        """Use `model`'s frozen weights as this engine's base weights: one copy in memory, not two.

        For a LoRA trainer's model, whose base never changes (only its adapter trains). A
        tensor is shared when its name (peft's `.base_layer` left out), shape, dtype and
        device match; the engine's own copy is freed. A later load of full weights into
        this engine first takes private copies again, so it never writes into `model`.
        Returns the bytes freed.
        """
        # torch types Module.__getattr__ as Tensor | Module, so peft's get_base_model reads as a Tensor
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
        theirs = {
            name.replace(".base_layer", ""): p
            for name, p in lm.named_parameters()
            if not p.requires_grad and "lora_" not in name
        }
        freed = 0
        for name, mine in self.base_model.named_parameters():
            key = name.replace(".base_layer", "")
            other = theirs.get(key)
            if other is None or (other.shape, other.dtype, other.device) != (mine.shape, mine.dtype, mine.device):
                continue
            if other.data_ptr() != mine.data_ptr():
                freed += mine.numel() * mine.element_size()
                mine.data = other.data
                self._shared.append(key)
        gc.collect()
        return freed

    def _holds(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether every weight of this engine IS the same-named tensor of `state` (a full trainer's
        weights, shared through `share_with`): its steps are then already here."""
        mine = dict(self.base_model.named_parameters())
        return (
            bool(self._shared)
            and mine.keys() <= state.keys()
            and all(state[n].data_ptr() == p.data_ptr() for n, p in mine.items())
        )

    def _unshare(self) -> None:
        """Private copies of shared base weights, before anything writes into them."""
        if not self._shared:
            return
        shared = set(self._shared)
        for name, p in self.base_model.named_parameters():
            if name.replace(".base_layer", "") in shared:
                p.data = p.data.clone()
        self._shared = []

    def load_adapter(self, path: str | Path | None, version: str) -> None:
        """Switch weights: a peft LoRA folder, a full model folder, or None for the base."""
        if path is None:
            self._drop_adapter()
            self._version = version
            return
        path = Path(path)
        if (path / "adapter_config.json").is_file():
            self._load_lora(path)
            self._version = version
        elif (path / "config.json").is_file():
            self.load_weights(path, version)
        else:
            raise FileNotFoundError(
                f"{path}: neither a peft adapter (adapter_config.json) nor a model folder (config.json)"
            )

    def _load_lora(self, path: Path) -> None:
        from peft import PeftModel

        # a folder's adapter replaces the one load_state keeps
        self._state_lora, self._state_lora_config, self._lora_params = None, None, {}
        slot = f"slot{self._slot}"
        self._slot += 1
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self.base_model, str(path), adapter_name=slot, is_trainable=False)
        else:
            old = self._peft.active_adapter
            self._peft.load_adapter(str(path), adapter_name=slot, is_trainable=False)
            self._peft.set_adapter(slot)
            self._peft.delete_adapter(old)  # keep one adapter resident, however many rounds pass
        self.base_model.eval()

    loads_state = True

    def load_state(self, state: Mapping[str, torch.Tensor], version: str, *, lora_config: Any | None = None) -> None:
        """Copy the trainer's live weights into this engine's tensors; see `RolloutEngine.load_state`.

        LoRA: `state` holds the LoRA parameters by their names in the trainer's peft model
        (`Trainer.published_state`). The first call (or one with another LoraConfig)
        injects an adapter with that config, named as the trainer's, so both sides name
        the tensors alike; later calls only copy. Full: the model's state dict, as
        `load_weights` from a folder. Names and shapes are all checked before anything
        is copied, so a bad state leaves the engine's weights as they were.
        """
        if lora_config is None:
            if self._peft is None and self._holds(state):  # built on these very tensors: nothing to copy
                self._version = version
                return
            had_adapter = self._peft is not None
            self._drop_adapter()
            self._unshare()
            try:
                copy_state_into(self.base_model, state, source="trainer state")
            except Exception:
                if had_adapter:
                    self._version = "base"
                raise
            self._version = version
            return
        from peft import get_peft_model

        same = lora_config is self._state_lora_config or (
            self._state_lora is not None and self._state_lora == lora_config.to_dict()
        )
        if not same or self._peft is None:
            config = lora_config.to_dict()
            self._drop_adapter()
            self._version = "base"
            inference = copy.deepcopy(lora_config)
            inference.inference_mode = True
            self._peft = get_peft_model(self.base_model, inference, adapter_name=STATE_ADAPTER)
            self._peft.eval()
            self._lora_params = {n: p for n, p in self._peft.named_parameters() if f".{STATE_ADAPTER}." in n}
            self._state_lora, self._state_lora_config = config, lora_config
        targets = self._lora_params
        if state.keys() != targets.keys():
            extra, missing = sorted(state.keys() - targets.keys()), sorted(targets.keys() - state.keys())
            raise ValueError(f"trainer state does not fit the adapter: unexpected {extra[:3]}, missing {missing[:3]}")
        for name, tensor in state.items():
            if tensor.shape != targets[name].shape:
                raise ValueError(
                    f"trainer state: {name} has shape {tuple(tensor.shape)}, the adapter {tuple(targets[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in state.items():
                targets[name].copy_(tensor)
        self._version = version

    def _drop_adapter(self) -> None:
        """Remove the LoRA layers, leaving the original base modules (and tensors) in place."""
        if self._peft is not None:
            self._base = self._peft.unload()
            self._peft = None
            self._state_lora, self._state_lora_config = None, None
            self._lora_params = {}
            gc.collect()

    def load_weights(self, path: str | Path, version: str) -> None:
        """Copy a full model folder's safetensors into the loaded model, in place.

        Any adapter is dropped first: it was trained against the old weights. Every
        tensor is checked (names, shapes) before the first one is copied, so a bad
        folder leaves the base weights untouched; the engine is then on the base.
        """
        had_adapter = self._peft is not None
        self._drop_adapter()
        self._unshare()
        try:
            load_safetensors_into(self.base_model, path)
        except Exception:
            if had_adapter:
                self._version = "base"
            raise
        self._version = version

    def close(self) -> None:
        self._peft = None
        self._base = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
