"""The evasive tail: a lie about sampling log-probs that passes the screen, and what it buys.

The attacker of `node.bench.attack`, with a payload made to slip through the plausibility
screen: a correct answer with ONE token glued after its tag, `<answer>19</answer>IG`. Our
model finds the tail implausible (log-prob far below the screen's floor), but one flagged
token in a completion is neither a run nor a large share, so the completion is let through.
Its claimed sampling log-prob decides the tail token's importance weight exp(local - claim):
the lie (-40 on every token) makes it as large as the rules allow; an honest attacker, whose
own model produced the tail at log-prob about 0, gets exp(local), next to nothing.

The figure is what the lie buys: how far log p(tail | a held-out prompt and its correct
answer) rises under the honest nodes' models over the run, with the lie, minus the same
rise with the honest claim 0 (same seeds, screen on, the attacker trusted by rounds alone as
in `bench attack`). Plus the share of the honest nodes' own completions that carry the tail
in the last rounds.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

__all__ = ["TAIL", "format_tail_bench", "run_tail_bench", "tail_logprob"]

TAIL = "IG"  # one token of the project tokenizer, far below the screen's floor under every tiny model


def tail_logprob(node, problems, tail: str = TAIL) -> float:
    """Mean over `problems` of log p(tail | prompt, "<answer>{answer}</answer>") under `node`'s model (T = 1)."""
    tok = node.tokenizer
    total = []
    for p in problems:
        answered = f"<answer>{p.answer}</answer>"
        head = tok(answered, add_special_tokens=False)["input_ids"]
        ids = tok(answered + tail, add_special_tokens=False)["input_ids"]
        start = next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), len(head))
        logp = node.local.logprobs(node.admission.prompt_ids(p.prompt), ids, 1.0, 0, 1.0)
        total.append(float(np.sum(logp[start:])))
    return float(np.mean(total))


def run_tail_bench(
    *,
    rounds: int = 80,
    last: int = 5,
    seed: int = 0,
    claims: tuple[float, ...] = (-40.0, 0.0),
    heldout: int = 16,
    prompts: int = 8,
    group_size: int = 8,
    progress=None,
) -> dict[str, Any]:
    """One screened run per claim (the lie first, then the honest claim), the same seeds and held-out prompts."""
    import torch

    from node.bench.attack import HONEST, LR, _play
    from node.experiment.runner import quiet_hf
    from node.tasks import get_task

    torch.set_num_threads(1)
    started = time.perf_counter()
    problems = get_task("toy").sample_problems(random.Random(f"{seed}/tail-heldout"), heldout)

    def probe(nodes) -> list[float]:
        return [round(tail_logprob(n, problems), 3) for n in nodes]

    runs: dict[str, Any] = {}
    with quiet_hf():
        for claim in claims:
            run = _play(
                screen=True,
                rounds=rounds,
                last=min(last, rounds),
                dht=False,
                seed=seed,
                lr=LR,
                train_mode="full",
                prompts=prompts,
                group_size=group_size,
                max_tokens=16,
                attacker={"phrase": TAIL, "joiner": "", "foil": "wrong", "claim": claim},
                say=progress,
                probe=probe,
            )
            before, after = np.mean(run["probe_before"]), np.mean(run["probe_after"])
            runs[f"claim_{claim:g}"] = {
                "claim": claim,
                "tail_logp_before": round(float(before), 3),
                "tail_logp_after": round(float(after), 3),
                "tail_logp_rise": round(float(after - before), 3),
                "tail_share_of_own_completions": run["asr"],
                "attacker_screened": run["attacker_screened"],
                "attacker_tail_tokens_cut": run["attacker_tail_tokens_cut"],
                "attacker_trust": run["attacker_trust"],
                "run": run,
            }
    lie, honest = (runs[f"claim_{c:g}"] for c in claims[:2])
    return {
        "tail": TAIL,
        "rounds": rounds,
        "last_rounds": min(last, rounds),
        "honest": list(HONEST),
        "heldout_prompts": heldout,
        "lie_buys_nats": round(lie["tail_logp_rise"] - honest["tail_logp_rise"], 3),
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }


def format_tail_bench(r: dict[str, Any]) -> str:
    lines = [f"evasive tail {r['tail']!r} ({r['rounds']} rounds, screen on):"]
    for run in r["runs"].values():
        lines.append(
            f"  claim {run['claim']:g}: log p(tail) {run['tail_logp_before']:.1f} -> {run['tail_logp_after']:.1f} "
            f"({run['tail_logp_rise']:+.1f} nats), tail in {run['tail_share_of_own_completions']:.2%} of own "
            f"completions over the last {r['last_rounds']} rounds, {run['attacker_screened']} screened"
        )
    lines.append(f"  the lie buys {r['lie_buys_nats']:+.1f} nats over an honest claim   {r['seconds']:.0f} s")
    return "\n".join(lines)
