"""`ftis-node bench fuzz`: random and mutated packets through decode AND admission.

Every case (node/bench/fuzz_cases.py) goes through `protocol.decode` and through a real
`node.defence.admission.Admission` (the toy task, the tiny-s tokenizer and model) exactly as a
packet from the swarm would, and is judged by node/bench/fuzz_oracle.py. The result:

    cases                     how many packets were fed
    non_protocol_errors       decode raised something other than ProtocolError, or
                              admit raised at all (goal 0: bad input is data)
    admitted_invalid          admit returned groups from a packet that breaks the wire
                              format or a rule admission states (goal 0; see the oracle)
    admitted_unsafe           admitted sequences this node could not train on (empty, ids
                              past its vocabulary, past its positions, non-finite local
                              log-probs at the declared temperature: issue 10, item 0)
    decoder_accepted_invalid / decoder_rejected_valid
                              the decoder and the independent reference reader disagree
                              (the reference builds every object, so it skips rejected
                              cases whose body is over 64 KiB: `reference_skipped`)
    worst_decode_s / worst_decode_mib
                              the slowest decode of a fuzz case (median of re-runs of the
                              slowest ones) and the largest Python-heap peak of one decode
                              (tracemalloc: every object and numpy buffer; traced for every
                              `memory_every`-th case and the slowest ones)
    hostile                   the known worst inputs, each with its outcome, decode (wall and
                              CPU) and admit time (medians of repeats) and memory
    worst_reject_s / _cpu_s / _mib
                              the costliest rejection among them (goals: 50 ms, 32 MiB)

Figures of time are measurements for the benchmark; the tests assert the counts and
the memory bounds only.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from node.bench.fuzz_cases import FuzzContext, hostile_cases, make_case, make_seeds
from node.bench.fuzz_oracle import admission_violations, spec_is_cheap, spec_violation, unsafe_violations
from protocol import ProtocolError, decode

__all__ = ["FuzzTarget", "build_target", "format_fuzz_bench", "heap_peak_mib", "measure", "run_fuzz"]

PEER = "12D3KooWFuzzPeerFuzzPeerFuzzPeerFuzzPeerFuzzPe"
SWARM = "fuzz"
ROUND = 1000
REJECT_GOAL_S = 0.050
REJECT_GOAL_MIB = 32.0
_EXAMPLES = 5  # kept per finding


@dataclass
class FuzzTarget:
    """The receiving node: its admission and what the oracle needs to know about it."""

    admission: Any  # node.defence.admission.Admission
    ctx: FuzzContext
    group_logprobs: Callable[..., list[Any]]  # (prompt_ids, [completion_ids], temperature, top_k, top_p)


def build_target(model: str = "tiny-s") -> FuzzTarget:
    """A real Admission on the toy task with `model`'s tokenizer and weights."""
    import torch

    from node.defence.admission import Admission
    from node.defence.screen import score_completions
    from node.models import load_model, tokenizer_fingerprint
    from node.tasks import get_task
    from node.train.logprobs import sequence_logprobs

    net, tokenizer = load_model(model, progress=False)
    pad_id = tokenizer.pad_token_id or 0

    # The model is fixed during the fuzz, and mutated copies of one seed are often admitted
    # with the same sequences: remembering its log-probs only saves repeated forwards.
    @functools.lru_cache(maxsize=20_000)
    def cached(prompt: tuple[int, ...], completions: tuple[tuple[int, ...], ...], t: float, k: int, p: float) -> Any:
        with torch.no_grad():
            logp, _ = sequence_logprobs(
                net, [prompt] * len(completions), completions, temperature=t, top_k=k, top_p=p, pad_id=pad_id
            )
        return [logp[i, : len(c)].float().numpy() for i, c in enumerate(completions)]

    def group_logprobs(
        prompt_ids: list[int], completions: list[list[int]], temperature: float, top_k: int, top_p: float
    ) -> list[Any]:
        return cached(tuple(prompt_ids), tuple(map(tuple, completions)), temperature, top_k, top_p)

    @functools.lru_cache(maxsize=20_000)
    def cached_view(prompt: tuple[int, ...], completions: tuple[tuple[int, ...], ...], t: float, k: int, p: float):
        return score_completions(net, list(prompt), completions, temperature=t, top_k=k, top_p=p, pad_id=pad_id)

    def local_view(prompt_ids: list[int], completions: Any, temperature: float, top_k: int, top_p: float):
        return cached_view(tuple(prompt_ids), tuple(map(tuple, completions)), temperature, top_k, top_p)

    task = get_task("toy")
    fingerprint = tokenizer_fingerprint(tokenizer)
    # Built as the daemon builds its own: the default screen, this model's vocabulary and positions.
    admission = Admission(
        task=task,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        swarm_id=SWARM,
        local_view=local_view,
        vocab_size=min(len(tokenizer), int(net.config.vocab_size)),
        max_positions=int(net.config.max_position_embeddings),
    )
    ctx = FuzzContext(
        swarm_id=SWARM,
        round=ROUND,
        peer_id=PEER,
        fingerprint=fingerprint,
        vocab_size=int(net.config.vocab_size),
        max_positions=int(net.config.max_position_embeddings),
        tokenize=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        task=task,
        limits=admission.limits,
    )
    return FuzzTarget(admission=admission, ctx=ctx, group_logprobs=group_logprobs)


class _Tally:
    """Counts and a few examples per finding."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[dict[str, Any]]] = {}

    def add(self, finding: str, **example: Any) -> None:
        self.counts[finding] += 1
        kept = self.examples.setdefault(finding, [])
        if len(kept) < _EXAMPLES:
            kept.append(example)


def _judge(target: FuzzTarget, data: bytes, tally: _Tally, label: dict[str, Any]) -> dict[str, Any]:
    """Run one case through decode and admit and the oracle; returns its outcome."""
    limits = target.ctx.limits
    start = time.perf_counter()
    packet, outcome = None, "accepted"
    try:
        packet = decode(data, limits)
    except ProtocolError as err:
        outcome = err.code.value
    except Exception as err:
        outcome = "crash"
        tally.add("non_protocol_errors", where="decode", error=f"{type(err).__name__}: {err}", **label)
    decode_s = time.perf_counter() - start
    admitted = None
    try:
        admitted = target.admission.admit(PEER, data, ROUND)
    except Exception as err:
        tally.add("non_protocol_errors", where="admit", error=f"{type(err).__name__}: {err}", **label)
    spec = spec_violation(data, limits) if packet is not None or spec_is_cheap(data) else "not checked"
    if spec == "not checked":
        tally.counts["reference_skipped"] += 1
    if packet is not None and spec is not None:
        tally.add("decoder_accepted_invalid", rule=spec, **label)
    if packet is None and spec is None and outcome != "crash":
        tally.add("decoder_rejected_valid", code=outcome, **label)
    if admitted is not None and admitted.groups:
        tally.counts["admitted_cases"] += 1
        broken = [f"wire: {spec}"] if spec is not None else []
        if packet is not None:
            broken += admission_violations(target.admission, PEER, ROUND, packet, admitted)
        if broken or packet is None:
            tally.add("admitted_invalid", rules=broken or ["decoder rejected it"], **label)
        if packet is not None:
            c = target.ctx
            unsafe = unsafe_violations(
                admitted, packet, c.fingerprint, c.vocab_size, c.max_positions, target.group_logprobs
            )
            if unsafe:
                tally.add("admitted_unsafe", rules=unsafe, **label)
                for rule in unsafe:
                    tally.counts[f"unsafe:{rule}"] += 1
    if admitted is not None:
        for reason, n in admitted.rejected.items():
            tally.counts[f"rejected:{reason}"] += n
    return {"outcome": outcome, "decode_s": decode_s}


def heap_peak_mib(fn: Callable[[], Any]) -> float:
    """The Python-heap peak of one call of `fn`, in MiB (tracemalloc: objects and numpy buffers)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def measure(fn: Callable[[], Any], repeats: int = 5) -> tuple[float, float, float]:
    """Medians over `repeats` calls of `fn` of the wall and the CPU seconds (the CPU time
    is the cross-check on a loaded machine), and the `heap_peak_mib` of one more call."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), heap_peak_mib(fn)


def _decode_quietly(data: bytes, limits: Any) -> str:
    try:
        decode(data, limits)
        return "accepted"
    except ProtocolError as err:
        return err.code.value


def _hostile(target: FuzzTarget, tally: _Tally, repeats: int) -> dict[str, dict[str, Any]]:
    limits = target.ctx.limits
    out = {}
    for name, data in hostile_cases(target.ctx).items():
        outcome = _judge(target, data, tally, {"case": name})["outcome"]
        decode_s, decode_cpu_s, decode_mib = measure(lambda: _decode_quietly(data, limits), repeats)
        admit_s, _, admit_mib = measure(lambda: target.admission.admit(PEER, data, ROUND), max(1, repeats // 2))
        out[name] = {
            "bytes": len(data),
            "outcome": outcome,
            "decode_s": decode_s,
            "decode_cpu_s": decode_cpu_s,
            "decode_mib": decode_mib,
            "admit_s": admit_s,
            "admit_mib": admit_mib,
        }
    return out


def run_fuzz(
    cases: int = 100_000,
    seed: int = 0,
    model: str = "tiny-s",
    memory_every: int = 5,
    slowest: int = 20,
    repeats: int = 5,
    seeds_n: int = 2000,
    progress: Callable[[str], None] | None = None,
    target: FuzzTarget | None = None,
) -> dict[str, Any]:
    """Feed `cases` fuzz cases plus the hostile ones; see the module docstring for the result.

    The decode memory is traced for every `memory_every`-th case (1: all of them) and
    for the `slowest` cases, which are also re-timed `repeats` times.
    """
    if cases < 0 or memory_every < 1 or repeats < 1:
        raise ValueError("cases must be >= 0, memory_every and repeats >= 1")
    started = time.perf_counter()
    target = target or build_target(model)
    limits = target.ctx.limits
    rng = random.Random(seed)
    seeds = make_seeds(target.ctx, rng, seeds_n)
    tally = _Tally()
    by_mutation: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    timed: list[tuple[float, int, bytes, str]] = []
    worst_mib, worst_mib_case = 0.0, ""
    for i in range(cases):
        kind, mutation, data = make_case(seeds, rng)
        label = {"case": i, "seed_kind": kind, "mutation": mutation}
        result = _judge(target, data, tally, label)
        by_mutation[mutation] += 1
        outcomes[result["outcome"]] += 1
        timed.append((result["decode_s"], i, data, mutation))
        if len(timed) > 4 * slowest:
            timed = sorted(timed, key=lambda t: t[0], reverse=True)[:slowest]
        if i % memory_every == 0:
            mib = heap_peak_mib(lambda: _decode_quietly(data, limits))
            if mib > worst_mib:
                worst_mib, worst_mib_case = mib, f"case {i} ({mutation})"
        if progress and (i + 1) % 10_000 == 0:
            progress(f"fuzz: {i + 1:,}/{cases:,} cases, {time.perf_counter() - started:.0f} s")
    worst_s, worst_s_case = 0.0, ""
    for _, i, data, mutation in sorted(timed, key=lambda t: t[0], reverse=True)[:slowest]:
        s, _, mib = measure(lambda: _decode_quietly(data, limits), repeats)
        if s > worst_s:
            worst_s, worst_s_case = s, f"case {i} ({mutation})"
        if mib > worst_mib:
            worst_mib, worst_mib_case = mib, f"case {i} ({mutation})"
    fuzz_s = time.perf_counter() - started
    hostile = _hostile(target, tally, repeats)
    rejected = {k: v for k, v in hostile.items() if v["outcome"] != "accepted"}
    return {
        "cases": cases,
        "hostile_cases": len(hostile),
        "seed": seed,
        "model": model,
        "non_protocol_errors": tally.counts["non_protocol_errors"],
        "admitted_invalid": tally.counts["admitted_invalid"],
        "admitted_unsafe": tally.counts["admitted_unsafe"],
        "decoder_accepted_invalid": tally.counts["decoder_accepted_invalid"],
        "decoder_rejected_valid": tally.counts["decoder_rejected_valid"],
        "admitted_cases": tally.counts["admitted_cases"],
        "reference_skipped": tally.counts["reference_skipped"],
        "worst_decode_s": worst_s,
        "worst_decode_case": worst_s_case,
        "worst_decode_mib": worst_mib,
        "worst_decode_mib_case": worst_mib_case,
        "worst_reject_s": max(v["decode_s"] for v in rejected.values()) if rejected else None,
        "worst_reject_cpu_s": max(v["decode_cpu_s"] for v in rejected.values()) if rejected else None,
        "worst_reject_mib": max(v["decode_mib"] for v in rejected.values()) if rejected else None,
        "worst_reject_case": max(rejected, key=lambda k: rejected[k]["decode_s"]) if rejected else None,
        "goal_reject_s": REJECT_GOAL_S,
        "goal_reject_mib": REJECT_GOAL_MIB,
        "outcomes": dict(outcomes.most_common()),
        "mutations": dict(by_mutation.most_common()),
        "unsafe_rules": {k[7:]: v for k, v in tally.counts.items() if k.startswith("unsafe:")},
        "admission_rejections": {k[9:]: v for k, v in tally.counts.most_common() if k.startswith("rejected:")},
        "examples": tally.examples,
        "hostile": hostile,
        "fuzz_s": fuzz_s,
        "seconds": time.perf_counter() - started,
    }


def format_fuzz_bench(r: dict[str, Any]) -> str:
    """A plain-text summary of `run_fuzz`'s result."""

    def goal(value: float, target: float) -> str:
        return "pass" if value <= target else "FAIL"

    lines = [
        f"Fuzz: {r['cases']:,} cases + {r['hostile_cases']} hostile ones through decode and admission "
        f"({r['model']}, seed {r['seed']}, {r['seconds']:.0f} s)",
        "",
        *(
            f"  {label:<34}{r[key]:>10,}   goal 0   {goal(r[key], 0)}"
            for label, key in (
                ("non-protocol errors", "non_protocol_errors"),
                ("admitted invalid", "admitted_invalid"),
                ("admitted unsafe for this node", "admitted_unsafe"),
            )
        ),
        f"  {'decoder accepted invalid':<34}{r['decoder_accepted_invalid']:>10,}",
        f"  {'decoder rejected valid':<34}{r['decoder_rejected_valid']:>10,}",
        f"  {'cases admitted (some groups)':<34}{r['admitted_cases']:>10,}",
        f"  {'worst decode (fuzz cases)':<34}{r['worst_decode_s'] * 1e3:>10.2f} ms   {r['worst_decode_case']}",
        f"  {'worst decode memory':<34}{r['worst_decode_mib']:>10.2f} MiB  {r['worst_decode_mib_case']}",
    ]
    if r["unsafe_rules"]:
        lines.append("  unsafe, by rule: " + ", ".join(f"{k} {v}" for k, v in sorted(r["unsafe_rules"].items())))
    lines += ["", f"  {'hostile case':<32}{'bytes':>10}  {'outcome':<20}{'decode':>10}{'MiB':>8}{'admit':>10}"]
    for name, h in r["hostile"].items():
        lines.append(
            f"  {name:<32}{h['bytes']:>10,}  {h['outcome']:<20}{h['decode_s'] * 1e3:>8.2f}ms"
            f"{h['decode_mib']:>8.2f}{h['admit_s'] * 1e3:>8.1f}ms"
        )
    if r["worst_reject_s"] is not None:
        lines += [
            "",
            f"  worst rejection: {r['worst_reject_s'] * 1e3:.2f} ms (goal <= {r['goal_reject_s'] * 1e3:.0f}) "
            f"{goal(r['worst_reject_s'], r['goal_reject_s'])}, {r['worst_reject_mib']:.2f} MiB "
            f"(goal <= {r['goal_reject_mib']:.0f}) {goal(r['worst_reject_mib'], r['goal_reject_mib'])}",
        ]
    return "\n".join(lines)
