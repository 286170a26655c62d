"""Settings come from flags > environment > YAML > defaults, with readable errors."""

import pytest
from typer.testing import CliRunner

from node.cli import app
from node.config import NodeConfig


def test_precedence_flags_env_yaml(tmp_path, monkeypatch):
    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text("model: tiny-m\nrounds: 3\nseed: 4\n")
    monkeypatch.setenv("FTIS_ROUNDS", "5")
    cfg = NodeConfig.load(yaml_file, seed=None, name="a")
    assert (cfg.model, cfg.rounds, cfg.seed, cfg.name) == ("tiny-m", 5, 4, "a")
    assert NodeConfig.load(yaml_file, rounds=9).rounds == 9


def test_bad_values_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="unknown loss 'bogus'"):
        NodeConfig.load(loss="bogus")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
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
