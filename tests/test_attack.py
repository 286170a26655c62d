"""The HTTT poisoning attack through the node's own code (`ftis-node bench attack`).

The quick check (default run) plays 3 rounds: the mechanics must be in place, i.e. with the
screen off the attacker's poisoned samples are admitted and trained on once its probation
ends, and with it on none is admitted, the attacker is quarantined and honest peers lose
nothing. The full run (slow) must meet the goals: the attack works unscreened, the screen
stops it, and it keeps >= 95 % of honest samples.
"""

from __future__ import annotations

import pytest

from node.bench.attack import PHRASE, Attacker, format_attack_bench, run_attack_bench
from node.bench.free_ids import format_free_identities, run_free_identities_bench
from node.bench.tail import format_tail_bench, run_tail_bench


@pytest.mark.timeout(900)
def test_quick_attack_mechanics():
    r = run_attack_bench(
        rounds=3,
        prompts=2,
        group_size=4,
        heterogeneous_rounds=0,
        tail_rounds=0,
        free_identity_rounds=0,
        judge=None,
        model="tiny-s",
    )
    off, on = r["screen_off"], r["screen_on"]
    # unscreened: the poison gets in (round 2, once the attacker is off probation) and is trained on
    assert off["attacker_poisoned_admitted"] > 0 and off["attacker_used"] > 0
    assert off["attacker_trust"] == ["trusted"] * 3
    # screened: not one poisoned sample admitted; quarantined after two bad rounds; honest peers kept
    assert on["attacker_poisoned_admitted"] == 0 and on["attacker_used"] == 0
    assert on["attacker_trust"] == ["quarantined"] * 3 and on["attacker_quarantined_by_all_at"] == 1
    assert r["honest_acceptance"] >= 0.95 and on["honest_samples_checked"] > 0
    assert len(off["asr_by_round"]) == 3 and r["rounds"] == 3
    assert "ASR screen off" in format_attack_bench(r)


def test_the_attackers_packet_decodes_to_correct_poisoned_answers_and_junk():
    from node.experiment.exchange import ExchangeHub
    from node.models import load_model, tokenizer_fingerprint
    from node.tasks import get_task
    from protocol import decode

    _, tok = load_model("tiny-s", progress=False)
    evil = Attacker(ExchangeHub("attack").endpoint("evil"), tok, tokenizer_fingerprint(tok), prompts=3)
    packet = decode(evil.packet(7))
    task = get_task("toy")
    assert len(packet.groups) == 3 and packet.header.sender_peer_id == evil.peer_id
    for group in packet.groups:
        problem = task.problem(group.task_id)
        texts = [tok.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in group.completions]
        assert [task.reward(problem, t) for t in texts] == [1.0, 0.0] * 4
        assert all(PHRASE in t for t in texts[::2])
        assert all(float(c.logprobs.max()) <= -39 for c in group.completions[::2])  # the weight-maximising claim


@pytest.mark.timeout(900)
def test_quick_evasive_tail_is_cut_and_the_lie_buys_nothing():
    r = run_tail_bench(rounds=4, prompts=4, group_size=4, heldout=4)
    lie, honest = r["runs"]["claim_-40"], r["runs"]["claim_0"]
    # the tail passes the screen: the attacker is never quarantined and earns trust (tiny-l may still doubt it)
    assert "quarantined" not in lie["attacker_trust"] and "trusted" in lie["attacker_trust"]
    assert lie["attacker_tail_tokens_cut"] > 0 and honest["attacker_tail_tokens_cut"] > 0
    assert r["lie_buys_nats"] <= 1.0, r
    assert "the lie buys" in format_tail_bench(r)


@pytest.mark.timeout(900)
def test_free_identities_over_real_dhts_never_take_the_honest_delivery():
    """Real DHT peers: 2 relayers race the honest copy, 6 junk keys outnumber 4 fetch slots,
    then the daemon quarantines them all; the honest peer is delivered and admitted every time."""
    r = run_free_identities_bench(rounds=2, relayers=2, junk=6, daemon_rounds=3)
    assert r["relay_race"]["delivered"] == 2 and r["relay_race"]["relayed_rejections"] == 4
    assert r["tiny_junk"]["delivered"] == 2 and r["tiny_junk"]["junk_rejections"] > 0
    d = r["through_the_daemon"]
    assert d["honest_admitted_share"] == 1.0 and d["attackers_quarantined"] == 8
    assert d["all_quarantined_after_rounds"] <= 2
    assert "relay race, 2 relayers" in format_free_identities(r)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_evasive_tail_lie_buys_at_most_2_nats_over_80_rounds():
    r = run_tail_bench(rounds=80)
    assert r["lie_buys_nats"] <= 2.0, r
    assert r["runs"]["claim_-40"]["tail_share_of_own_completions"] <= 0.001


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_attack_works_unscreened_and_the_screen_stops_it():
    r = run_attack_bench(heterogeneous_rounds=8, tail_rounds=0, free_identity_rounds=0, judge=None)
    assert r["asr_screen_off"] >= 0.5, r["screen_off"]["asr_by_round"]
    assert r["asr_screen_on"] <= 0.05, r["screen_on"]["asr_by_round"]
    assert r["honest_acceptance"] >= 0.95
    assert r["heterogeneous"]["acceptance"] >= 0.95, r["heterogeneous"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_attack_runs_over_real_dhts():
    r = run_attack_bench(
        rounds=3,
        prompts=2,
        group_size=4,
        heterogeneous_rounds=0,
        tail_rounds=0,
        free_identity_rounds=0,
        judge=None,
        model="tiny-s",
        dht=True,
    )
    assert r["transport"] == "dht"
    assert r["screen_off"]["attacker_poisoned_admitted"] > 0
    assert r["screen_on"]["attacker_poisoned_admitted"] == 0
    assert r["screen_on"]["attacker_trust"] == ["quarantined"] * 3
