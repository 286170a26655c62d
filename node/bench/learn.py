"""Learning benchmark: does a node's reward rise with the defaults `ftis-node train` uses?

A solo `node.daemon.Node` (the daemon's own round loop, trainer and engine, on an
in-process exchange no one else answers) plays `rounds` rounds with the model's
defaults: the task, chat template, max tokens and temperature `join` picks for the
model (`NodeConfig.generation`), the default LoRA and learning rate unless `lrs` names
others. Each learning rate is one run from the same start.

Per-round training rewards are the mean over this round's prompts (8 prompts x 12
samples by default): noisy, and drawn from a new set of prompts each round. The figure
that decides is therefore a held-out eval: `eval_problems` fixed problems of the same
task, never among the training prompts (`node.experiment.evaluate.eval_set` salts its
seed), each sampled `eval_samples` times with the node's own sampling settings and a
fixed seed, measured before round 1 and every `eval_every` rounds after it, on the
weights the node generates with. `eval_gain` = last eval - first eval.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_learn_bench", "run_learn_bench"]


def run_learn_bench(
    model: str = "smollm2-135m-embedded",
    *,
    rounds: int = 20,
    lrs: Sequence[float | None] = (None,),
    task: str | None = None,
    eval_problems: int = 32,
    eval_samples: int = 4,
    eval_every: int = 5,
    threads: int = 0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One solo run of `rounds` rounds per learning rate (None: the node's default); see the module docstring."""
    if rounds < 1 or eval_every < 1:
        raise ValueError(f"rounds and eval_every must be >= 1, got {rounds} and {eval_every}")
    say = progress or (lambda line: None)
    runs = [
        _one_run(model, rounds, lr, task, eval_problems, eval_samples, eval_every, threads, seed, say) for lr in lrs
    ]
    return {
        "model": model,
        "rounds": rounds,
        "eval_problems": eval_problems,
        "eval_samples": eval_samples,
        "eval_every": eval_every,
        "seed": seed,
        "runs": runs,
    }


def _one_run(
    model: str,
    rounds: int,
    lr: float | None,
    task: str | None,
    eval_problems: int,
    eval_samples: int,
    eval_every: int,
    threads: int,
    seed: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from node.bench.rounds import solo_node
    from node.experiment.evaluate import eval_set, sampled_reward_mean

    with tempfile.TemporaryDirectory(prefix="ftis-bench-learn-") as tmp:
        # No checkpoint in the run: this bench measures learning, not the disk.
        given = dict(model=model, task=task, lr=lr, seed=seed, threads=threads, checkpoint_every=rounds + 1)
        node = solo_node(Path(tmp) / "node", "bench-learn", **given)
        cfg = node.cfg
        try:
            gen = node.generation
            evals = eval_set("heldout", gen.task, eval_problems, seed=seed)
            label = f"lr {node.trainer.cfg.learning_rate:g}"

            def evaluate(after: int) -> dict[str, float]:
                start = time.perf_counter()
                reward = sampled_reward_mean(node, evals, gen.max_tokens, eval_samples, seed)
                say(f"{label}: eval after {after} round(s): {reward:.3f}")
                return {"after_rounds": after, "reward_mean": reward, "seconds": time.perf_counter() - start}

            curve = [evaluate(0)]
            per_round: list[dict[str, float]] = []
            for r in range(rounds):
                result = node.finish_round(r, node.begin_round(r))
                if result is None:
                    raise RuntimeError(f"round {r} did not finish")
                per_round.append(
                    {
                        "reward_mean": result.reward_mean,
                        "groups_with_signal": result.metrics.get("groups_with_signal", 0.0),
                        "grad_norm": result.metrics.get("grad_norm", 0.0),
                        "seconds": result.seconds,
                    }
                )
                say(f"{label}: round {r + 1}/{rounds}: reward {result.reward_mean:.3f} ({result.seconds:.0f} s)")
                if (r + 1) % eval_every == 0 or r + 1 == rounds:
                    curve.append(evaluate(r + 1))
            settings = {
                "task": gen.task,
                "chat_template": gen.chat_template,
                "max_tokens": gen.max_tokens,
                "temperature": gen.temperature,
                "prompts_per_round": cfg.prompts_per_round,
                "group_size": cfg.group_size,
                "train_mode": cfg.train_mode,
                "lr": node.trainer.cfg.learning_rate,
            }
        finally:
            node.close()

    rewards = [p["reward_mean"] for p in per_round]
    window = max(1, min(5, rounds // 2))  # the first and last rounds, a few of them against the noise
    return {
        "settings": settings,
        "eval": curve,
        "eval_before": curve[0]["reward_mean"],
        "eval_after": curve[-1]["reward_mean"],
        "eval_gain": curve[-1]["reward_mean"] - curve[0]["reward_mean"],
        "train_reward_first": statistics.mean(rewards[:window]),
        "train_reward_last": statistics.mean(rewards[-window:]),
        "train_window": window,
        "round_s_median": statistics.median(p["seconds"] for p in per_round),
        "per_round": per_round,
    }


def format_learn_bench(result: dict[str, Any]) -> str:
    """The eval curve and the training reward of each run, one block per learning rate."""
    lines = [
        f"learning bench: {result['model']}, {result['rounds']} rounds, held-out eval "
        f"{result['eval_problems']} problems x {result['eval_samples']} samples"
    ]
    for run in result["runs"]:
        s = run["settings"]
        lines.append(
            f"\nlr {s['lr']:g}, {s['train_mode']}, task {s['task']}, {s['prompts_per_round']} x {s['group_size']} "
            f"per round, T {s['temperature']:g}, {s['max_tokens']} tokens, chat template {s['chat_template']}"
        )
        lines.append("  eval reward: " + "  ".join(f"{e['after_rounds']}: {e['reward_mean']:.3f}" for e in run["eval"]))
        lines.append(
            f"  eval gain {run['eval_gain']:+.3f}; training reward first {run['train_window']} rounds "
            f"{run['train_reward_first']:.3f} -> last {run['train_window']} {run['train_reward_last']:.3f}; "
            f"median round {run['round_s_median']:.0f} s"
        )
    return "\n".join(lines)
