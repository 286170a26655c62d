"""Training-step benchmark: our F-TIS step vs plain GRPO vs TRL's GRPOTrainer, one batch.

Every figure comes from ONE fixed batch (the same prompt ids, completion ids, lengths,
sampling log-probs and rewards for every contender), ONE model folder, the same LoRA
(rank, alpha = 2 x rank, dropout 0, target modules q/k/v/o_proj), fp32, AdamW
(torch.optim.AdamW) with the same hyper-parameters, gradient clipping at the same
norm, and the same torch thread count (1 unless asked otherwise). The kinds run
interleaved, one repeat of each in turn with the order rotating every repeat, so load
from other processes on the machine falls on all of them alike; each kind gets one
warm-up run that is not counted, and each figure is the median of the rest. Each run
records wall time (``time.perf_counter``) and this process's CPU time
(``time.process_time``, the load-robust cross-check on a shared machine), with the
garbage collector paused.

What one run of each kind is, exactly:

- ``ftis``: ``Trainer.step(batch)`` of ``node.train.trainer`` with ``LossConfig()``
  (variant f-tis): validate ids, micro-batch plan, forward with ``sequence_logprobs``,
  ``ftis_loss``, backward, clip, AdamW step, and the per-source off-policy metrics the
  trainer reports after the step (a no-grad pass over the detached log-probs).
- ``nois``: the same ``Trainer`` instance and call, with only the loss switched to
  ``LossConfig(variant="nois")`` (no IS weight, no filter).
- ``grpo``: ``Trainer.step(batch, loss_fn=grpo_micro_loss(trainer), batch_metrics=False)``
  on the SAME trainer: its checks, micro-batch plan, ``sequence_logprobs``, then
  ``grpo_loss`` (PPO clip, beta = 0, the same normalisation) in place of F-TIS,
  backward, clip, AdamW step; no off-policy metrics. The leanest step our components
  allow; ``loss_overhead_vs_grpo`` = ftis / grpo - 1 therefore charges F-TIS with both
  its loss and the trainer's metrics.
- ``trl``: one optimizer update of TRL's ``GRPOTrainer`` (use_vllm False, beta 0,
  loss_type "grpo", num_generations = group size, the whole batch in one micro-batch,
  no gradient accumulation), driven as ``transformers.Trainer``'s epoch loop drives
  it: ``training_step`` (``_generate_and_score_completions``: pad, rewards, group
  advantages; then ``compute_loss``: TRL's fused LM-head log-probs, plus the per-token
  entropy it always computes, the clipped loss, its metrics; then backward), followed
  by ``_clip_grad_norm``, ``optimizer.step``, ``lr_scheduler.step``, ``zero_grad``.
  Generation is replaced through TRL's own ``rollout_func`` seam by a function that
  returns the fixed batch (prompt ids, completion ids, log-probs, and the rewards as
  an extra field the reward function hands back), so no token is generated inside
  the timed step. Logging, saving and callbacks are not timed. ``trl_score_s`` is the
  part spent in ``_generate_and_score_completions``.
- ``engine``: ``HFEngine.generate`` of the batch's prompts, ``n`` = group size,
  exactly ``completion_len`` new tokens (``Sampling.ignore_eos``: EOS does not end a
  row, so the figure does not depend on what the model says), a fixed seed.
- ``loss_only`` (separately, after the rest): ``ftis_loss`` vs ``grpo_loss``, forward +
  backward on a fixed [batch, completion_len] log-prob tensor (the generator's
  log-probs plus seeded noise, so IS weights, caps and the filter all engage): the
  loss's own cost with no model around it.

The fixed batch: toy-arithmetic prompts (``toy/id/0``, ``toy/id/1``, ...), each
answered group-size times by the model itself at temperature 1, with EOS masked so
every completion has exactly ``completion_len`` tokens; ``logp_gen`` is the model's
own log-prob of each token (``sequence_logprobs``, no grad), as for a node's own
samples. Rewards are seeded: half of each group (rounded down) gets 1, the rest 0, so
no advantage is zero. None of these values changes the work a step does (every
operation in both losses is dense), only what the metrics read.

``round_overhead`` (per training mode, LoRA and full): ``node.bench.rounds`` plays real
rounds of a solo node with this model and times everything in a round that is not
generation, gather or the step (the weight hand-over into the engine, the checkpoint
every ``checkpoint_every`` rounds, scoring, packet encoding, the status file), against
the step time of the same rounds.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["BenchBatch", "format_train_bench", "make_bench_batch", "run_train_bench"]

KINDS = ("ftis", "nois", "grpo", "trl", "engine")


# --------------------------------------------------------------------------- the batch


@dataclass(frozen=True)
class BenchBatch:
    """One fixed training batch, in plain lists, shared by every contender."""

    prompts: list[str]  # one per group (the text TRL's dataset rows carry)
    prompt_ids: list[list[int]]  # one per sequence (group-major: G rows per prompt)
    completion_ids: list[list[int]]
    logp_gen: list[np.ndarray]  # float32, one per completion token
    rewards: list[float]
    group_ids: list[int]
    group_size: int

    @property
    def tokens(self) -> int:
        """Completion tokens in the batch (the tokens a step learns from)."""
        return sum(len(c) for c in self.completion_ids)


def make_bench_batch(engine: Any, n_prompts: int, group_size: int, completion_len: int, seed: int = 0) -> BenchBatch:
    """Sample the fixed batch with `engine`'s model (an `HFEngine`; see the module docstring)."""
    from transformers import GenerationConfig

    from node.tasks.toy import ToyTask
    from node.train.logprobs import sequence_logprobs

    if n_prompts < 1 or group_size < 1 or completion_len < 1:
        raise ValueError(
            f"n_prompts, group_size and completion_len must be >= 1, got {n_prompts}, {group_size}, {completion_len}"
        )
    task = ToyTask("id")
    prompts = [task.problem(task.task_id(i)).prompt for i in range(n_prompts)]
    ids = engine.encode(prompts)
    model = engine.base_model
    tok = engine.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in ids)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and width + completion_len > limit:
        raise ValueError(f"prompt + completion_len = {width + completion_len} exceeds the model's {limit} positions")
    input_ids = torch.full((n_prompts, width), pad, dtype=torch.long)
    attention = torch.zeros((n_prompts, width), dtype=torch.long)
    for i, p in enumerate(ids):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        # Every completion gets the nominal length, so "tokens per step" means one thing.
        min_new_tokens=completion_len,
        max_new_tokens=completion_len,
        num_return_sequences=group_size,
        pad_token_id=pad,
        eos_token_id=model.generation_config.eos_token_id,  # every id the engine stops on
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
        completions = out[:, width:].tolist()
        prompt_rows = [list(ids[i // group_size]) for i in range(n_prompts * group_size)]
        logp, _ = sequence_logprobs(model, prompt_rows, completions, pad_id=int(pad))
    rng = np.random.default_rng(seed)
    rewards: list[float] = []
    for _ in range(n_prompts):
        half = np.array([1.0] * (group_size // 2) + [0.0] * (group_size - group_size // 2))
        rewards.extend(rng.permutation(half).tolist())
    return BenchBatch(
        prompts=prompts,
        prompt_ids=prompt_rows,
        completion_ids=completions,
        logp_gen=[row.float().numpy().astype(np.float32) for row in logp],
        rewards=rewards,
        group_ids=[i // group_size for i in range(n_prompts * group_size)],
        group_size=group_size,
    )


def _train_batch(b: BenchBatch):
    """The batch as our Trainer takes it, with group-normalised advantages."""
    from node.train.ftis import group_advantages
    from node.train.trainer import TrainBatch, TrainSequence

    adv = group_advantages(torch.tensor(b.rewards, dtype=torch.float64), torch.tensor(b.group_ids))
    return TrainBatch(
        sequences=[
            TrainSequence(prompt_ids=p, completion_ids=c, logp_gen=lp, advantage=float(a), group_id=g)
            for p, c, lp, a, g in zip(b.prompt_ids, b.completion_ids, b.logp_gen, adv.tolist(), b.group_ids)
        ]
    )


# --------------------------------------------------------------------------- our steps


@contextlib.contextmanager
def _loss_variant(trainer: Any, variant: str) -> Iterator[None]:
    """Run `trainer` with another loss variant, everything else (model, optimizer) unchanged."""
    from node.train.ftis import LossConfig

    saved = trainer.cfg
    trainer.cfg = saved.model_copy(update={"loss": LossConfig(variant=variant)})
    try:
        yield
    finally:
        trainer.cfg = saved


def grpo_micro_loss(trainer: Any) -> Callable[..., torch.Tensor]:
    """Plain GRPO's loss (`grpo_loss`: PPO clip, beta = 0) as a `Trainer.step` micro-batch loss."""
    from node.train.ftis import grpo_loss

    def loss_fn(sub: list, logp: torch.Tensor, mask: torch.Tensor, sequence_scale: torch.Tensor) -> torch.Tensor:
        advantages = torch.tensor([s.advantage for s in sub], device=logp.device)
        loss, _ = grpo_loss(logp, advantages, mask, eps=trainer.cfg.loss.clip_eps, sequence_scale=sequence_scale)
        return loss

    return loss_fn


def _grpo_step(trainer: Any, batch: Any) -> float:
    """Plain GRPO on the trainer's own model and optimizer; returns the loss.

    It IS `Trainer.step`, with the micro-batch loss swapped for `grpo_loss` and the
    per-source off-policy metrics off: the same checks, plan, forward, backward, clip
    and optimizer step, so the two cannot drift apart.
    """
    return trainer.step(batch, loss_fn=grpo_micro_loss(trainer), batch_metrics=False)["loss"]


# --------------------------------------------------------------------------- TRL


class _TrlStep:
    """TRL's GRPOTrainer set up to train on a fixed batch; `step()` runs one update."""

    def __init__(self, model_dir: str | Path, batch: BenchBatch, cfg: Any, workdir: str, seed: int) -> None:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        n = len(batch.completion_ids)
        self.score_seconds = 0.0

        def rollout(prompts: list, trainer: Any) -> dict[str, list]:
            # TRL passes one prompt per sequence (each repeated group-size times);
            # the fixed batch answers them in the same group-major order.
            if len(prompts) != n:
                raise RuntimeError(f"TRL asked for {len(prompts)} completions, the fixed batch has {n}")
            return {
                "prompt_ids": [list(p) for p in batch.prompt_ids],
                "completion_ids": [list(c) for c in batch.completion_ids],
                "logprobs": [lp.tolist() for lp in batch.logp_gen],
                "bench_reward": list(batch.rewards),
            }

        # trl's reward-function contract: a list of float | None (None: no reward for that completion)
        def fixed_reward(completions: list, bench_reward: list[float | None], **_: Any) -> list[float | None]:
            return bench_reward

        timer = self

        class TimedGRPOTrainer(GRPOTrainer):
            def _generate_and_score_completions(self, inputs):
                start = time.perf_counter()
                out = super()._generate_and_score_completions(inputs)
                timer.score_seconds = time.perf_counter() - start
                return out

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        tokenizer.padding_side = "left"  # GRPOTrainer requires it
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        dtype = getattr(torch, cfg.dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        args = GRPOConfig(
            output_dir=workdir,
            per_device_train_batch_size=n,  # the whole batch in one forward, like our single micro-batch
            num_generations=batch.group_size,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            beta=0.0,  # no reference model, as F-TIS
            loss_type="grpo",
            epsilon=cfg.loss.clip_eps,
            temperature=1.0,
            max_completion_length=max(len(c) for c in batch.completion_ids),
            learning_rate=cfg.learning_rate,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_epsilon=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            optim="adamw_torch",  # torch.optim.AdamW, as our Trainer
            max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0,
            lr_scheduler_type="constant",
            bf16=False,
            fp16=False,
            use_cpu=cfg.device == "cpu",
            use_vllm=False,
            shuffle_dataset=False,
            report_to="none",
            save_strategy="no",
            logging_steps=10**9,
            dataloader_num_workers=0,
            seed=seed,
        )
        rows = [batch.prompts[g] for g in batch.group_ids]
        lora = cfg.lora_config()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rollout_func.*")  # "experimental feature"
            self.trainer = TimedGRPOTrainer(
                model=model,
                reward_funcs=fixed_reward,
                args=args,
                train_dataset=Dataset.from_dict({"prompt": rows}),
                processing_class=tokenizer,
                peft_config=lora,
                rollout_func=rollout,
            )
        tr = self.trainer
        tr.create_optimizer_and_scheduler(num_training_steps=10**6)
        # State the epoch loop sets before each update (no accumulation: one micro-batch).
        tr.current_gradient_accumulation_steps = 1
        tr.accelerator.gradient_state._set_sync_gradients(True)
        self.inputs = [{"prompt": p} for p in rows]
        assert tr.model is not None, "GRPOTrainer wraps the model it was given"
        self.trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)

    def step(self) -> float:
        """One optimizer update exactly as `Trainer._run_epoch` performs it; returns the loss."""
        tr = self.trainer
        assert tr.model is not None and tr.optimizer is not None and tr.lr_scheduler is not None, "set up in __init__"
        loss = tr.training_step(tr.model, self.inputs, None)
        if tr.args.max_grad_norm > 0:
            tr._clip_grad_norm(tr.model)
        tr.optimizer.step()
        tr.lr_scheduler.step()
        tr.model.zero_grad()
        tr.state.global_step += 1
        return float(loss)


# --------------------------------------------------------------------------- timing


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call, garbage collector paused (as timeit does).

    CPU time is the load-robust cross-check: on a shared machine, wall time also counts
    the time other processes held the cores.
    """
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.enable()


def _loss_only(b: BenchBatch, repeats: int) -> dict[str, Any]:
    """ftis_loss vs grpo_loss, forward + backward on a fixed log-prob tensor, median seconds."""
    from node.train.ftis import LossConfig, ftis_loss, grpo_loss

    width = max(len(c) for c in b.completion_ids)
    gen = torch.zeros((len(b.logp_gen), width))
    mask = torch.zeros_like(gen)
    for i, row in enumerate(b.logp_gen):
        gen[i, : len(row)] = torch.from_numpy(row)
        mask[i, : len(row)] = 1.0
    # The local policy slightly off the generator, so weights, caps and the filter all engage.
    noise = torch.randn(gen.shape, generator=torch.Generator().manual_seed(0)) * 0.1
    base = (gen + noise).clamp(max=0.0)
    adv = torch.tensor(b.rewards) * 2 - 1
    groups = torch.tensor(b.group_ids)
    cfg = LossConfig()

    def run(kind: str) -> None:
        logp = base.clone().requires_grad_(True)
        if kind == "ftis":
            loss, _ = ftis_loss(logp, gen, adv, mask, cfg, group_ids=groups)
        else:
            loss, _ = grpo_loss(logp, adv, mask, cfg.clip_eps, group_ids=groups)
        loss.backward()

    def per_call(kind: str, calls: int) -> float:
        def repeat() -> None:
            for _ in range(calls):
                run(kind)

        return _timed(repeat)[0] / calls

    run("ftis")  # warm-up
    run("grpo")
    calls = max(1, int(0.05 / max(per_call("ftis", 1), 1e-6)))
    raw: dict[str, list[float]] = {"ftis": [], "grpo": []}
    for _ in range(repeats):
        for kind in raw:
            raw[kind].append(per_call(kind, calls))
    ftis_s, grpo_s = statistics.median(raw["ftis"]), statistics.median(raw["grpo"])
    return {
        "ftis_loss_s": ftis_s,
        "grpo_loss_s": grpo_s,
        "overhead_vs_grpo": ftis_s / grpo_s - 1,
        "calls_per_repeat": calls,
        "raw_s": raw,
    }


def _resolve_model(model: str | Path) -> str:
    """What every contender loads: a model folder (tiny models built on first use) or a Hub id."""
    from node.models.registry import model_folder, resolve_model

    return model_folder(resolve_model(model), progress=False)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- the bench


def run_train_bench(
    model: str | Path = "tiny-m",
    batch: int = 16,
    completion_len: int = 64,
    repeats: int = 5,
    lora_rank: int = 8,
    group_size: int = 4,
    threads: int | None = 1,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    overhead_rounds: int = 10,
    overhead_modes: tuple[str, ...] = ("lora", "full"),
) -> dict[str, Any]:
    """Time one training step of each kind on one fixed batch; see the module docstring.

    `overhead_rounds` rounds (plus one warm-up) of a solo node per mode in
    `overhead_modes` measure `round_overhead_s`, with one checkpoint in them (0 rounds:
    skip it).

    `model` is anything `node.models.registry.resolve_model` takes (an alias such as
    tiny-m, a local folder, a Hub id). The batch is batch / group_size prompts x
    group_size completions. `progress`, if given, is called with a short line at each
    stage (the whole run takes several seconds even for the tiny models). `threads` is
    torch's intra-op thread count for the run (None: every core this
    process may use); torch's previous setting is restored afterwards. The default is
    1 because it is reproducible: with more threads than idle cores, OpenMP workers
    wait on each other and every kind slows down erratically (on a busy 2-core machine,
    2 threads turned a 50 ms step into 0.5-6 s).
    """
    if batch < 2 or group_size < 2 or batch % group_size:
        raise ValueError(f"batch ({batch}) must be a multiple of group_size ({group_size}), both >= 2")
    if completion_len < 1:
        raise ValueError(f"completion_len must be >= 1, got {completion_len}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if lora_rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {lora_rank}")
    if overhead_rounds == 1 or overhead_rounds < 0:
        raise ValueError(f"overhead_rounds must be 0 (skip) or >= 2, got {overhead_rounds}")
    if any(m not in ("lora", "full") for m in overhead_modes):
        raise ValueError(f"overhead_modes must be lora and/or full, got {overhead_modes}")
    threads = threads if threads is not None else _usable_cores()
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")

    from node.rollout.base import Sampling
    from node.rollout.hf import HFEngine
    from node.train.trainer import Trainer, TrainerConfig

    say = progress or (lambda line: None)
    say(f"resolving {model}")
    model_dir = _resolve_model(model)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        say("sampling the fixed batch")
        engine = HFEngine.from_pretrained(model_dir)
        n_prompts = batch // group_size
        fixed = make_bench_batch(engine, n_prompts, group_size, completion_len, seed)
        ours = _train_batch(fixed)
        cfg = TrainerConfig(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank, seed=seed)
        say("setting up our trainer and TRL's GRPOTrainer")
        trainer = Trainer(model_dir, cfg)
        with tempfile.TemporaryDirectory(prefix="ftis-bench-trl-") as workdir:
            trl = _TrlStep(model_dir, fixed, cfg, workdir, seed)
            ours_trainable = sum(p.numel() for p in trainer.params)
            if trl.trainable != ours_trainable:
                raise RuntimeError(
                    f"LoRA mismatch: TRL trains {trl.trainable} parameters, our trainer {ours_trainable}"
                )
            sampling = Sampling(max_tokens=completion_len, seed=seed, ignore_eos=True)
            engine_tokens: list[int] = []

            def engine_run() -> None:
                groups = engine.generate(fixed.prompts, group_size, sampling)
                engine_tokens.append(sum(len(s.token_ids) for g in groups for s in g))

            def ftis_run() -> None:
                trainer.step(ours)

            def nois_run() -> None:
                with _loss_variant(trainer, "nois"):
                    trainer.step(ours)

            steps: dict[str, Callable[[], Any]] = {
                "ftis": ftis_run,
                "nois": nois_run,
                "grpo": lambda: _grpo_step(trainer, ours),
                "trl": trl.step,
                "engine": engine_run,
            }
            say("warm-up")
            for kind in KINDS:  # one warm-up each, not counted
                steps[kind]()
            raw: dict[str, list[float]] = {kind: [] for kind in KINDS}
            cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}
            trl_score: list[float] = []
            for r in range(repeats):
                say(f"repeat {r + 1}/{repeats}")
                # Rotate the order so no kind always runs first (or right after the engine).
                for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                    wall, used = _timed(steps[kind])
                    raw[kind].append(wall)
                    cpu[kind].append(used)
                    if kind == "trl":
                        trl_score.append(trl.score_seconds)
            say("loss alone")
            loss_only = _loss_only(fixed, repeats)
            threads_after = torch.get_num_threads()
        n_params = sum(p.numel() for p in engine.base_model.parameters())
        engine.close()
        overhead = {}
        if overhead_rounds > 0:
            from node.bench.rounds import run_round_overhead

            for mode in overhead_modes:
                overhead[mode] = run_round_overhead(
                    model,
                    mode,
                    prompts=n_prompts,
                    group_size=group_size,
                    max_tokens=completion_len,
                    rounds=overhead_rounds,
                    lora_rank=lora_rank,
                    seed=seed,
                    progress=say,
                )
    finally:
        torch.set_num_threads(previous_threads)

    med = {kind: statistics.median(v) for kind, v in raw.items()}
    med_cpu = {kind: statistics.median(v) for kind, v in cpu.items()}
    tokens = fixed.tokens
    gen_tokens = statistics.median(engine_tokens[1:])  # the first run was the warm-up
    return {
        "model": str(model),
        "model_dir": str(model_dir),
        "n_params": n_params,
        "lora_rank": lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_targets": list(cfg.target_modules),
        "lora_params": ours_trainable,
        "dtype": cfg.dtype,
        "batch": batch,
        "group_size": group_size,
        "prompts": n_prompts,
        "completion_len": completion_len,
        "tokens_per_step": tokens,
        "prompt_tokens_per_step": sum(len(p) for p in fixed.prompt_ids),
        "torch_threads": threads,
        "torch_threads_after": threads_after,
        "repeats": repeats,
        "ftis_step_s": med["ftis"],
        "nois_step_s": med["nois"],
        "grpo_step_s": med["grpo"],
        "trl_step_s": med["trl"],
        "trl_score_s": statistics.median(trl_score),
        "loss_overhead_vs_grpo": med["ftis"] / med["grpo"] - 1,
        "loss_overhead_vs_nois": med["ftis"] / med["nois"] - 1,
        "ratio_vs_trl": med["ftis"] / med["trl"],
        "ftis_tokens_per_s": tokens / med["ftis"],
        "trl_tokens_per_s": tokens / med["trl"],
        "hf_engine_s": med["engine"],
        "hf_engine_tokens": gen_tokens,
        "hf_engine_requested_tokens": batch * completion_len,
        "hf_engine_tokens_per_s": statistics.median(t / s for t, s in zip(engine_tokens[1:], raw["engine"])),
        "hf_engine_fixed_length": True,
        "round_overhead_s": {mode: r["round_overhead_s"] for mode, r in overhead.items()},
        "round_overhead_vs_step": {mode: r["overhead_vs_step"] for mode, r in overhead.items()},
        "round_overhead": overhead,
        "cpu_s": {
            "ftis": med_cpu["ftis"],
            "nois": med_cpu["nois"],
            "grpo": med_cpu["grpo"],
            "trl": med_cpu["trl"],
            "hf_engine": med_cpu["engine"],
            "loss_overhead_vs_grpo": med_cpu["ftis"] / med_cpu["grpo"] - 1,
            "ratio_vs_trl": med_cpu["ftis"] / med_cpu["trl"],
        },
        "loss_only": loss_only,
        "raw_s": {
            "ftis": raw["ftis"],
            "nois": raw["nois"],
            "grpo": raw["grpo"],
            "trl": raw["trl"],
            "trl_score": trl_score,
            "hf_engine": raw["engine"],
        },
        "raw_cpu_s": {
            "ftis": cpu["ftis"],
            "nois": cpu["nois"],
            "grpo": cpu["grpo"],
            "trl": cpu["trl"],
            "hf_engine": cpu["engine"],
        },
    }


def format_train_bench(result: dict[str, Any]) -> str:
    """A readable table of `run_train_bench`'s result."""
    r = result
    tok = r["tokens_per_step"]
    cpu = r["cpu_s"]

    def row(name: str, wall: float, used: float | None) -> str:
        used_ms = f"{used * 1e3:>9.1f} ms" if used is not None else f"{'':>12}"
        return f"  {name:<42} {wall * 1e3:>9.1f} ms {used_ms} {tok / wall:>9.0f} tok/s"

    lo = r["loss_only"]
    lines = [
        f"train step: {r['model']} ({r['n_params']:,} params), LoRA r{r['lora_rank']} "
        f"alpha {r['lora_alpha']:g} on {', '.join(r['lora_targets'])} ({r['lora_params']:,} trainable), {r['dtype']}",
        f"batch {r['batch']} = {r['prompts']} prompts x {r['group_size']}, {r['completion_len']} tokens each "
        f"({tok} completion tokens/step), {r['torch_threads']} torch threads, median of {r['repeats']} "
        "(interleaved, one warm-up each)",
        "",
        f"  {'step':<42} {'wall':>12} {'cpu':>12} {'throughput':>15}",
        row("F-TIS (our Trainer.step)", r["ftis_step_s"], cpu["ftis"]),
        row("NoIS (same Trainer, variant nois)", r["nois_step_s"], cpu["nois"]),
        row("plain GRPO (same model + optimizer)", r["grpo_step_s"], cpu["grpo"]),
        row("TRL GRPOTrainer (one update, no generation)", r["trl_step_s"], cpu["trl"]),
        row("  of which TRL scoring + advantages", r["trl_score_s"], None),
        "",
        f"  F-TIS overhead vs plain GRPO   {r['loss_overhead_vs_grpo']:+.1%} wall, "
        f"{cpu['loss_overhead_vs_grpo']:+.1%} cpu  (goal <= +5%)",
        f"  F-TIS overhead vs NoIS         {r['loss_overhead_vs_nois']:+.1%} wall",
        f"  F-TIS / TRL step time          {r['ratio_vs_trl']:.2f}x wall, "
        f"{cpu['ratio_vs_trl']:.2f}x cpu  (goal <= 1.0)",
        f"  loss alone, fwd+bwd            ftis_loss {lo['ftis_loss_s'] * 1e3:.2f} ms, "
        f"grpo_loss {lo['grpo_loss_s'] * 1e3:.2f} ms ({lo['overhead_vs_grpo']:+.0%})",
        f"  HF engine generate             {r['hf_engine_tokens_per_s']:.0f} tok/s "
        f"({r['hf_engine_tokens']:.0f} tokens, fixed length: EOS ignored; {r['hf_engine_s'] * 1e3:.0f} ms)",
    ]
    for mode, o in r.get("round_overhead", {}).items():
        lines.append(
            f"  round overhead, {mode:<4}          {o['round_overhead_s'] * 1e3:.1f} ms = "
            f"{o['overhead_vs_step']:.1%} of the step ({o['step_s'] * 1e3:.0f} ms; goal <= 10%; CPU time "
            f"{o['cpu']['overhead_vs_step']:.1%}): engine load "
            f"{o['engine_load_s'] * 1e3:.1f} ms, checkpoint {o['checkpoint_s'] * 1e3:.0f} ms every "
            f"{o['checkpoint_every']} rounds (+ {o['checkpoint_write_s'] * 1e3:.0f} ms written in the background), "
            f"status file {o['status_file_s'] * 1e3:.1f} ms, "
            f"packet {o['packet_encode_s'] * 1e3:.1f} ms, rest {o['other_overhead_s'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)
