"""Scored groups: the unit that flows from rollout and admission into a training batch.

A group is one prompt answered G times by ONE generator. Own samples and admitted peer
samples both become `ScoredGroup`s; advantages are computed within a group only, so
rewards are never pooled across models. Own groups leave the node as a packet
(`to_packet`); the groups of a round become one training batch (`to_train_batch`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch stays out of this module's import
    from node.train.trainer import TrainBatch
    from protocol import PacketHeader, RolloutPacket

SELF = "self"
# All not-yet-trusted peers together take at most this share of a batch (node/defence/trust.py).
PROBATION_SHARE = 0.1


@dataclass(slots=True)
class ScoredSequence:
    """One completion, ready for the loss."""

    completion_ids: list[int]
    logp_gen: np.ndarray  # float32 [len(completion_ids)]: the generator's sampling log-probs
    reward: float  # re-scored by this node's own verifier
    seq_weight: float = 1.0  # the cross-tokenizer (GRAFT) weight; 1 on the token-level path
    text: str = ""
    finish_reason: str = "stop"


@dataclass(slots=True)
class ScoredGroup:
    source: str  # SELF or the sender's peer id
    task_id: str
    generator: str  # generator model id (the packet's, or our own)
    prompt_ids: list[int]  # the prompt as THIS node tokenizes it
    temperature: float
    top_k: int
    top_p: float
    sequences: list[ScoredSequence] = field(default_factory=list)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([s.reward for s in self.sequences], dtype=np.float32)


def own_groups(problems, prompt_ids: list[list[int]], samples, task, generator: str, sampling) -> list[ScoredGroup]:
    """The engine's answers to `problems` (one list of samples per prompt) as own groups, each
    sample scored by `task`'s verifier."""
    groups = []
    for problem, ids, answers in zip(problems, prompt_ids, samples):
        group = ScoredGroup(
            source=SELF,
            task_id=problem.task_id,
            generator=generator,
            prompt_ids=ids,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )
        for s in answers:
            reward = float(task.reward(problem, s.text))
            group.sequences.append(ScoredSequence(list(s.token_ids), s.logprobs, reward, 1.0, s.text, s.finish_reason))
        groups.append(group)
    return groups


def mix_groups(
    own: list[ScoredGroup],
    peers: list[ScoredGroup],
    peer_share: float,
    rng: random.Random,
    *,
    trusted: set[str] | None = None,
    probation_share: float = PROBATION_SHARE,
    served: dict[str, int] | None = None,
    replace: bool = False,
) -> tuple[list[ScoredGroup], int]:
    """Own groups plus as many peer groups as `peer_share` allows (counted in sequences).

    With share p, peer sequences are capped at p / (1 - p) times the own ones, so p = 0.5
    means at most as many peer samples as own. With `replace`, the batch keeps the size of
    the own samples instead: peers take at most p of it and a random subset of own groups
    fills the rest (SAPO's I local / J external rollouts at a fixed batch: p = 0.5 is its 4/4),
    so sharing changes what a node trains on, not how much. Peers take turns, one
    group each (in a random order, each peer's groups shuffled): the loss averages over
    groups, so a group is one unit of influence whatever its size, and equal turns keep
    a peer with many groups, or with many small ones, from crowding the others out.

    Signal first: a group whose rewards are all equal has zero advantage everywhere, so it adds
    nothing to the gradient and only dilutes the group average. Each peer's turns give its
    groups with a reward spread first, and with `replace` the own groups without one are the
    first to give up their room; a swarm then fills a node's dead groups with a peer's live ones,
    the gain that sharing at equal generation can bring.

    Peer ids cost nothing to make, so turns alone would hand a Sybil with many ids most of
    the batch. With `trusted` given, the peers NOT in it (new identities on probation, see
    node/defence/trust.py) take their turns after the trusted ones, and all of them together carry
    at most `probation_share` of the loss (of the batch's groups), or one group where that
    share rounds down to none; the least `served` of them (groups trained on so far, the
    volume trust asks for) go first, so n identities share the pool evenly and each earns
    trust n times slower, not by luck of the draw. `trusted=None` trusts
    everyone. Returns the batch and the number of peer groups left out.
    """
    if peer_share <= 0 or not peers:
        return list(own), len(peers)
    own_seqs = sum(len(g.sequences) for g in own)
    if replace:
        budget = peer_share * max(own_seqs, 1)
    else:
        budget = float("inf") if peer_share >= 1 else peer_share / (1 - peer_share) * max(own_seqs, 1)
    if trusted is None:
        known, newcomers = peers, []
    else:
        known = [g for g in peers if g.source in trusted]
        newcomers = [g for g in peers if g.source not in trusted]
    chosen, used = _take_turns(known, budget, float("inf"), rng)
    if newcomers and probation_share > 0:
        # u groups out of (own + trusted + u) is at most probation_share when u <= s / (1 - s) * (own + trusted);
        # at least one group a round for all of them together, so a joiner counts from its first
        # round even in a small batch (a Sybil army still shares that one group).
        share = min(probation_share, 0.999)
        max_groups = max(1, int(share / (1 - share) * (len(own) + len(chosen)) + 1e-9))
        chosen += _take_turns(newcomers, budget - used, max_groups, rng, served)[0]
    kept = list(own)
    if replace:  # own groups give up the room the peers took, drawn at random
        room = own_seqs - sum(len(g.sequences) for g in chosen)
        picked = []
        for i in sorted(rng.sample(range(len(own)), len(own)), key=lambda i: not has_signal(own[i])):  # stable
            if len(own[i].sequences) <= room:
                picked.append(i)
                room -= len(own[i].sequences)
        kept = [own[i] for i in sorted(picked)]
    return kept + chosen, len(peers) - len(chosen)


def drop_copies(own: list[ScoredGroup], peers: list[ScoredGroup]) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
    """Peers' groups that repeat one of ours (same prompt, same completions' token ids) and
    the rest. A copy adds no information and would count our own samples twice: two nodes
    on one seed, or a peer replaying our packet, produce them."""
    ours = {_fingerprint(g) for g in own}
    copies = [g for g in peers if _fingerprint(g) in ours]
    return [g for g in peers if _fingerprint(g) not in ours], copies


def _fingerprint(group: ScoredGroup) -> tuple:
    # By text where there is one: admission cuts a peer's ids after the answer tag, not its text.
    return (tuple(group.prompt_ids), tuple(sorted(s.text or repr(s.completion_ids) for s in group.sequences)))


def has_signal(group: ScoredGroup) -> bool:
    """Rewards that differ within the group: a nonzero advantage somewhere."""
    return bool(group.sequences) and float(np.ptp(group.rewards)) > 0


def _take_turns(
    groups: list[ScoredGroup],
    budget: float,
    max_groups: float,
    rng: random.Random,
    served: dict[str, int] | None = None,
) -> tuple[list[ScoredGroup], int]:
    """Groups of several sources in turns, one group per source per turn, within `budget` sequences;
    sources in a random order, or the least `served` first where that is given."""
    by_source: dict[str, list[ScoredGroup]] = {}
    for group in groups:
        by_source.setdefault(group.source, []).append(group)
    # Popped from the end: each queue's groups with a signal last, in a random order within (a stable sort).
    queues = [sorted(rng.sample(gs, len(gs)), key=has_signal) for _, gs in sorted(by_source.items())]
    rng.shuffle(queues)
    if served is not None:
        queues.sort(key=lambda q: served.get(q[0].source, 0))  # stable: ties keep the random order
    chosen: list[ScoredGroup] = []
    used = 0
    while any(queues) and len(chosen) < max_groups:
        for queue in queues:
            if queue and len(chosen) < max_groups:
                group = queue.pop()
                if used + len(group.sequences) <= budget:
                    chosen.append(group)
                    used += len(group.sequences)
    return chosen, used


def to_packet(own: list[ScoredGroup], header: PacketHeader, sampling) -> RolloutPacket:
    """This node's groups of one round as the packet it publishes (rewards stay home);
    `sampling` is a `SamplingParams` or anything with its fields (the engine's `Sampling`)."""
    from protocol import Completion, Group, RolloutPacket, SamplingParams

    sampling = SamplingParams.model_validate(sampling, from_attributes=True)

    groups = [
        Group(
            task_id=g.task_id,
            generator_model_id=g.generator,
            sampling=sampling,
            completions=[
                Completion(token_ids=s.completion_ids, logprobs=s.logp_gen, text=s.text, finish_reason=s.finish_reason)
                for s in g.sequences
            ],
        )
        for g in own
    ]
    return RolloutPacket(header=header, groups=groups)


def to_train_batch(groups: list[ScoredGroup]) -> TrainBatch | None:
    """The F-TIS batch of `groups`, advantages computed within each group; None if empty."""
    import torch

    from node.train.ftis import group_advantages
    from node.train.trainer import TrainBatch, TrainSequence

    sequences = []
    for gid, g in enumerate(groups):
        n = len(g.sequences)
        adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float64), torch.zeros(n, dtype=torch.long))
        for s, a in zip(g.sequences, adv.tolist()):
            sequences.append(
                TrainSequence(
                    prompt_ids=g.prompt_ids,
                    completion_ids=s.completion_ids,
                    logp_gen=s.logp_gen,
                    advantage=a,
                    group_id=gid,
                    seq_weight=s.seq_weight,
                    temperature=g.temperature,
                    top_k=g.top_k,
                    top_p=g.top_p,
                    source=g.source,
                )
            )
    return TrainBatch(sequences=sequences) if sequences else None
