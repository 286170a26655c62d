"""`ftis-node bench swarm-gain` end to end on the tiny model: every configuration runs real
nodes (the daemon's own rollout, admission, mixing and step) on the in-process exchange;
the summary has the keys the docs promise; configurations differ in what they trained on;
a rerun resumes (a finished run is not run again, a missing one is)."""

import json

import pytest
from typer.testing import CliRunner

from node.console.cli import app


@pytest.mark.timeout(600)
def test_tiny_preset_runs_every_configuration_and_resumes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["bench", "swarm-gain", "--preset", "tiny", "--work", str(work), "--out", str(out), "--threads", "1"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    summary = json.loads((out / "swarm-gain.json").read_text())
    assert summary["model"] == "tiny-s"
    assert summary["runs_done"] == summary["runs_planned"] == 3  # isolation, NoIS 4/4, F-TIS 4/4
    assert isinstance(summary["cumulative_reward_ratio_vs_isolation"], float)
    assert isinstance(summary["ftis_minus_nois_cumulative_reward"], float)
    assert summary["best_ftis_config"] == "homogeneous f-tis 4/4"
    assert (out / "swarm-gain.md").read_text().startswith("# Swarm gain")

    runs = {p.stem: json.loads(p.read_text()) for p in (work / "runs").glob("*.json")}
    iso, nois, ftis = (runs[f"homogeneous-{k}-s0"] for k in ("alone-0", "nois-0.5", "f-tis-0.5"))
    rounds, prompts, group = 3, 4, 4
    for run in (iso, nois, ftis):
        for node in run["nodes"]:
            # Equal generation: every node answers the same number of prompts in every configuration.
            assert node["own_samples"] == rounds * prompts * group
            assert len(node["rewards"]) == rounds
            assert set(node) >= {"heldout_before", "heldout_after", "ood_before", "ood_after", "offpolicy"}
    # Isolation trains on its own samples only; the shared runs on half a batch of peers' (4/4).
    assert all(n["peer_samples_used"] == 0 for n in iso["nodes"])
    for run in (nois, ftis):
        assert all(n["peer_samples_used"] == rounds * prompts * group // 2 for n in run["nodes"])
        assert all(n["offpolicy"]["peer_is_weight_mean"] is not None for n in run["nodes"])
    # A node's own prompts are the same in every configuration (same seed), the two nodes' differ.
    assert iso["nodes"][0]["seed"] == nois["nodes"][0]["seed"] != nois["nodes"][1]["seed"]
    # The losses differ: NoIS and F-TIS weigh the same kind of batch differently (or train on other samples).
    assert [n["losses"] for n in nois["nodes"]] != [n["losses"] for n in ftis["nodes"]]

    # Resume: a finished run is skipped; a run whose file is gone (a cut run) is played again.
    (work / "runs" / "homogeneous-nois-0.5-s0.json").unlink()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "homogeneous-alone-0-s0: done before, skipped" in again.output
    assert "homogeneous-f-tis-0.5-s0: done before, skipped" in again.output
    assert "homogeneous-nois-0.5-s0: round 1/3" in again.output
    assert json.loads((out / "swarm-gain.json").read_text())["runs_done"] == 3

    # An isolation run cut after its first node resumes at the second: each node is saved as it finishes.
    assert len(list((work / "runs" / "alone").glob("*.json"))) == 2
    (work / "runs" / "homogeneous-alone-0-s0.json").unlink()
    (next((work / "runs" / "alone").glob("*seed1.json"))).unlink()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "homogeneous-alone-0-s0 node 0: round" not in again.output
    assert "homogeneous-alone-0-s0 node 1: round 3/3" in again.output

    # Other settings in the same work folder are refused, not mixed in.
    other = CliRunner().invoke(app, [*args, "--rounds", "4"])
    assert other.exit_code == 2 and "holds runs of other settings" in other.output
