"""Settings come from flags > environment > YAML > defaults, with readable errors."""

import inspect

import pytest
from typer.testing import CliRunner

from node.config import NodeConfig
from node.console.cli import app


def test_precedence_flags_env_yaml(tmp_path, monkeypatch):
    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text("model: tiny-m\nrounds: 3\nseed: 4\n")
    monkeypatch.setenv("FTIS_ROUNDS", "5")
    cfg = NodeConfig.load(yaml_file, seed=None, name="a")
    assert (cfg.model, cfg.rounds, cfg.seed, cfg.name) == ("tiny-m", 5, 4, "a")
    assert NodeConfig.load(yaml_file, rounds=9).rounds == 9


def test_bad_values_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="--loss bogus: use one of f-tis"):
        NodeConfig.load(loss="bogus")
    with pytest.raises(ValueError, match="missing.yaml: file not found"):
        NodeConfig.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("modle: tiny-s\n")
    with pytest.raises(ValueError, match="modle"):
        NodeConfig.load(tmp_path / "bad.yaml")


def test_cli_version_and_help_list_only_real_commands():
    runner = CliRunner()
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and result.output.startswith("ftis-node ")
    help_text = runner.invoke(app, ["--help"]).output
    for command in ("version", "bench", "join", "train", "demo", "models"):
        assert command in help_text
    assert "qwen2.5-1.5b" in runner.invoke(app, ["models"]).output


def test_defaults_agree_with_the_modules_that_own_them():
    """NodeConfig writes its defaults out (so `--help` needs no torch); they must be the owners'."""
    import importlib

    from node.config import LOSS_CHOICES, PLAIN_DEFAULTS, SOURCES
    from node.swarm.dht import DEFAULT_PORT
    from node.train.ftis import VARIANTS

    computed_by_owner = {"kl_threshold", "lr", "max_tokens", "temperature", "loss", "seed"}
    for field, (module, cls, sub) in SOURCES.items():
        owner = getattr(importlib.import_module(module), cls).model_fields[sub]
        if field not in computed_by_owner:
            assert NodeConfig.model_fields[field].default == owner.default, (field, cls, sub)
    assert NodeConfig.model_fields["port"].default == DEFAULT_PORT
    assert set(LOSS_CHOICES) == {*VARIANTS, "alone"}
    from node.experiment.report import VARIANT_COLORS

    assert set(VARIANT_COLORS) == set(LOSS_CHOICES)  # every variant drawn in its own fixed colour
    from node.rollout.base import Sampling

    assert (PLAIN_DEFAULTS.max_tokens, PLAIN_DEFAULTS.temperature) == (
        Sampling.model_fields["max_tokens"].default,
        Sampling.model_fields["temperature"].default,
    )
    from node.defence.admission import Admission
    from node.experiment.exchange import InProcessExchange
    from node.swarm.dht import SwarmConfig
    from protocol.keys import STALE_ROUNDS

    # One window of rounds read back: the swarm's gather, the experiment's exchange, admission.
    stale_defaults = {
        SwarmConfig.model_fields["stale_rounds"].default,
        inspect.signature(InProcessExchange.gather).parameters["stale_rounds"].default,
        inspect.signature(Admission).parameters["stale_rounds"].default,
    }
    assert stale_defaults == {STALE_ROUNDS}
    cfg = NodeConfig()
    assert cfg.loss_config().kl_threshold == 50.0 and cfg.trainer_config().learning_rate == 2e-4


def test_is_cap_below_one_is_refused_by_the_settings_check():
    """LossConfig's bound (C >= 1) applies before anything starts, under the flag's name."""
    from node.config import SettingsError

    with pytest.raises(SettingsError) as err:
        NodeConfig.load(is_cap=0.5)
    assert err.value.lines == ["--is-cap 0.5: Input should be greater than or equal to 1"]
