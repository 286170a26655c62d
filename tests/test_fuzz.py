"""Fuzzing decode and admission together (node/bench/fuzz.py), and the oracle that judges it.

The quick run (2,000 cases and the hostile packets) is in the default suite; the full
100,000 cases of `ftis-node bench fuzz` are slow-marked. Counts and memory are asserted;
time is the benchmark's to report.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from node.bench.fuzz import PEER, ROUND, build_target, run_fuzz
from node.bench.fuzz_cases import _MUTATIONS, hostile_cases, make_seed
from node.bench.fuzz_oracle import admission_violations, spec_is_cheap, spec_violation, unsafe_violations
from node.defence.admission import Admitted
from node.groups import ScoredGroup, ScoredSequence
from protocol import decode, encode

MUST_HOLD = ("non_protocol_errors", "admitted_invalid", "decoder_accepted_invalid", "decoder_rejected_valid")


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path):
    return build_target(str(tiny_model_dir))


@pytest.fixture(scope="module")
def quick(target) -> dict:
    return run_fuzz(cases=2000, seed=1, repeats=1, slowest=5, memory_every=10, seeds_n=400, target=target)


def test_quick_fuzz_finds_no_error_and_admits_nothing_invalid(quick: dict) -> None:
    for key in MUST_HOLD:
        assert quick[key] == 0, (key, quick["examples"].get(key))
    assert quick["cases"] == 2000 and quick["hostile_cases"] == len(quick["hostile"])


def test_quick_fuzz_reaches_every_stage(quick: dict) -> None:
    # Every mutation was drawn, the decoder rejected for many reasons, and a fair share of
    # the cases got through to admission's own checks and were admitted.
    assert set(quick["mutations"]) == set(_MUTATIONS)
    codes = {k for k in quick["outcomes"] if k != "accepted"}
    assert len(codes) >= 10, codes
    assert quick["outcomes"].get("accepted", 0) >= 200
    assert quick["admitted_cases"] >= 100
    assert {"stale", "wrong_swarm", "sender_mismatch"} & set(quick["admission_rejections"])


def test_quick_fuzz_decode_memory_is_bounded(quick: dict) -> None:
    assert quick["worst_decode_mib"] <= 32
    assert quick["worst_reject_mib"] is not None and quick["worst_reject_mib"] <= quick["goal_reject_mib"]
    for name, h in quick["hostile"].items():
        assert (h["outcome"] == "accepted") == (name == "max_tokens_valid"), (name, h["outcome"])
        assert h["decode_mib"] <= 32 and h["decode_s"] > 0


def test_quick_fuzz_admits_nothing_this_node_cannot_train_on(quick: dict) -> None:
    assert quick["admitted_unsafe"] == 0, quick["unsafe_rules"]


def test_a_foreign_group_at_a_vanishing_temperature_is_not_admitted_with_a_nan_weight(target) -> None:
    rng = random.Random(7)
    kind = ""
    while kind != "foreign_tokenizer":
        kind, packet = make_seed(target.ctx, rng)
    groups = [
        g.model_copy(update={"sampling": g.sampling.model_copy(update={"temperature": 1e-200})}) for g in packet.groups
    ]
    data = encode(packet.model_copy(update={"groups": groups}))
    admitted = target.admission.admit(PEER, data, ROUND)
    weights = [s.seq_weight for g in admitted.groups for s in g.sequences]
    assert all(0.8 < w <= 1.0 for w in weights), weights


def test_every_seed_is_valid_by_the_reference_reader(target) -> None:
    rng = random.Random(3)
    kinds = set()
    for _ in range(200):
        kind, packet = make_seed(target.ctx, rng)
        kinds.add(kind)
        for compress in (False, True):
            data = encode(packet, compress=compress)
            assert spec_violation(data, target.ctx.limits) is None
            assert decode(data, target.ctx.limits).num_completions == packet.num_completions
    assert kinds == {"own_tokenizer", "foreign_tokenizer", "past_node_limits"}


def test_the_reference_reader_rejects_every_hostile_packet(target) -> None:
    for name, data in hostile_cases(target.ctx).items():
        if spec_is_cheap(data) or name.startswith("max_tokens"):  # the others build millions of objects
            assert (spec_violation(data, target.ctx.limits) is None) == (name == "max_tokens_valid"), name


def _admitted_seed(target, rng: random.Random):
    """A seed with our tokenizer that admission takes, as decoded, and what admission made of it."""
    while True:
        kind, packet = make_seed(target.ctx, rng)
        if kind != "own_tokenizer":
            continue
        data = encode(packet)
        admitted = target.admission.admit(PEER, data, ROUND)
        if admitted.groups and len(admitted.groups[0].sequences) >= 2:
            return decode(data), admitted


def test_admission_oracle_flags_each_broken_rule(target) -> None:
    packet, admitted = _admitted_seed(target, random.Random(5))
    check = lambda a: admission_violations(target.admission, PEER, ROUND, packet, a)  # noqa: E731
    assert check(admitted) == []
    group = admitted.groups[0]
    seq = group.sequences[0]

    def tampered(**change) -> Admitted:
        g = ScoredGroup(**{**{f: getattr(group, f) for f in group.__dataclass_fields__}, "sequences": []})
        s = ScoredSequence(**{f: getattr(seq, f) for f in seq.__dataclass_fields__})
        for key, value in change.items():
            setattr(g if hasattr(g, key) and key != "sequences" else s, key, value)
        g.sequences = [s, *group.sequences[1:]]
        return Admitted(peer_id=PEER, groups=[g])

    assert "reward_not_rescored" in check(tampered(reward=1.0 - seq.reward))
    assert "sequence_not_in_group" in check(tampered(completion_ids=[*seq.completion_ids, 3]))
    assert "sequence_not_in_group" in check(tampered(logp_gen=seq.logp_gen - 1.0))
    assert "prompt_not_ours" in check(tampered(prompt_ids=[*group.prompt_ids, 3]))
    assert "group_not_in_packet" in check(tampered(task_id="toy/id/0" if group.task_id != "toy/id/0" else "toy/id/1"))
    assert "token_path_weight" in check(tampered(seq_weight=0.5))
    small = Admitted(peer_id=PEER, groups=[ScoredGroup(**{**vars_of(group), "sequences": group.sequences[:1]})])
    assert "group_too_small" in check(small)
    for field, value, rule in (
        ("sender_peer_id", "QmOther", "sender"),
        ("swarm_id", "other", "swarm"),
        ("round", ROUND - 10, "stale"),
    ):
        other = packet.model_copy(update={"header": packet.header.model_copy(update={field: value})})
        assert rule in admission_violations(target.admission, PEER, ROUND, other, admitted)


def vars_of(group: ScoredGroup) -> dict:
    return {f: getattr(group, f) for f in group.__dataclass_fields__}


def test_unsafe_oracle_flags_each_rule(target) -> None:
    packet, admitted = _admitted_seed(target, random.Random(6))
    c = target.ctx
    check = lambda a, p=packet: unsafe_violations(  # noqa: E731
        a, p, c.fingerprint, c.vocab_size, c.max_positions, target.group_logprobs
    )
    assert check(admitted) == []
    group = admitted.groups[0]

    def with_sequence(ids: list[int], **group_change) -> Admitted:
        seq = ScoredSequence(ids, np.zeros(len(ids), np.float32), 0.0)
        return Admitted(peer_id=PEER, groups=[ScoredGroup(**{**vars_of(group), **group_change, "sequences": [seq]})])

    assert check(with_sequence([])) == ["empty_completion"]
    assert check(with_sequence([c.vocab_size])) == ["token_id_past_vocab"]
    assert check(with_sequence([5] * c.max_positions)) == ["past_positions"]
    extreme = check(with_sequence([5, 6], temperature=1e-300))
    assert extreme and set(extreme) <= {"nonfinite_local_logprobs", "local_logprobs_raise"}
    bigger_vocab = packet.model_copy(update={"header": packet.header.model_copy(update={"vocab_size": 100_000})})
    assert check(admitted, bigger_vocab) == ["header_vocab_differs"]


def test_bench_fuzz_command(tiny_model_dir: Path) -> None:
    from node.console.cli import app

    result = CliRunner().invoke(
        app,
        ["bench", "fuzz", "--cases", "30", "--seed", "2", "--model", str(tiny_model_dir), "--repeats", "1", "--json"],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout[result.stdout.index("{") :])
    assert doc["cases"] == 30 and doc["non_protocol_errors"] == 0 and doc["admitted_invalid"] == 0


@pytest.mark.slow
def test_full_fuzz_100k(target) -> None:
    result = run_fuzz(cases=100_000, seed=0, target=target)
    for key in MUST_HOLD:
        assert result[key] == 0, (key, result["examples"].get(key))
    assert result["worst_decode_mib"] <= 32 and result["worst_reject_mib"] <= 32


def test_the_oracle_allows_exactly_the_tail_cut():
    """Admission may cut a peer's completion right after `</answer>` (and an EOS right after it):
    the oracle accepts that prefix, and no other."""
    from node.bench.fuzz_oracle import _kept_prefix
    from node.models import load_model

    _, tok = load_model("tiny-s")
    head = tok("<answer>19</answer>", add_special_tokens=False)["input_ids"]
    full = tok("<answer>19</answer>IG", add_special_tokens=False)["input_ids"]
    cut = next(n for n in range(1, len(full) + 1) if "</answer>" in tok.decode(full[:n]))
    assert full[:cut] == head[:cut] and cut < len(full)
    assert _kept_prefix(tok, full, full) and _kept_prefix(tok, full[:cut], full)
    assert not _kept_prefix(tok, full[: cut - 1], full)  # the tag itself cut
    assert not _kept_prefix(tok, full[: cut + 1], full)  # a tail token kept
    with_eos = [*full[:cut], tok.eos_token_id, *full[cut:]]
    assert _kept_prefix(tok, with_eos[: cut + 1], with_eos)  # the EOS after the tag stays
