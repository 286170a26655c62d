"""Memory benchmark: peak resident memory of each phase of a round, per model and setting.

One fresh process per (model, setting) plays the phases of a round in order, as a node
does: load (the trainer and the engine, each with its model), generate (own prompts,
G completions each), admission (the node's view of peers' completions: its own
log-prob and rank of every token, no autograd), the training step, the checkpoint.
Before each phase the process gives freed memory back (`release_memory`) and restarts
its peak (`reset_peak_rss`: /proc/self/clear_refs), so a phase's figure is the most
resident memory WHILE it ran, never an earlier phase's. With CUDA, the allocator's peak
is reset and read the same way.

`path="before"` runs the same phases the way the code did before the memory cuts
(generation keeping `output_logits`, the one-pass [tokens, vocab] log-probs for training
and for the view), in a process of its own, so both paths are timed on one machine in one
run. Completions always run to `max_tokens` (EOS ignored) so the work does not depend on
what a model says; prompts are fixed token ids.

The Qwen2.5 models are built from their published configurations with random weights
(`from_config`, no download) and a word-level tokenizer over their 151,936 ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["QWEN_SHAPES", "format_leak_bench", "format_memory_bench", "run_leak_bench", "run_memory_bench"]

#: The published configurations (config.json on the Hub) of the Qwen2.5 base models, as numbers.
QWEN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-random": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "qwen2.5-1.5b-random": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
}
_QWEN_COMMON: dict[str, Any] = {
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

#: A round at a CPU node's defaults (8 prompts x G 12 x 64 tokens, micro-batch 256) and a small one.
DEFAULTS = {"prompts": 8, "group_size": 12, "max_tokens": 64, "prompt_tokens": 96, "micro_batch_tokens": 256}
SMALL = {"prompts": 4, "group_size": 4, "max_tokens": 64, "prompt_tokens": 32, "micro_batch_tokens": 256}


def random_qwen_folder(name: str, root: Path) -> Path:
    """A Qwen2.5-shaped model with seeded random weights (saved in bf16) and a tokenizer covering its ids."""
    folder = root / name
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**QWEN_SHAPES[name], **_QWEN_COMMON)
    tmp = root / f".{name}.tmp{os.getpid()}"
    torch.manual_seed(0)
    # transformers wraps Module.to with functools.wraps, whose stub keeps self as the first parameter
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(tmp)
    del model
    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, config.vocab_size)}}
    word = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(
        tokenizer_object=word, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    ).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


# ---------------------------------------------------------------------- one process
def _phase(name: str, fn, out: dict[str, Any]) -> Any:
    """Run `fn` as phase `name`: its peak resident (and CUDA) memory and seconds go into `out`."""
    import torch

    from node.memory import peak_rss, release_memory, reset_peak_rss, rss

    release_memory()
    if not reset_peak_rss() and name != "load":
        raise RuntimeError("cannot reset the peak (/proc/self/clear_refs): phases would read earlier peaks")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    # CPU seconds too: on a shared machine wall time moves with others' load, CPU time far less.
    out[name] = {"peak_rss": peak_rss(), "rss_after": rss(), "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3)}
    if cuda:
        out[name]["cuda_peak"] = torch.cuda.max_memory_allocated()
    return result


def _old_generate(engine, prompts: list[list[int]], n: int, sampling) -> list[list[Any]]:
    """Generation as before the cuts: `output_logits` for every step, scored after the loop."""
    import numpy as np
    import torch
    from transformers import GenerationConfig

    from node.rollout.base import Sample
    from node.train.logprobs import sampling_logprobs

    per_call = max(1, engine.max_batch_sequences // n)
    results = []
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(sampling.seed or 0)
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start : start + per_call]
            input_ids = torch.tensor(chunk)
            config = GenerationConfig(
                do_sample=True,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                max_new_tokens=sampling.max_tokens,
                num_return_sequences=n,
                eos_token_id=[],
                pad_token_id=engine._pad,
                return_dict_in_generate=True,
                output_logits=True,
            )
            out = engine.base_model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            generated = out.sequences[:, input_ids.shape[1] :]
            logprobs = torch.stack(
                [
                    sampling_logprobs(x, generated[:, t], sampling.temperature, sampling.top_k, sampling.top_p)
                    for t, x in enumerate(out.logits)
                ],
                dim=1,
            ).numpy()
            for i, p in enumerate(chunk):
                results.append(
                    [
                        Sample(
                            prompt_token_ids=p,
                            token_ids=generated[row].tolist(),
                            logprobs=logprobs[row].astype(np.float32),
                            text="",
                            finish_reason="length",
                        )
                        for row in range(i * n, (i + 1) * n)
                    ]
                )
    return results


def measure(setting: dict[str, Any]) -> dict[str, Any]:
    """The phases of one round in THIS process (call it in a fresh one); figures by phase."""
    import numpy as np
    import torch

    from node.memory import CPU_GENERATE_BATCH, ModelShape, estimate, generate_call_sequences
    from node.models import model_folder, resolve_model
    from node.rollout import Sampling, make_engine
    from node.train.logprobs import completion_views
    from node.train.trainer import TrainBatch, Trainer, TrainerConfig, TrainSequence

    torch.set_num_threads(setting.get("threads", 1))
    before = setting.get("path") == "before"
    model = setting["model"]
    folder = Path(setting["folder"]) if setting.get("folder") else model_folder(resolve_model(model))
    out: dict[str, Any] = {}
    cfg = TrainerConfig(
        mode=setting["mode"],
        micro_batch_tokens=setting["micro_batch_tokens"],
        gradient_checkpointing=setting.get("gradient_checkpointing", False),
        chunked_logprobs=not before,
    )

    shared = not before  # the engine on the trainer's tensors, as the node does since the cuts
    batch = 64 if before else setting.get("generate_batch", CPU_GENERATE_BATCH)

    def load():
        trainer = Trainer(folder, cfg)
        # Before the cuts every call took 64 sequences; now the node's device default.
        engine = make_engine(
            "hf", folder, max_batch_sequences=batch, **({"share_with": trainer.model} if shared else {})
        )
        return trainer, engine

    trainer, engine = _phase("load", load, out)
    vocab = min(trainer.vocab_size, len(engine.tokenizer))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, setting["prompt_tokens"]).tolist() for _ in range(setting["prompts"])]
    n = setting["group_size"]
    sampling = Sampling(temperature=0.7, max_tokens=setting["max_tokens"], seed=1, ignore_eos=True)
    if before:
        samples = _phase("generate", lambda: _old_generate(engine, prompts, n, sampling), out)
    else:
        samples = _phase("generate", lambda: engine.generate(prompts, n=n, sampling=sampling), out)
    tokens = sum(len(s.token_ids) for g in samples for s in g)
    out["generate"]["tokens_per_s"] = round(tokens / out["generate"]["seconds"], 2)
    out["generate"]["tokens_per_cpu_s"] = round(tokens / out["generate"]["cpu_seconds"], 2)

    def admit(groups):
        if before:
            from node.defence.screen import score_completions

            return [
                score_completions(
                    trainer.model,
                    g[0].prompt_token_ids,
                    [s.token_ids for s in g],
                    temperature=0.7,
                    top_k=0,
                    top_p=1.0,
                    pad_id=trainer.pad_id,
                    token_budget=cfg.micro_batch_tokens,
                )
                for g in groups
            ]
        return [
            completion_views(
                trainer.model,
                g[0].prompt_token_ids,
                [s.token_ids for s in g],
                0.7,
                0,
                1.0,
                trainer.pad_id,
                token_budget=cfg.micro_batch_tokens,
            )
            for g in groups
        ]

    if setting.get("admission", True):  # a solo node admits nothing; the largest model skips it for time
        _phase("admission", lambda groups=samples: admit(groups), out)
    seqs = [
        TrainSequence(
            prompt_ids=s.prompt_token_ids,
            completion_ids=s.token_ids,
            logp_gen=s.logprobs,
            advantage=1.0 if j % 2 else -1.0,
            group_id=i,
            temperature=0.7,
        )
        for i, g in enumerate(samples)
        for j, s in enumerate(g)
    ]
    batch = TrainBatch(sequences=seqs)
    samples = []  # the batch holds what training needs
    metrics = _phase("train", lambda: trainer.step(batch), out)
    out["train"]["tokens_per_s"] = round(metrics["tokens"] / out["train"]["seconds"], 2)
    out["train"]["tokens_per_cpu_s"] = round(metrics["tokens"] / out["train"]["cpu_seconds"], 2)
    out["train"]["micro_batches"] = metrics["micro_batches"]
    with tempfile.TemporaryDirectory() as tmp:
        _phase("checkpoint", lambda: trainer.save_checkpoint(Path(tmp), 1), out)
    shape = ModelShape.from_folder(folder)
    est = estimate(
        shape,
        mode=setting["mode"],
        micro_batch_tokens=setting["micro_batch_tokens"],
        gradient_checkpointing=setting.get("gradient_checkpointing", False),
        generate_sequences=generate_call_sequences(engine.max_batch_sequences, setting["prompts"], n),
        sequence_tokens=setting["prompt_tokens"] + setting["max_tokens"],
        engine_weights=not shared,
    )
    phases = [p for p in ("load", "generate", "admission", "train", "checkpoint") if p in out]
    out["round_peak"] = max(out[p]["peak_rss"] for p in phases)
    out["estimate"] = est.total
    out["estimate_parts"] = est.parts
    out["estimate_error"] = round(est.total / out["round_peak"] - 1, 3)
    out["params"] = shape.params
    return out


# ---------------------------------------------------------------------- the sweep
def _settings(models: list[str], quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model in models:
        big = model.startswith("qwen2.5-1.5b")
        sizes = [("small", SMALL)] if big or quick else [("defaults", DEFAULTS), ("small", SMALL)]
        modes = ["lora", "full"] if model.startswith("smollm2") and not quick else ["lora"]
        for mode in modes:
            for size_name, size in sizes:
                if mode == "full" and size_name == "defaults":
                    continue
                rows.append({"model": model, "mode": mode, "size": size_name, **size})
    return rows


def _child(setting: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`measure(setting)` in a fresh Python process; its JSON answer."""
    code = "import json, sys; from node.bench.memory import measure as m; print(json.dumps(m(json.loads(sys.argv[1]))))"
    env = {**os.environ, "OMP_NUM_THREADS": str(setting.get("threads", 1)), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(setting)], capture_output=True, text=True, timeout=timeout, env=env
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_memory_bench(
    models: list[str] | None = None,
    *,
    quick: bool = False,
    compare: bool = True,
    sweep: bool = True,
    threads: int = 1,
    timeout: float = 3600.0,
    on_result=None,
) -> dict[str, Any]:
    """Every (model, mode, size) in a fresh process, after the cuts and (`compare`) before them.

    `sweep`: tiny-m's peak against micro-batch tokens, vocabulary (tiny-m vs SmolLM2 at one
    setting) and group size.
    """
    from node.models.cache import models_dir

    models = models or (["tiny-m"] if quick else ["tiny-m", "smollm2-135m-embedded", "qwen2.5-0.5b-random"])
    runs: list[dict[str, Any]] = []
    for setting in _settings(models, quick):
        if setting["model"] in QWEN_SHAPES:
            setting["folder"] = str(random_qwen_folder(setting["model"], models_dir()))
        setting["threads"] = threads
        # The before path of the 1.5B model would hold its [tokens, vocab] logits: not worth the machine's memory.
        paths = ["after", "before"] if compare and not setting["model"].startswith("qwen2.5-1.5b") else ["after"]
        for path in paths:
            row = {**setting, "path": path, **_child({**setting, "path": path}, timeout)}
            runs.append(row)
            if on_result:
                on_result(row)
    result: dict[str, Any] = {"runs": runs}
    if sweep:
        base = {"model": "tiny-m", "mode": "lora", "threads": threads, "path": "after", **SMALL}
        result["sweep"] = {
            "micro_batch_tokens": {
                str(t): _child({**base, "micro_batch_tokens": t}, timeout).get("train", {}).get("peak_rss")
                for t in (256, 1024, 4096)
            },
            "group_size": {str(g): _child({**base, "group_size": g}, timeout).get("round_peak") for g in (2, 4, 8, 16)},
        }
    return result


def format_memory_bench(result: dict[str, Any]) -> str:
    lines = [
        f"{'model':24} {'mode':4} {'size':8} {'path':6} {'load':>6} {'gen':>6} {'admit':>6} {'train':>6} {'ckpt':>6}"
        f" {'peak':>6} {'est':>6} {'gen tok/cpu-s':>13} {'train tok/cpu-s':>15}",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"{r['model']:24} {r['mode']:4} {r['size']:8} {r['path']:6} error: {r['error']}")
            continue
        phases = " ".join(
            f"{r[p]['peak_rss'] / 1e9:6.2f}" if p in r else f"{'-':>6}"
            for p in ("load", "generate", "admission", "train", "checkpoint")
        )
        speed = f"{r['generate']['tokens_per_cpu_s']:13.1f} {r['train']['tokens_per_cpu_s']:15.1f}"
        lines.append(
            f"{r['model']:24} {r['mode']:4} {r['size']:8} {r['path']:6} {phases} {r['round_peak'] / 1e9:6.2f}"
            f" {r['estimate'] / 1e9:6.2f} {speed}"
        )
    lines.append("  GB resident at each phase's peak (fresh process per setting, peak reset per phase);")
    lines.append("  est: node.memory.estimate for the same setting; before: the code path before the memory cuts;")
    lines.append("  tokens per CPU-second of the measured process (wall-clock figures are in the JSON).")
    for name, row in result.get("sweep", {}).items():
        figures = ", ".join(f"{k}: {v / 1e9:.2f} GB" if v else f"{k}: -" for k, v in row.items())
        lines.append(f"  tiny-m {name}: {figures}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the long run
def leak_check(settings: dict[str, Any]) -> dict[str, Any]:
    """A solo node over `rounds` rounds in THIS process (call it in a fresh one): resident memory after each."""
    import torch

    from node.bench.rounds import solo_node
    from node.memory import rss

    torch.set_num_threads(1)
    rounds = settings["rounds"]
    with tempfile.TemporaryDirectory(prefix="ftis-bench-leak-") as tmp:
        node = solo_node(
            Path(tmp) / "node",
            "bench-leak",
            model=settings["model"],
            task="toy",
            prompts_per_round=settings["prompts"],
            group_size=settings["group_size"],
            seed=0,
        )
        try:
            resident = []
            for r in range(rounds):
                node.finish_round(r, node.begin_round(r))
                resident.append(rss())
        finally:
            node.close()
    return {"rss_by_round": resident}


def run_leak_bench(
    model: str = "tiny-s", rounds: int = 200, *, prompts: int = 8, group_size: int = 12, timeout: float = 3600.0
) -> dict[str, Any]:
    """Resident memory of a solo node at round 20 and at round `rounds` (a fresh process; goal: within 10 %)."""
    if rounds < 21:
        raise ValueError(f"rounds must be > 20 (round 20 is the reference), got {rounds}")
    settings = {"model": model, "rounds": rounds, "prompts": prompts, "group_size": group_size}
    code = (
        "import json, sys; from node.bench.memory import leak_check as m; print(json.dumps(m(json.loads(sys.argv[1]))))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(settings)], capture_output=True, text=True, timeout=timeout, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"leak check exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    resident = json.loads(proc.stdout.strip().splitlines()[-1])["rss_by_round"]
    at_20, last = resident[19], resident[-1]
    return {
        **settings,
        "rss_round_20": at_20,
        "rss_last_round": last,
        "growth": round(last / at_20 - 1, 4),
        "rss_every_20": resident[19::20],
    }


def format_leak_bench(result: dict[str, Any]) -> str:
    return (
        f"{result['model']}, {result['rounds']} rounds ({result['prompts']} prompts x {result['group_size']}): "
        f"resident {result['rss_round_20'] / 1e9:.3f} GB at round 20, {result['rss_last_round'] / 1e9:.3f} GB at round "
        f"{result['rounds']} ({result['growth']:+.1%}); every 20 rounds: "
        + ", ".join(f"{x / 1e9:.3f}" for x in result["rss_every_20"])
    )
