"""Every node its own stream: the default seed comes from the node's identity, a pinned
--seed wins, a resumed node keeps its stream; a peer's copy of one of our groups is not
trained on twice; the SAPO-style mix keeps the batch at the size of the own samples."""

import json
import random

import numpy as np
import pytest
from typer.testing import CliRunner

from node.config import NodeConfig
from node.console.cli import app
from node.daemon import Node
from node.groups import SELF, ScoredGroup, ScoredSequence, drop_copies, mix_groups
from node.seeds import seed_of_peer


def group(source: str, task: int, tokens=((3,), (4,)), prompt=(1, 2)) -> ScoredGroup:
    g = ScoredGroup(
        source=source,
        task_id=f"toy/id/{task}",
        generator="m",
        prompt_ids=list(prompt),
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    for i, ids in enumerate(tokens):
        g.sequences.append(ScoredSequence(list(ids), np.zeros(len(ids), np.float32), float(i % 2)))
    return g


def test_a_peer_group_equal_to_ours_is_dropped_whatever_the_order_of_its_completions():
    own = [group(SELF, 0, tokens=((3,), (4, 5)))]
    same = group("p", 0, tokens=((4, 5), (3,)))  # our completions in another order
    other_tokens = group("p", 0, tokens=((3,), (4, 6)))
    other_prompt = group("p", 1, tokens=((3,), (4, 5)), prompt=(1, 9))
    kept, copies = drop_copies(own, [same, other_tokens, other_prompt])
    assert copies == [same]
    assert [id(g) for g in kept] == [id(other_tokens), id(other_prompt)]


def test_replace_mix_keeps_the_batch_at_the_own_size_with_the_share_from_peers():
    own = [group(SELF, i) for i in range(8)]  # 16 own sequences
    peers = [group(f"p{j}", 100 + i) for j in range(2) for i in range(8)]
    for share, peer_groups in ((0.5, 4), (0.25, 2)):
        batch, left_out = mix_groups(own, peers, share, random.Random(1), replace=True)
        assert len(batch) == 8 and sum(g.source != SELF for g in batch) == peer_groups
        assert left_out == len(peers) - peer_groups
        kept_own = [g for g in batch if g.source == SELF]
        assert all(any(g is o for o in own) for g in kept_own)
    # No peers: all own groups, as in isolation.
    assert mix_groups(own, [], 0.5, random.Random(1), replace=True)[0] == own
    # The default (add) keeps every own group and adds peers on top.
    batch, _ = mix_groups(own, peers, 0.5, random.Random(1))
    assert len(batch) == 16


def test_seed_of_a_peer_id_is_stable_and_differs_between_peers():
    assert seed_of_peer("12D3KooWA") == seed_of_peer("12D3KooWA")
    assert seed_of_peer("12D3KooWA") != seed_of_peer("12D3KooWB")
    assert 0 <= seed_of_peer("x") < 2**31


def _solo(tmp_path, name: str, **kw) -> Node:
    cfg = NodeConfig(
        name=name,
        data_dir=tmp_path / name,
        model="tiny-s",
        task="toy",
        prompts_per_round=4,
        group_size=4,
        max_tokens=8,
        api_port=None,
        threads=1,
        **kw,
    )
    return Node(cfg, use_swarm=False).setup()


@pytest.mark.timeout(300)
def test_solo_nodes_draw_their_own_prompts_keep_them_on_resume_and_a_pinned_seed_wins(tmp_path):
    a, b = _solo(tmp_path, "a"), _solo(tmp_path, "b")
    try:
        assert a.cfg.seed != b.cfg.seed
        prompts = {n.cfg.name: [g.task_id for g in n.rollout(0)] for n in (a, b)}
        assert prompts["a"] != prompts["b"]
        seed_a = a.cfg.seed
    finally:
        a.close()
        b.close()
    again = _solo(tmp_path, "a")  # the same data dir: the same identity, the same stream
    try:
        assert again.cfg.seed == seed_a
        assert [g.task_id for g in again.rollout(0)] == prompts["a"]
    finally:
        again.close()
    pinned = [_solo(tmp_path, name, seed=7) for name in ("c", "d")]
    try:
        assert [n.cfg.seed for n in pinned] == [7, 7]
        rolls = [n.rollout(0) for n in pinned]
        assert [g.task_id for g in rolls[0]] == [g.task_id for g in rolls[1]]
    finally:
        for n in pinned:
            n.close()


def test_join_dry_run_says_where_the_seed_comes_from(tmp_path):
    runner = CliRunner()
    free = runner.invoke(app, ["join", "--dry-run", "--data-dir", str(tmp_path / "x")])
    assert free.exit_code == 0, free.output
    assert json.loads(free.output)["seed"].startswith("from identity")
    pinned = runner.invoke(app, ["join", "--dry-run", "--data-dir", str(tmp_path / "x"), "--seed", "5"])
    assert json.loads(pinned.output)["seed"] == 5
