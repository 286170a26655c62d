"""`ftis-node bench all`: every benchmark in one run, written to one JSON and one markdown file.

Each benchmark is imported only when its turn comes (the protocol one needs no torch,
the gather one starts DHT processes, the train one imports TRL), and one that fails is
recorded as ``{"error": "..."}`` while the others still run, so a broken optional piece
never costs the rest of the report. The JSON holds the machine description, the
command line, the settings and full result of every benchmark and the goal verdicts;
the markdown (``docs/benchmarks.md``) is the readable view of the same dict.
"""

from __future__ import annotations

import importlib
import json
import math
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_NAMES",
    "GOALS",
    "BenchSpec",
    "Goal",
    "default_specs",
    "evaluate_goals",
    "format_suite",
    "render_markdown",
    "run_all",
    "run_specs",
    "write_report",
]

BENCH_NAMES = ("protocol", "train", "gather", "engines", "fuzz", "attack")
REGENERATE = "ftis-node bench all --out docs/benchmarks.md --json-out docs/benchmarks.json"


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark to run: `module.function(**kwargs)`, imported when it runs."""

    name: str
    module: str
    function: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self) -> dict[str, Any]:
        fn = getattr(importlib.import_module(self.module), self.function)
        return fn(**self.kwargs)


def default_specs(quick: bool = False) -> list[BenchSpec]:
    """Every benchmark at full size, or (quick) at the smallest sizes that exercise them."""
    if quick:
        protocol = {"repeats": 1}
        train = {
            "model": "tiny-s",
            "batch": 4,
            "group_size": 2,
            "completion_len": 8,
            "repeats": 1,
            "overhead_rounds": 2,
        }
        gather = {"peers": [2], "rounds": 1}
        engines = {"models": ["tiny-s"], "prompts": 2, "max_tokens": 4, "repeats": 1}
        fuzz = {"cases": 300, "seeds_n": 100, "repeats": 1, "slowest": 5, "model": "tiny-s"}
        attack = {"model": "tiny-s", "rounds": 2, "last": 1, "prompts": 2, "group_size": 4}
        attack |= {"heterogeneous_rounds": 0, "tail_rounds": 0, "free_identity_rounds": 0, "judge": None}
    else:
        protocol = {"repeats": 5}
        train = {"model": "tiny-m", "batch": 16, "group_size": 4, "completion_len": 64, "repeats": 5}
        gather = {"peers": [8, 16, 32], "rounds": 3, "simulate": 1000}
        engines = {"models": ["tiny-s", "tiny-m", "tiny-l"], "prompts": 16, "max_tokens": 32, "repeats": 5}
        fuzz = {"cases": 100_000, "model": "tiny-s"}
        attack = {}  # the defaults of `ftis-node bench attack`
    return [
        BenchSpec("protocol", "node.bench.protocol", "run_protocol_bench", protocol),
        BenchSpec("train", "node.bench.train", "run_train_bench", train),
        BenchSpec("gather", "node.bench.gather", "run_gather_bench", gather),
        BenchSpec("engines", "node.bench.engines", "run_engine_bench", engines),
        BenchSpec("fuzz", "node.bench.fuzz", "run_fuzz", fuzz),
        BenchSpec("attack", "node.bench.attack", "run_attack_bench", attack),
    ]


# --------------------------------------------------------------------------- goals


@dataclass(frozen=True)
class Goal:
    """A target for one figure; `value` reads it from the benchmark's dict (KeyError: not measured)."""

    bench: str
    figure: str
    value: Callable[[dict[str, Any]], float]
    op: str  # "<=" or ">="
    target: float
    unit: str


def _round_trip(r: dict[str, Any]) -> float:
    # Tokens per second of encoding AND decoding one packet: n / (t_encode + t_decode).
    return 1.0 / (1.0 / r["encode_tokens_per_s"] + 1.0 / r["decode_tokens_per_s"]) / 1e6


GOALS: tuple[Goal, ...] = (
    Goal("protocol", "bytes per token (vocab 151,646, no zstd)", lambda r: r["bytes_per_token"], "<=", 4.5, "B/token"),
    Goal("protocol", "encode + decode (validated), one packet", _round_trip, ">=", 20.0, "M tokens/s"),
    Goal("train", "F-TIS step overhead vs plain GRPO", lambda r: r["loss_overhead_vs_grpo"], "<=", 0.05, ""),
    Goal("train", "F-TIS step time / TRL GRPOTrainer step time", lambda r: r["ratio_vs_trl"], "<=", 1.0, "x"),
    Goal("gather", "gather median at 32 peers", lambda r: r["gather_s_median"]["32"], "<=", 0.5, "s"),
    Goal(
        "gather",
        "bytes read per node, 32 peers / 8 peers",
        lambda r: r["bytes_read_per_node"]["32"] / r["bytes_read_per_node"]["8"],
        "<=",
        1.5,
        "x",
    ),
    Goal("fuzz", "non-protocol errors (decode or admit raised)", lambda r: r["non_protocol_errors"], "<=", 0, "cases"),
    Goal("fuzz", "admitted invalid (wire format or admission rule)", lambda r: r["admitted_invalid"], "<=", 0, "cases"),
    Goal("fuzz", "admitted unsafe for this node (issue 10, item 0)", lambda r: r["admitted_unsafe"], "<=", 0, "cases"),
    Goal("fuzz", "worst hostile packet: time to reject", lambda r: r["worst_reject_s"] * 1e3, "<=", 50.0, "ms"),
    Goal("fuzz", "worst hostile packet: memory to reject", lambda r: r["worst_reject_mib"], "<=", 32.0, "MiB"),
    Goal(
        "attack",
        "attack success, screen off (the attack works)",
        lambda r: r["asr_screen_off"],
        ">=",
        0.5,
        "of completions",
    ),
    Goal("attack", "attack success, screen on", lambda r: r["asr_screen_on"], "<=", 0.05, "of completions"),
    Goal("attack", "honest samples kept by the screen", lambda r: r["honest_acceptance"], ">=", 0.95, "of samples"),
    Goal(
        "attack",
        "evasive tail: what lying log-probs buy",
        lambda r: r["evasive_tail"]["lie_buys_nats"],
        "<=",
        2.0,
        "nats",
    ),
    Goal(
        "attack",
        "5 clean Sybils' share of peer samples",
        lambda r: r["share_capture"]["honest_offers_8"]["sybil_share"],
        "<=",
        0.25,
        "",
    ),
    Goal("train", "round overhead / step time, LoRA", lambda r: r["round_overhead_vs_step"]["lora"], "<=", 0.10, ""),
    Goal("train", "round overhead / step time, full", lambda r: r["round_overhead_vs_step"]["full"], "<=", 0.10, ""),
    Goal(
        "engines",
        "vLLM / HF tokens/s, fixed length",
        lambda r: min(c["ratio"] for c in r["comparison"].values()) if r["comparison"] else r["no vLLM"],
        ">=",
        2.0,
        "x",
    ),
)


def evaluate_goals(benches: dict[str, dict[str, Any]], goals: Iterable[Goal] = GOALS) -> list[dict[str, Any]]:
    """One verdict per goal: the measured value and passed True/False, or None if not measured."""
    verdicts = []
    for g in goals:
        r = benches.get(g.bench)
        value: float | None = None
        if isinstance(r, dict) and "error" not in r:
            try:
                raw = g.value(r)
                value = float(raw) if raw is not None else None
            except (KeyError, TypeError, ZeroDivisionError):
                value = None  # e.g. a quick run without 8 peers
        if value is not None and not math.isfinite(value):
            value = None
        passed = None if value is None else (value <= g.target if g.op == "<=" else value >= g.target)
        verdicts.append(
            {
                "bench": g.bench,
                "figure": g.figure,
                "op": g.op,
                "target": g.target,
                "unit": g.unit,
                "value": value,
                "passed": passed,
            }
        )
    return verdicts


# --------------------------------------------------------------------------- running


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_specs(
    specs: Sequence[BenchSpec],
    *,
    quick: bool = False,
    command: str | None = None,
    progress: Callable[[str], None] | None = _stderr,
) -> dict[str, Any]:
    """Run `specs` in order; a failing one is recorded as {"error": ...} and the rest go on."""
    from node.bench.machine import describe_machine

    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark names must be unique, got {names}")
    say = progress or (lambda _line: None)
    benches: dict[str, dict[str, Any]] = {}
    elapsed: dict[str, float] = {}
    for i, spec in enumerate(specs, 1):
        say(f"[{i}/{len(specs)}] {spec.name} ...")
        start = time.perf_counter()
        try:
            benches[spec.name] = spec.run()
            outcome = "done"
        except Exception as exc:
            benches[spec.name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8),
            }
            outcome = f"FAILED ({type(exc).__name__}: {exc})"
        elapsed[spec.name] = round(time.perf_counter() - start, 2)
        say(f"[{i}/{len(specs)}] {spec.name} {outcome} in {elapsed[spec.name]:.1f} s")
    return {
        "command": command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "quick": quick,
        "machine": describe_machine(),
        "settings": {s.name: s.kwargs for s in specs},
        "elapsed_s": elapsed,
        "benchmarks": benches,
        "goals": evaluate_goals(benches),
    }


def _json_default(obj: Any) -> Any:
    # numpy scalars and arrays, Paths: the few non-JSON types benchmark dicts may carry.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to the benchmark JSON")


def write_report(result: dict[str, Any], out_json: Path | None, out_md: Path | None) -> None:
    """Write the JSON and/or the markdown of a `run_specs` result (parent folders created)."""
    if out_json is not None:
        out_json = Path(out_json)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
    if out_md is not None:
        out_md = Path(out_md)
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text(render_markdown(result))


def run_all(
    out_json: Path | None,
    out_md: Path | None,
    quick: bool = False,
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = _stderr,
    command: str | None = None,
) -> dict[str, Any]:
    """Run every benchmark (or those named in `only`), write both files, return the result.

    `command` is the command line recorded in the report (default: this process's argv).
    """
    specs = default_specs(quick)
    if only is not None:
        unknown = sorted(set(only) - set(BENCH_NAMES))
        if unknown:
            raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(BENCH_NAMES)}")
        specs = [s for s in specs if s.name in only]
    result = run_specs(specs, quick=quick, command=command, progress=progress)
    write_report(result, out_json, out_md)
    return result


# --------------------------------------------------------------------------- markdown


def _fmt(value: Any, spec: str | None = None) -> str:
    """A figure for a table: `spec` if given, else integers with thousands separators, floats to 3 digits."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if spec is None:
        spec = "," if isinstance(value, int) or float(value).is_integer() else ".3g"
    return format(value, spec)


def _get(r: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(r, dict) or key not in r:
            return None
        r = r[key]
    return r


def _verdict(passed: bool | None) -> str:
    return {True: "pass", False: "**FAIL**", None: "not measured"}[passed]


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines + [""]


def _with_unit(number: str, unit: str) -> str:
    return number + unit if unit == "x" else f"{number} {unit}"


def _goal_value(v: dict[str, Any]) -> str:
    if v["value"] is None:
        return "–"
    if v["unit"] == "":  # a relative overhead
        return f"{v['value']:+.1%}"
    return _with_unit(f"{v['value']:.3g}", v["unit"])


def _goal_target(v: dict[str, Any]) -> str:
    if v["unit"] == "":
        return f"{v['op']} {v['target']:+.0%}"
    return f"{v['op']} " + _with_unit(format(v["target"], "g"), v["unit"])


def _figures_table(rows: list[tuple[str, str]], goals: list[dict[str, Any]]) -> list[str]:
    """The bench's goals with their verdicts, then its other key figures, in one table."""
    body = [(v["figure"], _goal_value(v), _goal_target(v), _verdict(v["passed"])) for v in goals]
    body += [(name, value, "", "") for name, value in rows]
    return _table(("figure", "value", "goal", "pass/fail"), body)


def _protocol_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    mt = lambda k: f"{_fmt(_get(r, k) and _get(r, k) / 1e6, '.1f')} M tokens/s"  # noqa: E731
    return [
        ("packet", f"{_fmt(_get(r, 'tokens_per_packet'), ',')} tokens, {_fmt(_get(r, 'packet_bytes'), ',')} bytes"),
        ("paper format (int32 id + fp32 log-prob)", f"{_fmt(_get(r, 'paper_bytes_per_token'), '.2f')} B/token"),
        ("naive JSON", f"{_fmt(_get(r, 'json_bytes_per_token'), '.2f')} B/token"),
        ("ours + zstd (vocab 151,646)", f"{_fmt(_get(r, 'bytes_per_token_zstd'), '.3f')} B/token"),
        ("ours (vocab 49,152)", f"{_fmt(_get(r, 'bytes_per_token_vocab49k'), '.3f')} B/token"),
        ("ours + zstd (vocab 49,152)", f"{_fmt(_get(r, 'bytes_per_token_vocab49k_zstd'), '.3f')} B/token"),
        ("encode", mt("encode_tokens_per_s")),
        ("decode (validated)", mt("decode_tokens_per_s")),
        ("encode + zstd", mt("encode_tokens_per_s_zstd")),
        ("decode + zstd", mt("decode_tokens_per_s_zstd")),
        ("peek_header", f"{_fmt(_get(r, 'peek_header_us'), '.1f')} µs"),
        ("max abs log-prob error (fixed point over [-64, 0])", _fmt(_get(r, "max_abs_logprob_error"), ".2e")),
    ]


def _train_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    ms = lambda k: f"{_fmt(_get(r, k) and _get(r, k) * 1e3, '.1f')} ms"  # noqa: E731
    return [
        (
            "model",
            f"{_fmt(_get(r, 'model'))} ({_fmt(_get(r, 'n_params'), ',')} params), "
            f"LoRA r{_fmt(_get(r, 'lora_rank'))} ({_fmt(_get(r, 'lora_params'), ',')} trainable)",
        ),
        (
            "batch",
            f"{_fmt(_get(r, 'batch'))} sequences = {_fmt(_get(r, 'prompts'))} prompts x "
            f"{_fmt(_get(r, 'group_size'))}, {_fmt(_get(r, 'tokens_per_step'))} completion tokens/step, "
            f"{_fmt(_get(r, 'torch_threads'))} torch threads",
        ),
        ("F-TIS step (our Trainer)", ms("ftis_step_s")),
        ("NoIS step (same Trainer)", ms("nois_step_s")),
        ("plain GRPO step (same model + optimizer)", ms("grpo_step_s")),
        ("TRL GRPOTrainer step (no generation)", ms("trl_step_s")),
        ("F-TIS throughput", f"{_fmt(_get(r, 'ftis_tokens_per_s'), '.0f')} tokens/s"),
        ("F-TIS overhead vs plain GRPO, CPU time", _fmt(_get(r, "cpu_s", "loss_overhead_vs_grpo"), "+.1%")),
        ("F-TIS / TRL, CPU time", f"{_fmt(_get(r, 'cpu_s', 'ratio_vs_trl'), '.2f')}x"),
        ("loss alone, ftis_loss vs grpo_loss (fwd+bwd)", _fmt(_get(r, "loss_only", "overhead_vs_grpo"), "+.0%")),
        *[
            (
                f"round overhead, {mode} (step {_fmt(o['step_s'] * 1e3, '.0f')} ms)",
                f"{_fmt(o['round_overhead_s'] * 1e3, '.1f')} ms: checkpoint {_fmt(o['checkpoint_s'] * 1e3, '.0f')} ms "
                f"every {o['checkpoint_every']} rounds (+ {_fmt(o.get('checkpoint_write_s', 0) * 1e3, '.0f')} ms "
                f"written in the background), engine load {_fmt(o['engine_load_s'] * 1e3, '.1f')} ms, "
                f"status file {_fmt(o['status_file_s'] * 1e3, '.1f')} ms",
            )
            for mode, o in (_get(r, "round_overhead") or {}).items()
        ],
    ]


def _attack_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    s = r.get("settings", {})
    rows = [
        ("rounds per run (ASR over the last)", f"{_fmt(_get(r, 'rounds'))} ({_fmt(_get(r, 'last_rounds'))})"),
        (
            "honest nodes",
            ", ".join(s.get("honest", []))
            + f", {'LoRA' if s.get('train_mode') == 'lora' else 'full fine-tuning'} at lr {_fmt(s.get('lr'), 'g')}",
        ),
        ("phrase injected after correct answers", f"`{s.get('phrase')}`"),
        (
            "attacker's declared temperature / claimed log-prob",
            f"{s.get('attacker_temperature')} / {s.get('attacker_claim')}",
        ),
        (
            "attacker samples screened / used (screen on)",
            f"{_fmt(_get(r, 'screen_on', 'attacker_screened'))} / {_fmt(_get(r, 'screen_on', 'attacker_used'))}",
        ),
        (
            "attacker quarantined by every honest node at round",
            _fmt(_get(r, "screen_on", "attacker_quarantined_by_all_at")),
        ),
        ("heterogeneous swarm: honest samples kept", _fmt(_get(r, "heterogeneous", "acceptance"), ".3f")),
        ("judge: ms per completion", _fmt(_get(r, "judge", "ms_per_completion"), ".1f")),
        (
            "judge: poisoned / honest flagged",
            f"{_fmt(_get(r, 'judge', 'flagged_poisoned'), '.2f')} / {_fmt(_get(r, 'judge', 'flagged_honest'), '.2f')}",
        ),
        ("time", f"{_fmt(_get(r, 'seconds'), '.0f')} s"),
    ]
    return rows


def _gather_section(r: dict[str, Any], goals: list[dict[str, Any]]) -> list[str]:
    rows = []
    for n, s in (_get(r, "by_size") or {}).items():
        rows.append(
            (
                n,
                _fmt(s.get("gather_s_median"), ".3f"),
                _fmt(s.get("gather_s_p90"), ".3f"),
                _fmt(s.get("gather_all_at_once_s_median"), ".3f"),
                _fmt(s.get("bytes_read_per_node") and s["bytes_read_per_node"] // 1024, ","),
                _fmt(s.get("peers_seen")),
                _fmt(s.get("memory_per_peer_mib"), ".0f"),
                f"{_fmt(s.get('incomplete_gathers'))}/{_fmt(s.get('gathers'))}",
            )
        )
    lines = [
        f"{_fmt(_get(r, 'rounds'))} rounds per swarm size, k = {_fmt(_get(r, 'max_peers_per_round'))}; each node "
        "is a real hivemind DHT with its own p2pd on 127.0.0.1. Median: one node gathering at a time; "
        "all at once: every node together on this machine's cores.",
        "",
    ]
    header = ("nodes", "gather median (s)", "p90 (s)", "all at once (s)", "KiB read", "peers", "MiB/peer", "incomplete")
    lines += _table(header, rows)
    return lines + _figures_table([], goals)


def _engines_section(r: dict[str, Any]) -> list[str]:
    s = r.get("settings", {})
    lines = [
        f"{_fmt(s.get('prompts'))} prompts x n={_fmt(s.get('n'))}, exactly {_fmt(s.get('max_tokens'))} new "
        f"tokens (EOS ignored), temperature {_fmt(s.get('temperature'), 'g')}, {_fmt(s.get('torch_threads'))} torch "
        f"threads, LoRA r{_fmt(s.get('lora_rank'))}.",
        "",
    ]
    rows = []
    others = []
    for engine, per_model in r.items():
        # Engines map model -> figures (or a string: why the engine did not run); the rest is summary.
        summary = engine in ("settings", "cpu_count", "comparison", "cpu", "note") or engine.startswith("raw_")
        if summary or not isinstance(per_model, (dict, str)):
            continue
        if isinstance(per_model, str):
            others.append(f"- `{engine}`: {per_model}")
            continue
        for model, m in per_model.items():
            if "error" in m:
                rows.append((engine, model, f"error: {m['error']}", *[""] * 7))
                continue
            rows.append(
                (
                    engine,
                    model,
                    _fmt(m.get("n_params"), ","),
                    _fmt(m.get("load_s"), ".2f"),
                    _fmt(m.get("tokens_per_s"), ".0f"),
                    _fmt(m.get("tokens_per_s_lora"), ".0f"),
                    _fmt(m.get("mean_completion_tokens"), ".1f"),
                    f"{_fmt(m.get('adapter_first_load_s') and m['adapter_first_load_s'] * 1e3, '.1f')} / "
                    f"{_fmt(m.get('adapter_reload_s') and m['adapter_reload_s'] * 1e3, '.1f')}",
                    f"{_fmt(m.get('logprob_max_abs_diff'), '.1e')} / {_fmt(m.get('logprob_max_abs_diff_lora'), '.1e')}",
                    _fmt(m.get("adapter_shift_mean_abs"), ".3f"),
                )
            )
    header = (
        "engine",
        "model",
        "params",
        "load (s)",
        "tokens/s",
        "tokens/s + LoRA",
        "mean length",
        "adapter load / reload (ms)",
        "max abs Δ logp, base / LoRA",
        "adapter shift",
    )
    lines += _table(header, rows)
    lines += others + ([""] if others else [])
    for model, c in (r.get("comparison") or {}).items():
        lines.append(
            f"- vLLM / HF on {model}, loaded together, calls interleaved: {_fmt(c.get('vllm_tokens_per_s'), '.0f')} / "
            f"{_fmt(c.get('hf_tokens_per_s'), '.0f')} tokens/s = {_fmt(c.get('ratio'), '.2f')}x; bare "
            f"`vllm.LLM.generate` {_fmt(c.get('vllm_bare_tokens_per_s'), '.0f')} tokens/s"
        )
    lines += [
        "Tokens/s: completion tokens per second, every completion the same fixed length. Δ logp: the "
        "log-prob the engine recorded minus the trainer's recompute (`sequence_logprobs`, an independently "
        "loaded copy of the model). Adapter shift: the mean log-prob change the adapter causes; it must be "
        "far above Δ logp, or the engine ignored the adapter.",
        "",
    ]
    return lines


def _fuzz_section(r: dict[str, Any], goals: list[dict[str, Any]]) -> list[str]:
    ms = lambda v: f"{_fmt(v and v * 1e3, '.2f')} ms"  # noqa: E731
    rows = [
        ("cases admitted with some groups", _fmt(_get(r, "admitted_cases"))),
        (
            "decoder accepted invalid / rejected valid (vs the reference reader)",
            f"{_fmt(_get(r, 'decoder_accepted_invalid'))} / {_fmt(_get(r, 'decoder_rejected_valid'))}",
        ),
        ("worst decode, fuzz cases", f"{ms(_get(r, 'worst_decode_s'))} ({_fmt(_get(r, 'worst_decode_case'))})"),
        (
            "worst decode memory, fuzz cases",
            f"{_fmt(_get(r, 'worst_decode_mib'), '.2f')} MiB ({_fmt(_get(r, 'worst_decode_mib_case'))})",
        ),
        ("unsafe, by rule", ", ".join(f"{k} {v}" for k, v in sorted((_get(r, "unsafe_rules") or {}).items())) or "–"),
    ]
    lines = [
        f"{_fmt(_get(r, 'cases'))} random and mutated packets, then {_fmt(_get(r, 'hostile_cases'))} known hostile "
        "ones, through `decode` and a real `Admission` (toy task, tiny-s); see node/bench/fuzz.py for each figure.",
        "",
        *_figures_table(rows, goals),
    ]
    hostile = [
        (
            name,
            _fmt(h.get("bytes"), ","),
            h.get("outcome"),
            ms(h.get("decode_s")),
            f"{_fmt(h.get('decode_mib'), '.2f')} MiB",
            ms(h.get("admit_s")),
        )
        for name, h in (_get(r, "hostile") or {}).items()
    ]
    return lines + _table(("hostile packet", "bytes", "outcome", "decode", "decode memory", "admit"), hostile)


def render_markdown(result: dict[str, Any]) -> str:
    """The readable report of a `run_specs` result."""
    m = result["machine"]
    benches = result["benchmarks"]
    goals = result.get("goals") or evaluate_goals(benches)
    by_bench: dict[str, list[dict[str, Any]]] = {}
    for v in goals:
        by_bench.setdefault(v["bench"], []).append(v)

    mem = m.get("memory", {})
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in m.get("gpus", [])) or "none"
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v)
    regenerate = REGENERATE + (" --quick" if result.get("quick") else "")
    lines = [
        "# Benchmarks",
        "",
        f"Measured {m.get('date_utc')} by `{result.get('command')}`"
        + (" (quick mode: smallest sizes, single repeats; not representative)" if result.get("quick") else "")
        + ".",
        "",
        "Each figure is a median over repeats (one warm-up first, not counted), and every comparison "
        "(ours vs the paper's format, F-TIS vs GRPO vs TRL, an engine with and without an adapter) is a ratio of "
        "figures measured side by side in the same run, on the same machine, with the same inputs. Wall times "
        "include whatever else the machine was running; where a benchmark also reports CPU time, that is the "
        "load-robust cross-check.",
        "",
        "Regenerate it with:",
        "",
        "```",
        regenerate,
        "```",
        "",
        "## Machine",
        "",
        *_table(
            ("", ""),
            [
                ("CPU", f"{m.get('cpu_model')} ({', '.join(m.get('cpu_isa') or []) or 'no AVX'})"),
                ("cores", f"{m.get('cores_usable')} usable of {m.get('cores_logical')}"),
                ("memory", f"{mem.get('total_gib')} GiB ({mem.get('available_gib')} GiB available at start)"),
                ("GPU", gpus),
                ("OS", f"{m.get('os')} {m.get('machine')}"),
                ("Python", m.get("python")),
                ("libraries", versions),
                ("torch threads (default)", m.get("torch_threads")),
            ],
        ),
        "## Goals",
        "",
        *_table(
            ("benchmark", "figure", "value", "goal", "pass/fail"),
            [(v["bench"], v["figure"], _goal_value(v), _goal_target(v), _verdict(v["passed"])) for v in goals],
        ),
    ]
    titles = {
        "protocol": "Wire protocol",
        "train": "Training step",
        "gather": "Gather latency",
        "engines": "Rollout engines",
        "fuzz": "Fuzzing decode and admission",
        "attack": "Poisoning attack (HTTT)",
    }
    for name, r in benches.items():
        took = _get(result, "elapsed_s", name)
        lines += [f"## {titles.get(name, name)} (`{name}`, {_fmt(took, '.0f')} s)", ""]
        settings = _get(result, "settings", name)
        if settings:
            lines += ["Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()), ""]
        if r.get("note"):  # how and when a benchmark was run, where not by this command
            lines += [r["note"], ""]
        if "error" in r:
            lines += ["This benchmark failed:", "", "```", r["error"], "```", ""]
            continue
        g = by_bench.get(name, [])
        if name == "protocol":
            lines += _figures_table(_protocol_rows(r), g)
        elif name == "train":
            lines += _figures_table(_train_rows(r), g)
        elif name == "gather":
            lines += _gather_section(r, g)
        elif name == "engines":
            lines += _engines_section(r)
        elif name == "fuzz":
            lines += _fuzz_section(r, g)
        elif name == "attack":
            lines += _figures_table(_attack_rows(r), g)
        else:
            lines += ["```json", json.dumps(r, indent=2, default=_json_default), "```", ""]
    lines += _separate_benches()
    return "\n".join(lines).rstrip() + "\n"


# Benches that `bench all` does not run (too long, or root), each with a page of its own.
SEPARATE_BENCHES = (
    ("memory", "memory.md", "peak memory per phase, the estimate's error, the leak check"),
    ("wan", "network.md", "a swarm over an emulated WAN (root)"),
    ("learn", "learning-smollm2.json", "a solo SmolLM2 node's held-out reward"),
    ("swarm-gain", "swarm-gain.md", "a swarm against isolation at equal generation"),
)


def _separate_benches() -> list[str]:
    """The closing section: where the benches run on their own keep their figures."""
    lines = [
        "## Benches run on their own",
        "",
        "These take too long or need root, so `bench all` does not run them; each writes its own page.",
        "",
    ]
    return lines + _table(
        ["bench", "page"],
        [(f"`ftis-node bench {name}`", f"[{page}]({page}): {what}") for name, page, what in SEPARATE_BENCHES],
    )


def format_suite(result: dict[str, Any]) -> str:
    """Plain text for a terminal: each benchmark's own table, then the goal verdicts."""
    formatters = {
        "protocol": ("node.bench.protocol", "format_protocol_bench"),
        "train": ("node.bench.train", "format_train_bench"),
        "engines": ("node.bench.engines", "format_engine_bench"),
        "gather": ("node.bench.gather", "format_gather_bench"),
        "fuzz": ("node.bench.fuzz", "format_fuzz_bench"),
        "attack": ("node.bench.attack", "format_attack_bench"),
    }
    parts = []
    for name, r in result["benchmarks"].items():
        if "error" in r:
            parts.append(f"{name}: FAILED: {r['error']}")
        elif name in formatters:
            module, fn = formatters[name]
            parts.append(getattr(importlib.import_module(module), fn)(r))
        else:
            parts.append(json.dumps(r, indent=2, default=_json_default))
    width = max(len(v["figure"]) for v in result["goals"]) if result["goals"] else 0
    verdicts = [
        f"  {v['bench']:<9}{v['figure']:<{width}}  {_goal_value(v):>14}  {_goal_target(v):<14} "
        f"{_verdict(v['passed']).strip('*')}"
        for v in result["goals"]
    ]
    return "\n\n".join([*parts, "Goals:\n" + "\n".join(verdicts)])
