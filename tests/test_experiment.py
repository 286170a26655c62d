"""`ftis-node experiment`: the in-process exchange, the config, and a short real run.

The smoke run plays two real nodes (tiny-s + tiny-l) through the daemon's own rounds
for two variants, writes the JSON, markdown and PNG, and repeats one setting through two
real hivemind DHTs; the curves of the two transports must agree.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from node.experiment import BUILTIN_PAIRS, ExperimentConfig, load_experiment_config, resolve_config, run_experiment
from node.experiment.evaluate import eval_set
from node.experiment.exchange import ExchangeHub
from node.tasks import TaskError

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- exchange


def test_exchange_delivers_each_peer_packet_once_and_never_our_own():
    hub = ExchangeHub(body_check=None)  # raw bytes: the board's own rules
    a, b, c = hub.endpoint("a"), hub.endpoint("b"), hub.endpoint("c")
    assert a.publish(0, b"from-a") and b.publish(0, b"from-b")
    got = a.gather(0, deadline_s=0, expect_peers=1)
    assert [(p.peer_id, p.round, p.data) for p in got.packets] == [("inproc-b", 0, b"from-b")]
    assert a.gather(0, deadline_s=0).packets == []  # already delivered
    # A later round also reads the previous one (stale_rounds=1), like Swarm.gather.
    c.publish(0, b"late-c")
    b.publish(1, b"b-round-1")
    got = a.gather(1, deadline_s=0)
    assert sorted((p.peer_id, p.round) for p in got.packets) == [("inproc-b", 1), ("inproc-c", 0)]
    # The swarm's duplicate rule: the same bytes again are nothing new; a second, different
    # packet of a peer for a round is rejected `duplicate`, never delivered.
    b.publish(1, b"b-round-1")
    assert a.gather(1, deadline_s=0).packets == []
    b.publish(1, b"b-round-1-again")
    again = a.gather(1, deadline_s=0)
    assert again.packets == [] and again.rejected_by_peer == {"inproc-b": {"duplicate": 1}}
    assert a.gather(1, deadline_s=0).rejected == {}  # judged once
    assert hub.published(1) == {"inproc-b": b"b-round-1-again"}
    # Bytes already delivered under another peer (a relay) are rejected `duplicate_content`.
    c.publish(2, b"b-round-1")
    assert a.gather(2, deadline_s=0).rejected_by_peer == {}  # another round: not a duplicate
    c.publish(1, b"b-round-1")
    assert a.gather(1, deadline_s=0).rejected_by_peer == {"inproc-c": {"duplicate_content": 1}}


def test_exchange_gather_waits_for_expected_peers_until_the_deadline():
    hub = ExchangeHub(body_check=None)  # raw bytes: the board's own rules
    a, b = hub.endpoint("a"), hub.endpoint("b")
    threading.Timer(0.2, lambda: b.publish(3, b"x")).start()
    start = time.monotonic()
    progress: list[int] = []
    got = a.gather(3, deadline_s=5, expect_peers=1, on_progress=progress.append)
    assert got.peers == {"inproc-b"} and 0.15 < time.monotonic() - start < 2
    assert progress == [1]  # as Swarm.gather: told once, when b's packet arrived
    start = time.monotonic()
    assert a.gather(4, deadline_s=0.3, expect_peers=1).packets == []
    assert time.monotonic() - start >= 0.29


def test_exchange_rejects_bad_input_with_a_reason():
    hub = ExchangeHub(body_check=None)  # raw bytes: the board's own rules
    a = hub.endpoint("a")
    with pytest.raises(ValueError, match="taken"):
        hub.endpoint("a")
    with pytest.raises(TypeError, match="bytes"):
        a.publish(0, "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="round"):
        a.publish(-1, b"x")
    with pytest.raises(ValueError, match="deadline_s"):
        a.gather(0, deadline_s=float("nan"))
    a.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        a.publish(0, b"x")


# ---------------------------------------------------------------------------- config


def test_paper_gpu_config_loads_and_fails_fast_without_its_data(tmp_path):
    cfg = load_experiment_config(REPO / "configs" / "paper-gpu.yaml")
    models = {n.model for p in cfg.pairs for n in p.nodes}
    assert {"qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-coder-1.5b", "qwen2.5-coder-3b"} <= models
    assert all(n.train_mode == "full" for p in cfg.pairs for n in p.nodes)
    assert (cfg.group_size, cfg.lr_full, cfg.is_cap, cfg.kl_threshold, cfg.rounds) == (12, 1e-6, 2.0, 50, 50)
    assert cfg.task.startswith("gsm8k:") and any(s.startswith("math500:") for s in cfg.eval_tasks.values())
    assert cfg.variants == ["alone", "nois", "vis", "tis", "f-nois", "f-vis", "f-tis"]
    # Overrides win over the file; a pair name picks the file's own pair before a built-in one.
    picked = resolve_config(REPO / "configs" / "paper-gpu.yaml", pairs=["size"], seeds=(0, 1), rounds=None)
    assert picked.pairs[0].labels == ("qwen2.5-1.5b", "qwen2.5-3b") and picked.seeds == [0, 1]
    assert picked.rounds == 50 and picked.lr_full == 1e-6
    assert resolve_config(None, pairs="full-lora").pairs == [BUILTIN_PAIRS["full-lora"]]
    # Run from a folder without the data: a clear error before any model is loaded.
    with pytest.raises(TaskError, match="gsm8k file not found"):
        run_experiment(tmp_path / "out", config=REPO / "configs" / "paper-gpu.yaml", plot=False)
    assert not (tmp_path / "out").exists()


def test_config_accepts_file_tasks_and_rejects_bad_settings(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(
        "".join(json.dumps({"question": f"What is {i}+1?", "answer": f"... #### {i + 1}"}) + "\n" for i in range(5))
    )
    cfg = ExperimentConfig(
        pairs=[{"name": "big", "nodes": [{"model": "org/a"}, {"model": "org/b"}]}],
        task=f"gsm8k:{gsm}",
        eval_tasks={"gsm": f"gsm8k:{gsm}"},
        variants="f-tis",
    )
    assert cfg.pairs[0].labels == ("org/a", "org/b") and cfg.variants == ["f-tis"]
    evals = eval_set("gsm", cfg.eval_tasks["gsm"], n=3)
    assert [p.task_id for p in evals.problems] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]  # file order
    assert evals.problems[2].answer == "3"
    toy = eval_set("id", "toy", n=16, seed=0)
    assert toy.problems == eval_set("id", "toy", n=16, seed=0).problems  # fixed set
    assert toy.problems != eval_set("id", "toy", n=16, seed=1).problems
    assert len({p.task_id for p in toy.problems}) == 16

    bad = {
        "pairs": ("nope", "unknown pair 'nope'"),
        "variants": (["f-tis", "ppo"], "unknown variant 'ppo'"),
        "eval_tasks": ({"id": "squad:x"}, "unknown kind 'squad'"),
        "seeds": ([0, 0], "seeds repeat"),
        # The nodes' own rules (NodeConfig, LossConfig, protocol.keys), not copies of them.
        "is_cap": (0.5, "is_cap: Input should be greater than or equal to 1"),
        "lora_rank": (0, "lora_rank: Input should be greater than or equal to 1"),
        "swarm_id": ("Big Swarm", "swarm_id: swarm id 'Big Swarm' may only contain"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            ExperimentConfig(**{field: value})
    with pytest.raises(ValueError, match="both nodes are labelled"):
        ExperimentConfig(pairs=[{"name": "x", "nodes": [{"model": "tiny-s"}, {"model": "tiny-s"}]}])
    same = ExperimentConfig(pairs=["full-lora"]).pairs[0].labels
    assert same == ("tiny-m (full)", "tiny-m (lora)")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_experiment_config(listed)


# ---------------------------------------------------------------------------- a real run


@pytest.mark.timeout(300)
def test_smoke_run_writes_consistent_outputs_and_dht_agrees(tmp_path):
    results = run_experiment(
        tmp_path / "exp",
        pairs=["size"],
        variants=["alone", "f-tis"],
        seeds=[0],
        rounds=2,
        eval_every=1,
        eval_problems=8,
        prompts_per_round=2,
        group_size=4,
        max_tokens=10,
        dht_check=True,
        dht_rounds=2,
        command="pytest smoke",
    )
    out = tmp_path / "exp"
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["runs"] == results["runs"] and on_disk["command"] == "pytest smoke"
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "curves.png").stat().st_size > 5_000

    steps = [0, 1, 2]
    assert on_disk["eval_steps"] == steps
    runs = {r["variant"]: r for r in on_disk["runs"]}
    assert set(runs) == {"alone", "f-tis"}
    labels = [n["label"] for n in runs["alone"]["nodes"]]
    assert labels == list(BUILTIN_PAIRS["size"].labels)
    for variant, run in runs.items():
        for node in run["nodes"]:
            assert set(node["evals"]) == {"id", "ood", "id-sampled", "ood-sampled"} and node["build"].startswith(
                node["model"]
            )
            for name, curve in node["evals"].items():
                assert [s for s, _ in curve] == steps
                draws = 8 * (4 if name.endswith("-sampled") else 1)  # 8 problems, 4 samples each
                assert all(0.0 <= acc <= 1.0 and (acc * draws).is_integer() for _, acc in curve)
            assert [r["round"] for r in node["rounds"]] == [0, 1]
            for r in node["rounds"]:
                assert 0.0 <= r["reward_mean"] <= 1.0 and r["own_samples"] == 8 and r["peers_answered"] == 1
                # alone publishes but trains on its own samples; f-tis uses the partner's too
                assert (r["peer_samples"] > 0) == (variant == "f-tis")
    # Variants share seeds and starting weights: they differ only once the loss has acted.
    for a, f in zip(runs["alone"]["nodes"], runs["f-tis"]["nodes"]):
        assert a["evals"]["id"][0] == f["evals"]["id"][0]
        assert a["rounds"][0]["reward_mean"] == f["rounds"][0]["reward_mean"]

    # Summary rows and the markdown table say what the curves say.
    rows = on_disk["summary"]
    assert len(rows) == 2 * 2 * 4  # variants x nodes x (2 splits, greedy and sampled)
    md = (out / "results.md").read_text()
    for row in rows:
        node = runs[row["variant"]]["nodes"][row["node"]]
        assert row["final"] == node["evals"][row["split"]][-1][1]
        assert row["best"] == max(v for _, v in node["evals"][row["split"]])
    for variant in ("alone", "**f-tis**"):
        line = next(line for line in md.splitlines() if line.startswith(f"| {variant} |"))
        cells = line.strip("| ").split(" | ")
        assert len(cells) == 1 + 2 * (4 * 2 + 1)  # variant + per node: 4 finals, 4 bests, reward
        assert all(0.0 <= float(c) <= 1.0 for c in cells[1:])
    assert "![curves](curves.png)" in md and "pytest smoke" in md

    # The same setting over two real DHTs: the same bytes, so the same curves.
    check = on_disk["dht_check"]
    assert check["dht"]["transport"] == "dht" and check["inproc"]["transport"] == "inproc"
    assert check["agree"], check["nodes"]
    assert all(n["min_peer_samples"] > 0 for n in check["nodes"])
    assert check["identical"], check["nodes"]
    assert "In-process vs real DHT" in md


def test_greedy_pass_at_1_matches_plain_greedy_decoding(tmp_path):
    import torch

    from node.config import NodeConfig
    from node.daemon import Node
    from node.experiment.evaluate import greedy_pass_at_1
    from node.models import load_model

    evals = eval_set("id", "toy", n=24, seed=3)
    node = Node(NodeConfig(name="e", data_dir=tmp_path / "e", model="tiny-s", api_port=None), use_swarm=False).setup()
    try:
        acc = greedy_pass_at_1(node, evals, max_tokens=12)
    finally:
        node.close()
    model, tok = load_model("tiny-s")
    right = 0
    for p in evals.problems:  # one prompt at a time: no padding at all
        ids = torch.tensor([tok(p.prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        right += evals.task.reward(p, tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert acc == right / len(evals)
    assert 0 < acc < 1  # the warm-started model gets some, not all: the check has teeth
