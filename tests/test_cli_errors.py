"""Every mistake a user can make ends with one `error:` line and exit code 2, fast.

The settings cases run in process (typer's runner, `--dry-run`, so nothing starts); the
machine cases (ports, folders, network) run the real `ftis-node` in a fresh process, as a
user would, and bound its time loosely: at most 10 s more than a process that only loads
its settings, run at the same time (so a busy machine slows both alike).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner

from node.config import SOURCES, NodeConfig
from node.console.cli import app
from tests.procs import free_port as _free_port

# One bad value for every setting that has a bound or a list of choices (its own or its owner's).
BAD_VALUES = {
    "name": "",
    "engine": "tpu",
    "train_mode": "half",
    "lora_rank": "0",
    "lr": "0",
    "threads": "-1",
    "dtype": "float8",
    "micro_batch_tokens": "0",
    "generate_batch": "0",
    "rounds": "0",
    "round_seconds": "0",
    "prompts_per_round": "257",
    "group_size": "1",
    "max_tokens": "40000",
    "temperature": "0",
    "top_p": "1.5",
    "top_k": "-1",
    "loss": "ppo",
    "is_cap": "0.5",
    "kl_threshold": "-1",
    "kl_reduction": "max",
    "peer_share": "1.5",
    "peer_mix": "swap",
    "seed": "-1",
    "cross_tokenizer": "keep",
    "swarm_id": "Not An Id",
    "port": "70000",
    "startup_timeout": "0",
    "swarm_wait": "0",
    "gather_seconds": "-1",
    "expect_peers": "-1",
    "max_peers_per_round": "0",
    "shards": "3",
    "max_packet_bytes": "0",
    "screen_logprob_floor": "1",
    "screen_top_k": "-1",
    "screen_max_run": "0",
    "screen_max_flagged": "2",
    "claim_margin": "-1",
    "judge_threshold": "1",
    "probation_rounds": "-1",
    "trust_groups": "-1",
    "probation_share": "1.5",
    "quarantine_fraction": "2",
    "quarantine_after": "0",
    "quarantine_rounds": "0",
    "checkpoint_every": "0",
    "api_port": "65536",
}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error:" in line]


def _constrained_fields() -> set[str]:
    """Fields with a bound or choices here, or a bound in the config that owns them."""
    import importlib
    import typing

    def bounded(field) -> bool:
        return any(type(m).__module__ == "annotated_types" for m in field.metadata)

    out = set()
    for name, field in NodeConfig.model_fields.items():
        literal = any(
            typing.get_origin(a) is typing.Literal for a in (field.annotation, *typing.get_args(field.annotation))
        )
        owner_bounded = False
        if name in SOURCES:
            module, cls, sub = SOURCES[name]
            owner_field = getattr(importlib.import_module(module), cls).model_fields[sub]
            owner_bounded = bounded(owner_field) or typing.get_origin(owner_field.annotation) is typing.Literal
        if bounded(field) or literal or owner_bounded or name == "swarm_id":
            out.add(name)
    return out


def test_the_table_covers_every_constrained_setting():
    missing = _constrained_fields() - set(BAD_VALUES)
    assert not missing, f"add a bad value for {sorted(missing)}"


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
def test_each_constrained_flag_refuses_a_bad_value_by_name(field):
    result = CliRunner().invoke(app, ["join", "--dry-run", _flag(field), BAD_VALUES[field]])
    assert result.exit_code == 2, result.output
    lines = _error_lines(result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert _flag(field) in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_env_and_yaml_values_are_named_as_the_user_wrote_them(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["join", "--dry-run"], env={"FTIS_ROUND_SECONDS": "abc"})
    assert result.exit_code == 2
    assert _error_lines(result.output) == [_error_lines(result.output)[0]]
    assert "FTIS_ROUND_SECONDS=abc" in result.output and "--round-seconds" not in result.output
    node_yaml = tmp_path / "node.yaml"
    node_yaml.write_text("is_cap: 0.5\n")
    result = runner.invoke(app, ["join", "--dry-run", "--config", str(node_yaml)])
    assert result.exit_code == 2 and f"is_cap: 0.5 (in {node_yaml})" in result.output, result.output
    node_yaml.write_text("modle: tiny-m\n")
    result = runner.invoke(app, ["join", "--dry-run", "--config", str(node_yaml)])
    assert result.exit_code == 2 and "did you mean model?" in result.output, result.output
    node_yaml.write_text("model: [unclosed\n")
    result = runner.invoke(app, ["join", "--dry-run", "--config", str(node_yaml)])
    assert result.exit_code == 2 and "not readable YAML" in result.output, result.output
    # a list from the environment: comma-separated, no JSON needed
    result = runner.invoke(app, ["join", "--dry-run"], env={"FTIS_SWARM": "http://127.0.0.1:1, http://127.0.0.1:2"})
    assert result.exit_code == 0 and '"http://127.0.0.1:2"' in result.output, result.output


def test_usage_errors_are_one_line_too():
    result = CliRunner().invoke(app, ["join", "--no-such-flag"])
    assert result.exit_code == 2 and _error_lines(result.output) and "Traceback" not in result.output
    assert "ftis-node join --help" in _error_lines(result.output)[0]


# ---------------------------------------------------------------- through the real CLI


def _cli(
    args: list[str], env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess, float]:
    env = (os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}) | (env or {})
    env = {k: v for k, v in env.items() if v is not None}
    start = time.monotonic()
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "node.console.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )
    return done, time.monotonic() - start


@pytest.mark.timeout(600)
def test_machine_mistakes_fail_fast_with_one_error_line(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    taken = listener.getsockname()[1]
    a_file = tmp_path / "plain-file"
    a_file.write_text("not a folder")
    common = ["--host", "127.0.0.1", "--port", "0", "--api-port", "0", "--model", "tiny-s"]
    cases = {
        "api port in use": (["join", *common, "--api-port", str(taken), "--data-dir", str(tmp_path / "a")], {}),
        "dht port in use": (["join", *common, "--port", str(taken), "--data-dir", str(tmp_path / "b")], {}),
        "data dir under a file": (["train", "--rounds", "1", "--data-dir", str(a_file / "node")], {}),
        "data dir not writable": (["train", "--rounds", "1", "--data-dir", "/proc/ftis-node-test"], {}),
        "status url unreachable": (
            # a short --swarm-wait: the default (120 s) waits for a peer that is still starting
            ["join", *common, "--data-dir", str(tmp_path / "c"), "--swarm", f"http://127.0.0.1:{_free_port()}"]
            + ["--swarm-wait", "3"],
            {},
        ),
        "hub unreachable": (
            ["join", *common, "--model", "qwen2.5-1.5b", "--data-dir", str(tmp_path / "d")],
            {
                "HF_HUB_OFFLINE": None,
                "HF_ENDPOINT": f"http://127.0.0.1:{_free_port()}",
                "HF_HOME": str(tmp_path / "hf-home"),
            },
        ),
        "bad env value": (["join", "--data-dir", str(tmp_path / "e")], {"FTIS_ROUND_SECONDS": "abc"}),
    }
    expected = {
        "api port in use": f"--api-port {taken}",
        "dht port in use": f"--port {taken}",
        "data dir under a file": "not a folder",
        "data dir not writable": "cannot write there",
        "status url unreachable": "--swarm-wait",
        "hub unreachable": "local model folder",
        "bad env value": "FTIS_ROUND_SECONDS=abc",
    }
    # Each case runs beside a process that does the work every failure must do anyway (start
    # Python, load the settings: torch and hivemind), so both see the same machine load.
    baseline_args = ["join", "--dry-run", "--data-dir", str(tmp_path / "x")]
    results, baselines = {}, {}
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            for name, (args, env) in cases.items():
                case, base = pool.submit(_cli, args, env), pool.submit(_cli, baseline_args)
                results[name], baselines[name] = case.result(), base.result()[1]
    finally:
        listener.close()
    for name, (done, seconds) in results.items():
        baseline = baselines[name]
        lines = _error_lines(done.stderr)
        assert done.returncode == 2, (name, done.returncode, done.stderr[-2000:])
        assert len(lines) == 1 and done.stderr.strip().splitlines()[-1] == lines[0], (name, done.stderr[-2000:])
        assert expected[name] in lines[0], (name, lines[0])
        assert "Traceback" not in done.stderr, (name, done.stderr[-2000:])
        assert seconds < 10 + 1.5 * baseline, (name, seconds, baseline)


def test_a_read_only_mount_as_data_dir_is_one_error_line(tmp_path):
    """A real read-only file system (a tmpfs mounted ro in a user and mount namespace of our
    own): permission bits cannot stand in for it, since the tests run as root."""
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("this machine allows no user namespaces (unshare --user fails)")
    mount = tmp_path / "ro"
    mount.mkdir()
    in_read_only_mount = (
        "unshare", "--user", "--map-root-user", "--mount",
        "sh", "-c", f'mount -t tmpfs -o ro ftis-ro "{mount}" && exec "$@"', "sh",
    )  # fmt: skip
    done, _ = _cli(["train", "--rounds", "1", "--data-dir", str(mount / "node")], prefix=in_read_only_mount)
    lines = _error_lines(done.stderr)
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "cannot write there (Read-only file system)" in lines[0] and "--data-dir" in lines[0]


def test_help_and_version(tmp_path):
    runner = CliRunner()
    for flags in (["--version"], ["-V"]):
        assert runner.invoke(app, flags).output.startswith("ftis-node ")
    # -h: the common settings, on two screens at 80 columns, nothing cut short; --help-all: all of them
    short = runner.invoke(app, ["join", "-h"], env={"COLUMNS": "80"})
    assert short.exit_code == 0 and "--swarm" in short.output and "--help-all" in short.output
    assert len(short.output.splitlines()) <= 70 and "…" not in short.output, short.output
    assert "--screen-logprob-floor" not in short.output
    every = runner.invoke(app, ["join", "--help-all"], env={"COLUMNS": "80"})
    assert every.exit_code == 0 and "--screen-logprob-floor" in every.output and "…" not in every.output
    assert max(map(len, every.output.splitlines())) <= 80, every.output  # wrapped, every word whole
    text = " ".join(every.output.split())
    for expected in (
        "Learning rate. (env FTIS_LR, yaml lr) [default: 1e-6 full, 2e-4 LoRA]",
        "[default: 2.0]",
        "[lora|full]",
        "[sum|mean]",
        "One of: f-tis, tis, vis, nois, f-nois, f-vis, alone.",
        "status URL of any running node",
        "FTIS_ROUND_SECONDS",
    ):
        assert expected in text, expected
    # every setting's help names its default (or says how it is chosen)
    from typer.main import get_command

    join = get_command(app).commands["join"]
    settings = [p for p in join.params if p.name in NodeConfig.model_fields]
    assert len(settings) == len(NodeConfig.model_fields)
    for param in settings:
        assert "[default:" in param.help, param.name
    for command in ("train", "demo", "export", "experiment"):
        assert runner.invoke(app, [command, "-h"]).exit_code == 0, command


def _commands(group, path=()):
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_every_option_of_every_command_shows_its_default():
    """No help text lost to rich markup ("Folder ." was "Folder [default: x]."), and an option
    whose typer default is None names the default it ends up with."""
    import click
    from typer.main import get_command

    from node.experiment.runner import ExperimentConfig

    runner = CliRunner()
    for path, command in _commands(get_command(app)):
        flag = "--help-all" if any(getattr(p, "name", None) == "help_all" for p in command.params) else "-h"
        text = " ".join(runner.invoke(app, [*path, flag], env={"COLUMNS": "240"}).output.split())
        assert not re.search(r"\w \.(?!\.)", text), (path, text)
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help" or param.required:
                continue
            shown = param.show_default is not False and param.default not in (None, [], ())
            assert shown or "[default:" in (param.help or ""), (path, param.name)
    experiment = dict(_commands(get_command(app)))[("experiment",)]
    for param in experiment.params:  # the defaults it names are the ones it runs with
        field = ExperimentConfig.model_fields.get(param.name)
        if field is not None and isinstance(field.default, (int, float)) and not isinstance(field.default, bool):
            assert f"[default: {field.default:g}]" in param.help, param.name


def test_hub_alias_loads_fast_when_the_hub_is_down(monkeypatch, tmp_path):
    from node.models import ModelLoadError
    from node.models.hub import hub_load_options

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="does not answer"):
        hub_load_options("Qwen/Qwen2.5-1.5B")
    assert time.monotonic() - start < 10
    # a model already in the local cache is used offline instead
    snapshot = tmp_path / "models--Qwen--Qwen2.5-1.5B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--Qwen--Qwen2.5-1.5B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen2.5-1.5B" / "refs" / "main").write_text("abc")
    assert hub_load_options("Qwen/Qwen2.5-1.5B") == {"local_files_only": True}


def test_a_path_that_exists_is_not_taken_for_a_hub_id(tmp_path: Path):
    from node.console.progress import join_model

    assert join_model("qwen2.5-1.5b") == "qwen2.5-1.5b"
    assert join_model(str(tmp_path)) == "tiny-s"


def test_the_printed_join_line_runs_as_typed_with_this_nodes_task():
    """The task is named (an instruct model's own default task is another) and quoted: a
    gym spec holds '?' and '&', which a shell would otherwise take."""
    import shlex

    from node.console.progress import join_line

    line = join_line("tiny-s", "gym:chain_sum?max_terms=2&max_digits=1", "http://127.0.0.1:8470")
    assert "'gym:chain_sum?max_terms=2&max_digits=1'" in line
    args = shlex.split(line)
    assert args[:2] == ["ftis-node", "join"]
    result = CliRunner().invoke(app, [*args[1:], "--dry-run"])
    assert result.exit_code == 0, result.output
    resolved = json.loads(result.output)
    assert (resolved["model"], resolved["task"], resolved["swarm"]) == (
        "tiny-s",
        "gym:chain_sum?max_terms=2&max_digits=1",
        ["http://127.0.0.1:8470"],
    )


@pytest.mark.parametrize(
    ("flag", "typo", "suggestion"),
    [
        ("--model", "qwen2.5-1.5b-instrct", "qwen2.5-1.5b-instruct"),
        ("--model", "tiny-s:ad", "add"),
        ("--task", "gim:chain_sum", "gym"),
        ("--task", "gym:chainsum", "chain_sum"),
    ],
)
def test_a_mistyped_model_or_task_gets_the_close_name(tmp_path, flag, typo, suggestion):
    result = CliRunner().invoke(app, ["train", flag, typo, "--rounds", "1", "--data-dir", str(tmp_path / "n")])
    assert result.exit_code == 2, result.output
    assert len(_error_lines(result.output)) == 1, result.output
    assert f"Did you mean {suggestion}?" in result.output, result.output
