"""Checks a node runs before it starts anything, so a user's mistake costs seconds, not a round.

Each check raises `PreflightError` with one line that says what is wrong and what to type
instead; the CLI prints it as `error: ...` and exits with code 2. Nothing here starts a
DHT, loads weights or binds a port for longer than the check takes.
"""

from __future__ import annotations

import errno
import socket
import sys
import uuid
from pathlib import Path

from node.config import NodeConfig, flag_name

__all__ = ["PreflightError", "check_data_dir", "check_model", "check_port", "resolve_swarm"]


class PreflightError(RuntimeError):
    """A setting that cannot work on this machine, with the fix in the message."""


def check_data_dir(folder: Path) -> None:
    """The data folder exists (or can be made) and takes a file."""
    probe = folder / f".write-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        if isinstance(err, (NotADirectoryError, FileExistsError)) or err.errno in (errno.ENOTDIR, errno.EEXIST):
            reason = "a file is in the way: part of that path is not a folder"
        raise PreflightError(
            f"--data-dir {folder}: cannot write there ({reason}); pass --data-dir with a folder you can write"
        ) from None


def check_port(host: str, port: int, what: str, flag: str) -> None:
    """Nothing listens on host:port (port 0 always works)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the real listeners do: a port in TIME_WAIT is free, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise PreflightError(
                    f"{flag} {port}: the {what} port {host}:{port} is in use (another node, or an old one still "
                    f"running?); pass {flag} 0 for any free port, or another port"
                ) from None
            raise PreflightError(f"{flag} {port}: cannot listen on {host}:{port} ({err.strerror})") from None


def resolve_swarm(cfg: NodeConfig) -> list[str]:
    """`--swarm` entries as multiaddrs; status URLs are asked for at most `--swarm-wait` seconds."""
    from node.swarm.errors import SwarmStartError
    from node.swarm.join import resolve_initial_peers

    try:
        return resolve_initial_peers(cfg.swarm, timeout=cfg.swarm_wait, on_wait=_say)
    except SwarmStartError as err:
        message = str(err)
        if "within" in message:  # a status URL that did not answer in time
            message += f"; if that node is still starting, pass {flag_name('swarm_wait')} {2 * cfg.swarm_wait:g}"
        raise PreflightError(message) from None


def _say(line: str) -> None:
    """A joiner that waits says what for (stderr: stdout may be a pipe someone parses)."""
    print(line, file=sys.stderr, flush=True)


def check_model(cfg: NodeConfig) -> None:
    """The model name resolves, and a Hub model can be had now (fails in seconds when it cannot)."""
    from node.models import resolve_model
    from node.models.hub import hub_load_options

    spec = resolve_model(cfg.model)  # ModelLoadError: unknown alias, bad folder
    if spec.kind == "hub" and spec.hf_id is not None:
        hub_load_options(spec.hf_id)


def check_all(cfg: NodeConfig, *, use_swarm: bool) -> NodeConfig:
    """Every check, cheapest first; returns the settings with `--swarm` resolved to multiaddrs."""
    from node.models import ModelLoadError
    from node.tasks import get_task, with_rewards

    check_data_dir(cfg.node_dir)
    if cfg.api_port is not None:
        check_port(cfg.api_host, cfg.api_port, "status API", flag_name("api_port"))
    if use_swarm:
        check_port(cfg.host, cfg.port, "DHT", flag_name("port"))
    try:
        if cfg.task is not None:  # else the model's default task, one of two known-good specs
            get_task(cfg.task)
        check_model(cfg)
    except ModelLoadError as err:
        raise PreflightError(str(err)) from None
    except ValueError as err:  # TaskError and friends
        raise PreflightError(f"{flag_name('task')} {cfg.task}: {err}") from None
    try:  # the functions import and are callable, before the swarm starts (the messages name the flag)
        with_rewards(get_task("toy"), cfg.reward, cfg.reward_weights)
    except ValueError as err:
        raise PreflightError(str(err)) from None
    if use_swarm and cfg.swarm:
        return cfg.model_copy(update={"swarm": resolve_swarm(cfg)})
    return cfg


def model_shape(cfg: NodeConfig, *, build: bool = True):
    """The model's `ModelShape` from its config.json, or None when that cannot be read now
    (a Hub model not in the local cache, a model type without the usual sizes; with
    `build=False`, a project model not built yet)."""
    from node.memory import ModelShape
    from node.models import model_folder, models_dir, resolve_model

    try:
        spec = resolve_model(cfg.model)
        if not build and spec.kind in ("tiny", "embedded") and not any(models_dir().glob(f"{spec.name}-*")):
            return None
        if spec.kind == "hub" and spec.hf_id is not None:
            from transformers import AutoConfig

            from node.models.hub import hub_load_options

            return ModelShape.from_config(AutoConfig.from_pretrained(spec.hf_id, **hub_load_options(spec.hf_id)))
        return ModelShape.from_folder(model_folder(spec))
    except Exception:  # no estimate is better than a node that will not start over one
        return None


def check_memory(cfg: NodeConfig, *, build: bool = True):
    """(settings with --micro-batch-tokens decided, the memory plan or None): the largest
    micro-batch that fits the free memory when none was given; PreflightError when the
    model does not fit at all. `build`: as for `model_shape`."""
    from node.memory import MICRO_BATCH_CHOICES, gb, plan

    shape = model_shape(cfg, build=build)
    if shape is None:
        return cfg, None
    memory = plan(cfg, shape)
    if not memory.fits:
        smaller = [t for t in MICRO_BATCH_CHOICES if t < memory.micro_batch_tokens]
        hint = (
            f"try {flag_name('micro_batch_tokens')} {smaller[0]} or a smaller model"
            if smaller
            else "try a smaller model"
        )
        if cfg.train_mode == "full":
            hint += f" ({flag_name('train_mode')} lora, {flag_name('gradient_checkpointing')})"
        raise PreflightError(
            f"{cfg.model} needs about {gb(memory.needed)}, {gb(memory.free)} free "
            f"(micro-batch {memory.micro_batch_tokens} tokens); {hint}"
        )
    return cfg.model_copy(update={"micro_batch_tokens": memory.micro_batch_tokens}), memory
