"""The batch mix: own groups first, then peers' groups in turns, up to the share cap."""

import random

import numpy as np

from node.groups import SELF, ScoredGroup, ScoredSequence, mix_groups


def group(source: str, task: int, size: int = 4, rewards=None) -> ScoredGroup:
    g = ScoredGroup(
        source=source, task_id=f"toy/id/{task}", generator="m", prompt_ids=[1, 2], temperature=1.0, top_k=0, top_p=1.0
    )
    for r in rewards or [0.0, 1.0] * (size // 2):
        g.sequences.append(ScoredSequence([3], np.zeros(1, np.float32), r))
    return g


def test_half_share_caps_peer_samples_at_the_own_count_and_every_peer_gets_a_turn():
    own = [group(SELF, i) for i in range(3)]  # 12 own sequences
    peers = [group("big", 100 + i) for i in range(10)] + [group("p2", 200), group("p3", 300)]
    batch, left_out = mix_groups(own, peers, 0.5, random.Random(0))
    taken = [g for g in batch if g.source != SELF]
    assert batch[:3] == own
    assert sum(len(g.sequences) for g in taken) == 12 and left_out == len(peers) - 3
    assert {g.source for g in taken} == {"big", "p2", "p3"}


def test_share_zero_and_one():
    own, peers = [group(SELF, 0)], [group("a", 1), group("b", 2)]
    assert mix_groups(own, peers, 0.0, random.Random(0)) == (own, 2)
    batch, left_out = mix_groups(own, peers, 1.0, random.Random(0))
    assert len(batch) == 3 and left_out == 0


def test_turns_are_counted_in_sequences_so_big_groups_buy_no_bigger_share():
    own = [group(SELF, i, size=8) for i in range(4)]  # 32 own sequences: a peer budget of 32
    peers = [group("bulky", 100 + i, size=16) for i in range(4)] + [group(f"p{k}", 200 + k) for k in range(6)]
    batch, _ = mix_groups(own, peers, 0.5, random.Random(0))
    taken = {}
    for g in batch[4:]:
        taken[g.source] = taken.get(g.source, 0) + len(g.sequences)
    assert sum(taken.values()) <= 32 and taken.get("bulky", 0) <= 16, taken


def test_made_up_ids_on_probation_together_get_only_their_capped_share():
    """5 made-up ids with many groups each vs 2 trusted peers: the Sybils share probation_share of the batch."""
    own = [group(SELF, i, size=8) for i in range(8)]  # 64 own sequences
    honest = [group(f"honest{k}", 100 * k + i, size=8) for k in range(2) for i in range(2)]  # 32 sequences
    sybils = [group(f"sybil{k}", 1000 * (k + 1) + i, size=8) for k in range(5) for i in range(8)]
    for seed in range(5):
        batch, _ = mix_groups(
            own, honest + sybils, 0.5, random.Random(seed), trusted={"honest0", "honest1"}, probation_share=0.1
        )
        total = sum(len(g.sequences) for g in batch)
        by_sybils = sum(len(g.sequences) for g in batch if g.source.startswith("sybil"))
        assert sum(len(g.sequences) for g in batch if g.source.startswith("honest")) == 32
        assert by_sybils == 8  # 0.1 of the largest batch (64 own + 64 peers) = 12.8: one group of 8
        assert total <= 128 + 1e-9
    # Without a trust list (the old behaviour) the same Sybils take 5/7 of the peer samples.
    batch, _ = mix_groups(own, honest + sybils, 0.5, random.Random(0))
    assert sum(len(g.sequences) for g in batch if g.source.startswith("sybil")) >= 40


def test_newcomers_fill_what_trusted_peers_leave_within_their_cap():
    own = [group(SELF, i, size=8) for i in range(4)]  # 32 own: budget 32, largest batch 32 + 24 = 56
    newcomers = [group("new", 10 + i, size=8) for i in range(3)]
    batch, left_out = mix_groups(own, newcomers, 0.5, random.Random(0), trusted=set(), probation_share=0.3)
    assert sum(len(g.sequences) for g in batch[4:]) == 16 and left_out == 1  # 0.3 * 56 = 16.8 -> two groups
    assert mix_groups(own, newcomers, 0.5, random.Random(0), trusted=set(), probation_share=0.0)[1] == 3
