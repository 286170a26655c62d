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


def test_many_small_groups_buy_no_more_influence_than_a_few_big_ones():
    """The loss averages over groups: a peer splitting its samples into groups of 2 gets as many turns, not more."""
    own = [group(SELF, i, size=8) for i in range(8)]  # 64 own sequences: a peer budget of 64
    peers = [group("small", 100 + i, size=2) for i in range(16)]
    peers += [group(f"p{k}", 200 + 10 * k + i, size=8) for k in range(2) for i in range(4)]
    for seed in range(5):
        batch, _ = mix_groups(own, peers, 0.5, random.Random(seed))
        groups = {}
        for g in batch[8:]:
            groups[g.source] = groups.get(g.source, 0) + 1
        assert groups.get("small", 0) <= max(groups.get("p0", 0), groups.get("p1", 0)) + 1, groups
        assert sum(len(g.sequences) for g in batch[8:]) <= 64


def test_made_up_ids_on_probation_together_carry_only_their_capped_share_of_the_loss():
    """5 made-up ids with many groups each vs 2 trusted peers: together they get probation_share of the groups."""
    own = [group(SELF, i, size=8) for i in range(8)]  # 64 own sequences
    honest = [group(f"honest{k}", 100 * k + i, size=8) for k in range(2) for i in range(2)]  # 4 groups
    sybils = [group(f"sybil{k}", 1000 * (k + 1) + i, size=2) for k in range(5) for i in range(8)]
    for seed in range(5):
        batch, _ = mix_groups(
            own, honest + sybils, 0.5, random.Random(seed), trusted={"honest0", "honest1"}, probation_share=0.1
        )
        assert sum(g.source.startswith("honest") for g in batch) == 4
        assert sum(g.source.startswith("sybil") for g in batch) == 1  # 0.1 / 0.9 * (8 + 4) = 1.33 groups
    # Without a trust list (the old behaviour) the same Sybils take 5/7 of the peer turns.
    batch, _ = mix_groups(own, honest + sybils, 0.5, random.Random(0))
    assert sum(g.source.startswith("sybil") for g in batch) >= 5 * 2


def test_newcomers_fill_what_trusted_peers_leave_within_their_cap():
    own = [group(SELF, i, size=8) for i in range(6)]
    newcomers = [group("new", 10 + i, size=8) for i in range(3)]
    batch, left_out = mix_groups(own, newcomers, 0.5, random.Random(0), trusted=set(), probation_share=0.25)
    assert len(batch) == 8 and left_out == 1  # 0.25 / 0.75 * 6 = 2 groups: 2 of the 8 in the loss
    assert mix_groups(own, newcomers, 0.5, random.Random(0), trusted=set(), probation_share=0.0)[1] == 3


def test_newcomers_together_get_one_group_where_their_share_rounds_to_none():
    """The default 8 own groups and a 10 % share: 0.1 / 0.9 * 8 = 0.89 groups, so one, for all of them."""
    own = [group(SELF, i, size=8) for i in range(8)]
    joiner = [group("joiner", 10 + i, size=8) for i in range(8)]
    batch, left_out = mix_groups(own, joiner, 0.5, random.Random(0), trusted=set(), probation_share=0.1)
    assert [g.source for g in batch[8:]] == ["joiner"] and left_out == 7
    sybils = [group(f"sybil{k}", 100 * k + i, size=2) for k in range(6) for i in range(4)]
    batch, _ = mix_groups(own, joiner + sybils, 0.5, random.Random(1), trusted=set(), probation_share=0.1)
    assert len(batch) == 9  # made-up ids share the same one group


def test_replace_gives_up_dead_own_groups_first_and_takes_live_peer_groups_first():
    """A group with equal rewards has no advantage anywhere: at a fixed batch, a peer's live
    groups take the room of the node's dead ones, never the other way round."""
    dead, live = [0.0] * 4, [0.0, 1.0, 0.0, 1.0]
    own = [group(SELF, i, rewards=live if i < 2 else dead) for i in range(8)]  # 2 live, 6 dead
    peers = [group("p", 100 + i, rewards=dead if i < 6 else live) for i in range(8)]  # 2 live among 8
    for seed in range(10):
        batch, left_out = mix_groups(own, peers, 0.25, random.Random(seed), replace=True)
        taken = [g for g in batch if g.source != SELF]
        kept = [g for g in batch if g.source == SELF]
        assert len(batch) == 8 and len(taken) == 2 and left_out == 6
        assert all(float(np.ptp(g.rewards)) > 0 for g in taken)  # the peer's 2 live groups
        assert own[0] in kept and own[1] in kept  # both own live groups stay; 2 dead ones went
