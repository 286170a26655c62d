"""Admission: a peer's packet bytes become re-scored groups, or counted rejections; never an exception."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from node.defence.admission import GRAFT_MIN_WEIGHT, Admission
from node.defence.screen import score_completions
from node.models import tokenizer_fingerprint
from node.tasks import get_task
from node.train.logprobs import sequence_logprobs
from protocol import Completion, Group, PacketHeader, RolloutPacket, SamplingParams, encode

PEER = "QmPeer"


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    def local_logprobs(prompt_ids, completion_ids, temperature, top_k, top_p):
        with torch.no_grad():
            logp, _ = sequence_logprobs(
                model,
                [prompt_ids],
                [completion_ids],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                pad_id=tokenizer.pad_token_id or 0,
            )
        return logp[0, : len(completion_ids)].numpy()

    def local_view(prompt_ids, completions, temperature, top_k, top_p):
        pad = tokenizer.pad_token_id or 0
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, pad_id=pad)
        return score_completions(model, prompt_ids, completions, **kw)

    return tokenizer, local_logprobs, local_view


def make_admission(local, **kw) -> Admission:
    tokenizer, _, local_view = local
    return Admission(
        task=get_task("toy"),
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(tokenizer),
        swarm_id="s",
        local_view=local_view,
        max_positions=512,
        **kw,
    )


def packet(
    tokenizer,
    *,
    fingerprint=None,
    swarm="s",
    round_=5,
    sender=PEER,
    task_ids=None,
    texts=None,
    logprob=-0.5,
    with_text=True,
    n=4,
) -> bytes:
    task = get_task("toy")
    groups = []
    for task_id in task_ids or ["toy/id/1", "toy/id/2"]:
        answer = task.problem(task_id).answer if task_id.startswith("toy/id/") and task_id[7:].isdigit() else "0"
        outs = texts or [f"<answer>{answer}</answer>", "<answer>-1</answer>"] * (n // 2)
        completions = []
        for text in outs:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            completions.append(
                Completion.of(ids, np.full(len(ids), logprob, np.float32), text=text if with_text else None)
            )
        groups.append(
            Group.of(
                task_id, "peer-model", SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=32), completions
            )
        )
    header = PacketHeader.create(
        swarm_id=swarm,
        round=round_,
        sender_peer_id=sender,
        base_model_id="peer-model",
        tokenizer_fingerprint=fingerprint or tokenizer_fingerprint(tokenizer),
        vocab_size=len(tokenizer),
    )
    return encode(RolloutPacket(header=header, groups=groups))


def test_same_tokenizer_groups_are_rescored_locally(local):
    tokenizer = local[0]
    got = make_admission(local).admit(PEER, packet(tokenizer), current_round=5)
    assert not got.rejected and len(got.groups) == 2 and got.samples == 8
    for g in got.groups:
        assert g.source == PEER and g.generator == "peer-model"
        assert g.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # our verifier, not any sender's claim
        assert all(s.seq_weight == 1.0 and np.allclose(s.logp_gen, -0.5, atol=1e-3) for s in g.sequences)
        assert (
            g.prompt_ids == tokenizer(get_task("toy").problem(g.task_id).prompt, add_special_tokens=False)["input_ids"]
        )


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(swarm="other"), "wrong_swarm"),
        (dict(round_=1), "stale"),
        (dict(sender="QmSomeoneElse"), "impersonation"),
        (dict(task_ids=["toy/ood/3"]), "foreign_task"),
        (dict(task_ids=["toy/id/notanumber"]), "bad_task_id"),
        (dict(n=1, texts=["<answer>1</answer>"]), "group_too_small"),
    ],
)
def test_bad_packets_are_rejected_with_a_reason(local, kwargs, reason):
    tokenizer = local[0]
    got = make_admission(local).admit(PEER, packet(tokenizer, **kwargs), current_round=5)
    assert got.groups == [] and got.rejected[reason] >= 1 and got.details[reason]


def test_malformed_bytes_are_counted_not_raised(local):
    tokenizer = local[0]
    admission = make_admission(local)
    good = packet(tokenizer)
    for data in (b"", b"garbage", good[:-7], b"XXXX" + good[4:]):
        got = admission.admit(PEER, data, current_round=5)
        assert got.groups == [] and sum(got.rejected.values()) == 1


def test_foreign_tokenizer_takes_the_graft_weight_or_is_dropped(local):
    tokenizer, local_logprobs, _ = local
    problem = get_task("toy").problem("toy/id/1")
    text = f"<answer>{problem.answer}</answer>"
    prompt_ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    mean_local = float(local_logprobs(prompt_ids, ids, 1.0, 0, 1.0).mean())

    def weights(gen_mean: float):
        data = packet(tokenizer, fingerprint="f" * 32, task_ids=["toy/id/1"], texts=[text] * 4, logprob=gen_mean)
        return make_admission(local).admit(PEER, data, current_round=5)

    close = weights(mean_local + 0.1)  # s = exp(-0.1) = 0.905: admitted with weight s
    assert len(close.groups) == 1
    seq = close.groups[0].sequences[0]
    assert seq.seq_weight == pytest.approx(np.exp(-0.1), abs=2e-3)
    assert seq.completion_ids == ids and np.allclose(seq.logp_gen, local_logprobs(prompt_ids, ids, 1.0, 0, 1.0))
    assert weights(mean_local - 0.5).groups[0].sequences[0].seq_weight == 1.0  # s > 1 is capped at 1
    far = weights(mean_local + 0.5)  # s = 0.61 < 0.8
    assert (
        far.groups == [] and far.rejected["graft_weight"] == 4 and str(GRAFT_MIN_WEIGHT) in far.details["graft_weight"]
    )

    textless = packet(tokenizer, fingerprint="f" * 32, with_text=False)
    assert make_admission(local).admit(PEER, textless, 5).rejected["no_text"] == 8
    dropped = make_admission(local, cross_tokenizer="drop").admit(PEER, packet(tokenizer, fingerprint="f" * 32), 5)
    assert dropped.groups == [] and dropped.rejected == {"foreign_tokenizer": 1}
