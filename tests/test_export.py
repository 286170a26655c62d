"""`ftis-node export`: a node's last checkpoint loads in a fresh process, with no cache paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from node.config import NodeConfig
from node.console.cli import app
from node.daemon import Node

PROBE = [[0, 5, 9, 13, 2, 7, 11]]

# Loads the export as another machine would: no ftis-node import, nothing from our cache.
LOADER = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, kind = sys.argv[1], sys.argv[2]
if kind == "adapter":
    from peft import AutoPeftModelForCausalLM, PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out + "/base"), out)
    auto = AutoPeftModelForCausalLM.from_pretrained(out)  # base named in adapter_config.json: ./base, from cwd
    same = torch.allclose(model(torch.tensor(PROBE)).logits, auto(torch.tensor(PROBE)).logits, atol=1e-5)
else:
    model, same = AutoModelForCausalLM.from_pretrained(out), True
tok = AutoTokenizer.from_pretrained(out)
with torch.no_grad():
    logits = model(torch.tensor(PROBE)).logits[0, -1].tolist()
print(json.dumps({"logits": logits, "same": bool(same), "vocab": len(tok)}))
""".replace("PROBE", repr(PROBE))


def _load_elsewhere(out, kind: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LOADER, str(out), kind],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HOME": str(out)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_export_adapter_and_merged_load_in_a_fresh_process(tmp_path):
    cfg = NodeConfig(
        name="exp",
        data_dir=tmp_path / "node",
        model="tiny-s",
        rounds=2,
        prompts_per_round=8,
        group_size=8,
        max_tokens=16,  # tiny-s closes its answer tag often enough at 16 for a group to carry signal
        lr=1e-2,  # large, so the adapter visibly moves the logits
        seed=0,  # pinned: with a peer-id seed some runs draw only groups of one reward, hence no step
        threads=1,
        api_port=None,
    )
    node = Node(cfg, use_swarm=False).setup()
    results = node.run()
    assert any(r.metrics["groups_with_signal"] > 0 for r in results), "no group had signal: nothing trained"
    # the policy as this node last used it, through a freshly loaded engine
    from peft import PeftModel

    from node.models import load_model
    from node.train.checkpoint import load_latest

    base, _ = load_model("tiny-s")
    ckpt = load_latest(tmp_path / "node" / "checkpoints")
    with torch.no_grad():
        plain = base(torch.tensor(PROBE)).logits[0, -1]
        want = PeftModel.from_pretrained(base, str(ckpt.weights_dir))(torch.tensor(PROBE)).logits[0, -1]
    assert not torch.allclose(plain, want, atol=1e-3), "training did not move the policy; the test proves nothing"

    runner = CliRunner()
    result = runner.invoke(app, ["export", str(tmp_path / "node"), str(tmp_path / "adapter")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "adapter"
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "base"  # relative, not this machine's cache
    assert (out / "base" / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    card = (out / "README.md").read_text()
    assert "| trained | 2 rounds, " in card and "| loss | f-tis |" in card and "| swarm |" in card
    got = _load_elsewhere(out, "adapter")
    assert got["same"] and torch.allclose(torch.tensor(got["logits"]), want, atol=1e-4)

    result = runner.invoke(app, ["export", str(tmp_path / "node"), str(tmp_path / "merged"), "--merge"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = _load_elsewhere(tmp_path / "merged", "full")
    assert torch.allclose(torch.tensor(merged["logits"]), want, atol=1e-4)

    again = runner.invoke(app, ["export", str(tmp_path / "node"), str(tmp_path / "adapter")])
    assert again.exit_code == 2 and "not empty" in again.output
    nothing = runner.invoke(app, ["export", str(tmp_path / "none"), str(tmp_path / "x")])
    assert nothing.exit_code == 2 and "no checkpoints" in nothing.output


@pytest.mark.timeout(600)
def test_a_running_node_can_be_exported_after_its_first_round(tmp_path):
    """The first trained round writes a checkpoint whatever --checkpoint-every says, so a node
    is exportable while it runs; the card counts the rounds it had played, not the round's id."""
    cfg = NodeConfig(
        name="young",
        data_dir=tmp_path / "node",
        model="tiny-s",
        rounds=2,
        prompts_per_round=8,
        group_size=8,
        max_tokens=16,
        lr=1e-2,
        seed=0,
        threads=1,
        api_port=None,
        checkpoint_every=10,
    )
    seen, exported = [], []

    def export_while_running(result) -> None:
        seen.append(result)
        if len(seen) == 2:  # the 1st round's checkpoint is on disk before the 2nd is recorded
            out = tmp_path / "adapter"
            done = CliRunner().invoke(app, ["export", str(tmp_path / "node"), str(out)])
            exported.append((done.exit_code, done.output, out))

    Node(cfg, use_swarm=False, on_round=export_while_running).setup().run()
    assert seen[0].metrics["groups_with_signal"] > 0, "round 1 trained nothing: no checkpoint was due"
    code, output, out = exported[0]
    assert code == 0, output
    assert "| trained | 1 round, " in (out / "README.md").read_text()
    assert _load_elsewhere(out, "adapter")["same"]
