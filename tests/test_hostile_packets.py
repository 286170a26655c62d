"""One packet never hurts a node: each hostile case, through the real admission, trainer and round loop.

Two nodes with the same settings play the same rounds on an in-process exchange; a third
endpoint publishes one hostile packet per round to the victim only. The packet must be
rejected with its reason, the round must run, and the victim's weights must stay finite
and EQUAL to the control's, which never saw the packet (same seeds, own samples only).
Below that, the two last lines of defence on their own: the trainer skips a step that
would write non-finite weights, and the daemon drops a peer whose groups break the step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node.config import NodeConfig
from node.daemon import Node
from node.experiment.exchange import ExchangeHub
from node.groups import ScoredGroup, ScoredSequence, to_train_batch
from protocol import Completion, Group, PacketHeader, RolloutPacket, SamplingParams, encode

SWARM = "hostile"


def _config(tmp_path, name: str) -> NodeConfig:
    return NodeConfig(
        name=name,
        data_dir=tmp_path / name,
        model="tiny-s",
        task="toy",
        prompts_per_round=2,
        group_size=4,
        max_tokens=12,
        lr=1e-3,
        seed=0,
        swarm_id=SWARM,
        gather_seconds=0.0,
        api_port=None,
        threads=1,
        probation_rounds=0,  # so that a packet that got through would really be trained on
        quarantine_after=100,  # each case must meet its own check, not an earlier quarantine
    )


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    victims, controls = ExchangeHub(SWARM), ExchangeHub(SWARM)
    victim = Node(_config(tmp, "victim"), exchange=victims.endpoint("victim")).setup()
    control = Node(_config(tmp, "control"), exchange=controls.endpoint("control")).setup()
    attacker = victims.endpoint("attacker")
    yield victim, control, attacker
    victim.close()
    control.close()


def _packet(victim: Node, sender: str, r: int, completions, *, temperature=1.0, vocab=None, max_tokens=32) -> bytes:
    tok = victim.tokenizer
    comps = [Completion.of(ids, np.full(len(ids), -0.5, np.float32)) for ids in completions]
    sampling = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens)
    header = PacketHeader.create(
        swarm_id=SWARM,
        round=r,
        sender_peer_id=sender,
        base_model_id="tiny-s",
        tokenizer_fingerprint=victim.fingerprint,
        vocab_size=vocab or len(tok),
    )
    return encode(RolloutPacket(header=header, groups=[Group.of("toy/id/1", "tiny-s", sampling, comps)]))


def _answer(victim: Node, text: str = "<answer>5</answer>") -> list[int]:
    return victim.tokenizer(text, add_special_tokens=False)["input_ids"] + [victim.tokenizer.eos_token_id]


CASES = {
    "temperature 1e-300": ("bad_sampling", lambda v, s, r: _packet(v, s, r, [_answer(v)] * 4, temperature=1e-300)),
    "temperature 1e-40": ("bad_sampling", lambda v, s, r: _packet(v, s, r, [_answer(v)] * 4, temperature=1e-40)),
    "two empty completions": ("empty_completion", lambda v, s, r: _packet(v, s, r, [[], []])),
    "600 tokens on 512 positions": ("too_long", lambda v, s, r: _packet(v, s, r, [[5] * 600] * 2, max_tokens=700)),
    "id past our vocab, header vocab 100,000": (
        "vocab_mismatch",
        lambda v, s, r: _packet(v, s, r, [[100, 100, 600], [100, 600]], vocab=100_000),
    ),
    "header names another peer": (  # judged at the gather, from the packet's own header
        "relayed",
        lambda v, s, r: _packet(v, "inproc-someone-else", r, [_answer(v)] * 4),
    ),
}


def _finite(node: Node) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in node.trainer.params)


@pytest.mark.timeout(600)
def test_each_hostile_packet_is_rejected_and_the_victim_trains_as_if_it_never_came(swarm):
    victim, control, attacker = swarm
    for r, (case, (reason, make)) in enumerate(CASES.items()):
        attacker.publish(r, make(victim, attacker.peer_id, r))
        got, want = victim.run_round(r), control.run_round(r)
        assert got is not None and want is not None, case
        rejected = victim.status.snapshot()["peers"][attacker.peer_id]["rejected"]
        assert rejected.get(reason, 0) >= 1, (case, rejected)
        assert got.peer_samples == 0 and "step_skipped" not in got.metrics, case
        assert _finite(victim), case
        assert victim.trainer.adapter_version == control.trainer.adapter_version, case
    # and the next round runs as usual
    assert victim.run_round(len(CASES)).metrics["grad_norm"] > 0


def _group(victim: Node, source: str, completions, temperature=1.0) -> ScoredGroup:
    prompt = victim.admission.prompt_ids(victim.task.problem("toy/id/1").prompt)
    g = ScoredGroup(source, "toy/id/1", "tiny-s", prompt, temperature, 0, 1.0)
    for i, ids in enumerate(completions):
        g.sequences.append(ScoredSequence(ids, np.full(len(ids), -0.5, np.float32), float(i % 2)))
    return g


def test_the_trainer_skips_a_step_that_would_write_non_finite_weights(swarm):
    victim, _, _ = swarm
    bad = _group(victim, "peer", [_answer(victim)] * 4, temperature=1e-40)  # past admission's guard
    before = [p.detach().clone() for p in victim.trainer.params]
    steps = victim.trainer.steps
    metrics = victim.trainer.step(to_train_batch([bad]))
    assert metrics["skipped"].startswith("non-finite")
    assert victim.trainer.steps == steps
    assert all(torch.equal(a, b) for a, b in zip(before, victim.trainer.params))
    assert "skipped" not in victim.trainer.step(to_train_batch(victim.rollout(99)))  # and it still trains
    assert victim.trainer.steps == steps + 1


def test_a_peer_whose_groups_break_the_step_loses_them_and_the_round_goes_on(swarm):
    victim, _, _ = swarm
    own = victim.rollout(100)
    too_long = _group(victim, "peer-long", [[5] * 600, [6] * 600])
    nan = _group(victim, "peer-nan", [_answer(victim)] * 4, temperature=1e-40)
    steps = victim.trainer.steps
    metrics = victim._train_round(own + [too_long])
    assert victim.trainer.steps == steps + 1 and metrics["peer_groups_dropped"] == 1
    assert victim.status.snapshot()["peers"]["peer-long"]["rejected"]["untrainable"] == 2
    metrics = victim._train_round(own + [nan])  # skipped by the guard, then trained without the peer
    assert victim.trainer.steps == steps + 2 and metrics["peer_groups_dropped"] == 1 and "skipped" not in metrics
    assert victim.status.snapshot()["peers"]["peer-nan"]["rejected"]["untrainable"] == 4
    assert _finite(victim)
