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
