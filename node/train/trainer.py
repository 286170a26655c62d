"""The trainer: owns the local policy (LoRA or full) and its optimizer, applies F-TIS.

One `step(batch)` is one optimizer step on one mixed batch of own and peers' samples.
The batch is split into micro-batches by a padded-token budget so memory stays bounded
whatever the batch size; their gradients accumulate to exactly the full-batch gradient
because each micro-batch is scored with its slice of the whole batch's
mean_groups-mean_i normalisation (`group_mean_scale` -> `sequence_scale`).

Each sequence is scored under the sampling transform its generator used (temperature,
top-k, top-p travel with the sample), so log pi and log pi_gen refer to the same
distribution family and their ratio is the importance weight F-TIS needs.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from node.train import checkpoint as ckpt_io
from node.train.ftis import LossConfig, ftis_loss, group_mean_scale, offpolicy_stats
from node.train.logprobs import sequence_logprobs
from node.train.weights import full_digest, weights_version

__all__ = ["MicroLoss", "TrainBatch", "TrainSequence", "Trainer", "TrainerConfig"]

_DEFAULT_LR = {"full": 1e-6, "lora": 2e-4}

#: `loss_fn(sequences, logp, mask, sequence_scale) -> loss` of one micro-batch: `logp` carries
#: the gradient, `sequence_scale` is each row's share of the whole batch's normalisation.
MicroLoss = Callable[[list["TrainSequence"], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TrainerConfig(BaseModel):
    """How to train. The learning rate defaults by mode: 1e-6 full (the paper), 2e-4 LoRA."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["lora", "full"] = "lora"
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lr: float | None = Field(None, gt=0, description="None: 1e-6 for full, 2e-4 for LoRA.")
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    adam_eps: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global grad norm (None: no clip).")
    micro_batch_tokens: int = Field(4096, ge=1, description="Padded tokens per forward/backward pass.")
    gradient_checkpointing: bool = Field(
        False, description="Keep only each layer's input and recompute the rest in the backward pass."
    )
    chunked_logprobs: bool = Field(True, description="Score the output head a chunk of positions at a time.")
    loss: LossConfig = Field(default_factory=LossConfig)
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"AdamW betas must be in [0, 1), got {v}")
        return v

    def lora_config(self) -> Any:
        """The peft LoraConfig these settings describe (also used to configure TRL alike)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,  # type: ignore[arg-type]  # annotated int, used as alpha / r
            lora_dropout=self.lora_dropout,
            target_modules=list(self.target_modules),
            task_type="CAUSAL_LM",
        )

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else _DEFAULT_LR[self.mode]


class TrainSequence(BaseModel):
    """One completion to learn from, with what the loss needs about it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    prompt_ids: list[int] = Field(min_length=1)
    completion_ids: list[int] = Field(min_length=1)
    logp_gen: np.ndarray  # float32 [len(completion_ids)]: the generator's sampling log-probs
    advantage: float  # from the generator's group rewards (group_advantages), before filtering
    group_id: int  # one prompt answered by ONE generator model
    seq_weight: float = Field(1.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    source: str = "self"  # who generated it; off-policy stats are reported per source

    @field_validator("logp_gen", mode="before")
    @classmethod
    def _as_float32(cls, v: Any) -> np.ndarray:
        arr = np.asarray(v, dtype=np.float32)
        if arr.ndim != 1:
            raise ValueError(f"logp_gen must be 1-D, got shape {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise ValueError("logp_gen has non-finite values")
        if np.any(arr > 1e-4):  # a log-prob is <= 0; allow fp16 rounding from the wire
            raise ValueError("logp_gen has positive values (not log-probabilities)")
        return arr

    @field_validator("advantage")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"advantage must be finite, got {v}")
        return v

    @model_validator(mode="after")
    def _lengths_agree(self) -> TrainSequence:
        if len(self.logp_gen) != len(self.completion_ids):
            raise ValueError(f"{len(self.completion_ids)} completion tokens but {len(self.logp_gen)} log-probs")
        return self

    @property
    def sampling_key(self) -> tuple[float, int, float]:
        return (self.temperature, self.top_k, self.top_p)


class TrainBatch(BaseModel):
    """The sequences of one optimizer step."""

    model_config = ConfigDict(extra="forbid")

    sequences: list[TrainSequence] = Field(min_length=1)


def _nonfinite_step(losses: list[torch.Tensor], grad_norm: float) -> str | None:
    """Why a step must not be taken (a non-finite loss or gradient), or None."""
    if not all(bool(torch.isfinite(x).all()) for x in losses):
        return "non-finite loss"
    if not math.isfinite(grad_norm):
        return "non-finite gradient"
    return None


class Trainer:
    """Trains one policy with F-TIS. `step` per round, `save_adapter` to publish weights."""

    def __init__(self, model_path: str | Path, cfg: TrainerConfig | None = None) -> None:
        """`model_path`: a model alias (`tiny-s`), a local folder or a hub id."""
        from node.models.registry import load_model

        self.cfg = cfg = cfg or TrainerConfig()
        self.model_path = model_path
        # Initialise under a fixed seed without consuming the caller's RNG streams.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            base, self.tokenizer = load_model(model_path, dtype=cfg.dtype, device="cpu")
            if cfg.mode == "lora":
                from peft import get_peft_model

                self.model = get_peft_model(base, cfg.lora_config())
            else:
                self.model = base
        if cfg.gradient_checkpointing:  # non-reentrant: works with frozen inputs (LoRA) too
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.to(cfg.device).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.learning_rate,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            eps=cfg.adam_eps,
        )
        config = base.config
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        # Padding is masked out; any valid id does. eos_token_id may be a list.
        self.pad_id = int(pad[0] if isinstance(pad, (list, tuple)) else pad) if pad is not None else 0
        self.vocab_size = int(base.get_input_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.steps = 0
        self._version: tuple[int, str] | None = None
        self._published: dict[str, torch.Tensor] | None = None
        self.lora_config = cfg.lora_config() if cfg.mode == "lora" else None  # what the engine injects alike

    # ------------------------------------------------------------------ batching
    def micro_batch_logprobs(self, sub: list[TrainSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probs (with grad) and mask for one micro-batch of `plan_micro_batches`,
        scored under its sequences' shared sampling transform."""
        temperature, top_k, top_p = sub[0].sampling_key
        return sequence_logprobs(
            self.model,
            [s.prompt_ids for s in sub],
            [s.completion_ids for s in sub],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            pad_id=self.pad_id,
            chunked=self.cfg.chunked_logprobs,
        )

    def plan_micro_batches(self, sequences: list[TrainSequence]) -> list[list[int]]:
        """Indices of each micro-batch: same sampling transform, padded size within budget.

        A micro-batch is laid out as [left-padded prompts | right-padded completions],
        so its size is rows x (longest prompt + longest completion). Sequences are
        sorted by length to waste little padding; one that alone exceeds the budget
        gets a micro-batch of its own (a sequence is never split).
        """
        budget = self.cfg.micro_batch_tokens
        by_key: dict[tuple[float, int, float], list[int]] = defaultdict(list)
        for i, s in enumerate(sequences):
            by_key[s.sampling_key].append(i)
        plan: list[list[int]] = []
        for key in sorted(by_key):
            order = sorted(
                by_key[key], key=lambda i: (len(sequences[i].prompt_ids) + len(sequences[i].completion_ids), i)
            )
            current: list[int] = []
            p_max = t_max = 0
            for i in order:
                p, t = len(sequences[i].prompt_ids), len(sequences[i].completion_ids)
                wide_p, wide_t = max(p_max, p), max(t_max, t)
                if current and (len(current) + 1) * (wide_p + wide_t) > budget:
                    plan.append(current)
                    current, wide_p, wide_t = [], p, t
                current.append(i)
                p_max, t_max = wide_p, wide_t
            plan.append(current)
        return plan

    def check(self, batch: TrainBatch) -> None:
        """Raise ValueError if `batch` does not fit this model (token ids, positions); `step` calls it first."""
        for i, s in enumerate(batch.sequences):
            hi = max(max(s.prompt_ids), max(s.completion_ids))
            lo = min(min(s.prompt_ids), min(s.completion_ids))
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"sequence {i}: token ids outside the vocabulary [0, {self.vocab_size})")
            length = len(s.prompt_ids) + len(s.completion_ids)
            if self.max_positions is not None and length > self.max_positions:
                raise ValueError(f"sequence {i}: {length} tokens, the model has {self.max_positions} positions")

    # ------------------------------------------------------------------ the step
    def ftis_micro_loss(
        self, sub: list[TrainSequence], logp: torch.Tensor, mask: torch.Tensor, sequence_scale: torch.Tensor
    ) -> torch.Tensor:
        """The F-TIS loss of one micro-batch (its share of the whole batch's loss); the default `MicroLoss`."""
        device = logp.device
        loss, _ = ftis_loss(
            logp,
            self._pad([s.logp_gen for s in sub], logp.shape[1]).to(device),
            torch.tensor([s.advantage for s in sub], device=device),
            mask,
            self.cfg.loss,
            seq_weights=torch.tensor([s.seq_weight for s in sub], device=device),
            sequence_scale=sequence_scale,
            with_metrics=False,  # computed once over the whole batch after the step
        )
        return loss

    def backward_micro_batch(
        self, sub: list[TrainSequence], sequence_scale: torch.Tensor, loss_fn: MicroLoss
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch, score it with `loss_fn`, backward (gradients accumulate).

        Returns the detached log-probs [rows, width] and the loss, detached.
        """
        logp, mask = self.micro_batch_logprobs(sub)
        loss = loss_fn(sub, logp, mask, sequence_scale.to(logp.device))
        loss.backward()
        return logp.detach(), loss.detach()

    def step(
        self, batch: TrainBatch, *, loss_fn: MicroLoss | None = None, batch_metrics: bool = True
    ) -> dict[str, Any]:
        """One optimizer step on `batch`; returns the loss metrics plus grad_norm, tokens, seconds.

        `loss_fn` replaces the F-TIS loss of each micro-batch (the benchmark's plain GRPO
        step uses it); `batch_metrics=False` skips the per-source off-policy metrics, and
        "loss" is then the sum of the micro-batch losses.

        A step with a non-finite loss or gradient is not taken: it returns {"skipped": reason, ...}.
        """
        self.check(batch)
        start = time.perf_counter()
        seqs = batch.sequences
        scale = group_mean_scale(torch.tensor([s.group_id for s in seqs]))
        plan = self.plan_micro_batches(seqs)
        loss_fn = loss_fn or self.ftis_micro_loss

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        logp_rows: list[torch.Tensor | None] = [None] * len(seqs)
        losses: list[torch.Tensor] = []
        for idx in plan:
            sub = [seqs[i] for i in idx]
            logp, loss = self.backward_micro_batch(sub, scale[idx], loss_fn)
            losses.append(loss)
            if batch_metrics:
                for row, i in enumerate(idx):
                    logp_rows[i] = logp[row, : len(seqs[i].completion_ids)].float().cpu()

        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        # The guard: a step whose loss or gradient is not finite would write NaN into every
        # trained weight at once. Skip it (weights and optimizer state untouched) and say why.
        skipped = _nonfinite_step(losses, grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            return {"skipped": skipped, "tokens": sum(len(s.completion_ids) for s in seqs), "step": self.steps}
        self.optimizer.step()
        self.steps += 1

        if batch_metrics:
            metrics = self._batch_metrics(seqs, logp_rows, scale)
        else:
            metrics = {"loss": float(torch.stack(losses).sum())}
        metrics.update(
            grad_norm=grad_norm,
            tokens=sum(len(s.completion_ids) for s in seqs),
            micro_batches=len(plan),
            lr=self.optimizer.param_groups[0]["lr"],
            step=self.steps,
            seconds=time.perf_counter() - start,
        )
        return metrics

    @staticmethod
    def _pad(rows: Sequence[np.ndarray | torch.Tensor | None], width: int) -> torch.Tensor:
        out = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, r in enumerate(rows):
            assert r is not None
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
        return out

    def _batch_metrics(
        self, seqs: list[TrainSequence], logp_rows: list[torch.Tensor | None], scale: torch.Tensor
    ) -> dict[str, Any]:
        """The loss's metrics over the WHOLE batch (quantiles do not average across micro-batches),
        and per source the off-policy diagnostics plus the share of sequences the filter dropped.

        Recomputed from the detached log-probs of the pass just made, so no extra forward.
        """
        assert all(r is not None for r in logp_rows), "every sequence is scored in some micro-batch"
        width = max(len(s.completion_ids) for s in seqs)
        logp = self._pad(logp_rows, width)
        gen = self._pad([s.logp_gen for s in seqs], width)
        mask = self._pad([np.ones(len(s.completion_ids), dtype=np.float32) for s in seqs], width)
        adv = torch.tensor([s.advantage for s in seqs])
        with torch.no_grad():
            _, metrics = ftis_loss(
                logp,
                gen,
                adv,
                mask,
                self.cfg.loss,
                seq_weights=torch.tensor([s.seq_weight for s in seqs]),
                sequence_scale=scale,
            )
            by_source: dict[str, Any] = {}
            for source in sorted({s.source for s in seqs}):
                sel = [i for i, s in enumerate(seqs) if s.source == source]
                stats = offpolicy_stats(logp[sel], gen[sel], mask[sel], self.cfg.loss)
                _, subset = ftis_loss(logp[sel], gen[sel], adv[sel], mask[sel], self.cfg.loss)
                stats["frac_filtered"] = subset["frac_filtered"]
                by_source[source] = stats
        return {**metrics, "by_source": by_source}

    # ------------------------------------------------------------------ weights out
    def published_state(self) -> dict[str, torch.Tensor]:
        """The weights a rollout engine needs, live (no copy), by their names in `self.model`:
        the LoRA parameters (peft's adapter name "default" included), or the full state dict.

        Built once: the optimizer, `resume` and every load write into these same tensors.
        (Not peft's `get_peft_model_state_dict`: it reads the model's config from disk on
        every call, ~20 ms, which is most of a tiny model's round.)
        """
        if self._published is None:
            if self.cfg.mode == "lora":
                self._published = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
            else:
                self._published = dict(self.model.state_dict())
        return dict(self._published)

    @property
    def adapter_version(self) -> str:
        """The published weights' id (`weights_version`), computed once per optimizer step."""
        if self._version is None or self._version[0] != self.steps:
            self._version = (self.steps, weights_version(list(self.published_state().items()), self.steps))
        return self._version[1]

    def save_adapter(self, path: str | Path, *, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the policy for the rollout engine: a peft adapter folder, or a full model folder.

        The adapter loads with `PeftModel.from_pretrained` and vLLM's `LoRARequest`; the
        full folder (weights, config and tokenizer) with `from_pretrained`. `state`: write
        these tensors (a `published_state()` snapshot) instead of the live ones.
        """
        path = Path(path)
        if self.cfg.mode == "lora":
            # "auto" would re-read the base model's config from disk to decide (~20 ms a save);
            # the embeddings are saved only if the LoRA targets them, which ours never do by default.
            embeddings = any("embed" in m or m == "lm_head" for m in self.cfg.target_modules)
            self.model.save_pretrained(str(path), save_embedding_layers=embeddings, state_dict=state)
        else:
            self.model.save_pretrained(str(path), state_dict=state)
            self.tokenizer.save_pretrained(str(path))
        return path

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        root: str | Path,
        round: int,
        *,
        keep: int = 3,
        extra: dict[str, Any] | None = None,
        on_stage: Callable[[str], None] | None = None,
    ) -> ckpt_io.Checkpoint:
        """Atomically checkpoint weights, optimizer, RNG and round under `root`, now."""
        return self.checkpoint_job(root, round, keep=keep, extra=extra, on_stage=on_stage, snapshot=False)()

    def checkpoint_job(
        self,
        root: str | Path,
        round: int,
        *,
        keep: int = 3,
        extra: dict[str, Any] | None = None,
        on_stage: Callable[[str], None] | None = None,
        snapshot: bool = True,
    ) -> Callable[[], ckpt_io.Checkpoint]:
        """The write of a checkpoint of the state as it is NOW, to run now or in another thread.

        `snapshot`: copy the weights, the optimizer state and the RNG states first (to the
        CPU), so that training may go on while the job writes; without it the job reads the
        live tensors and must run before the next step.
        """
        weights = self.published_state()
        optimizer_state: Any = self.optimizer.state_dict()
        if snapshot:
            weights = _cpu_copy(weights)
            optimizer_state = _cpu_copy(optimizer_state)
        rng = ckpt_io.rng_state()
        step, version = self.steps, self.adapter_version

        def write() -> ckpt_io.Checkpoint:
            return ckpt_io.save_checkpoint(
                root,
                round,
                write_weights=lambda folder: self.save_adapter(folder, state=weights),
                optimizer_state=optimizer_state,
                step=step,
                mode=self.cfg.mode,
                adapter_version=version,
                extra=extra,
                keep=keep,
                on_stage=on_stage,
                rng=rng,
            )

        return write

    def resume(self, ckpt: ckpt_io.Checkpoint) -> None:
        """Restore weights, optimizer state, step count and RNG streams from `ckpt`."""
        if ckpt.meta.mode != self.cfg.mode:
            raise ValueError(
                f"checkpoint {ckpt.path} is a {ckpt.meta.mode} checkpoint, this trainer trains {self.cfg.mode}"
            )
        if self.cfg.mode == "lora":
            self._load_lora_weights(ckpt.weights_dir)
        else:
            ckpt_io.load_safetensors_into(self.model, ckpt.weights_dir)
        state = torch.load(ckpt.optimizer_path, map_location=self.cfg.device, weights_only=True)
        self.optimizer.load_state_dict(state)
        self.steps = ckpt.meta.step
        self._version = None
        ckpt_io.restore_rng_state(torch.load(ckpt.rng_path, weights_only=True))
        restored = self.adapter_version if ckpt.meta.format >= 2 else full_digest(list(self.published_state().items()))
        if restored != ckpt.meta.adapter_version:
            raise ckpt_io.CheckpointError(f"{ckpt.path}: restored weights do not hash to the recorded version")

    def _load_lora_weights(self, folder: Path) -> None:
        import json

        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        saved = json.loads((folder / "adapter_config.json").read_text())
        want = {"r": self.cfg.lora_rank, "target_modules": sorted(self.cfg.target_modules)}
        got = {"r": saved.get("r"), "target_modules": sorted(saved.get("target_modules") or [])}
        if want != got:
            raise ValueError(f"{folder}: adapter has {got}, this trainer is configured for {want}")
        state = load_file(str(folder / "adapter_model.safetensors"), device=str(self.cfg.device))
        result = set_peft_model_state_dict(self.model, state)
        unexpected = list(getattr(result, "unexpected_keys", None) or [])
        if unexpected:
            raise ValueError(f"{folder}: unexpected adapter tensors {unexpected[:5]}")


def _cpu_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to the CPU (tensors that shared storage still share it)."""
    memo: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), *x.shape, None, *x.stride())
            if key not in memo:
                memo[key] = x.detach().to("cpu", copy=True)
            return memo[key]
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    return copy(obj)
