"""Per-peer trust: probation for new ids, quarantine for peers whose samples keep being screened."""

from __future__ import annotations

from collections import Counter

from node.defence.trust import TrustBook, TrustConfig

CFG = TrustConfig(
    probation_rounds=3,
    clean_fraction=0.1,
    quarantine_fraction=0.25,
    quarantine_after=2,
    quarantine_rounds=5,
    trust_groups=6,
)


def play(
    book: TrustBook, peer: str, r: int, offered: int, screened: int, reason: str = "implausible", used: int = 2
) -> None:
    """One round: `peer` offers samples, `screened` are dropped, `used` of its groups are trained on."""
    book.observe(peer, r, offered, Counter({reason: screened}) if screened else Counter())
    book.credit(peer, used)
    book.end_round(r)


def test_a_new_peer_is_trusted_after_clean_rounds_and_demoted_by_a_bad_one():
    book = TrustBook(CFG)
    for r in range(2):
        play(book, "p", r, 100, 5)
        assert book.get("p").state == "probation" and "p" not in book.trusted()
    book.end_round(2)  # a round it sent nothing in changes nothing
    play(book, "p", 3, 100, 10)  # exactly at clean_fraction: still clean
    assert book.get("p").state == "trusted" and book.trusted() == {"p"}
    play(book, "p", 4, 100, 30)
    assert book.get("p").state == "probation" and "30%" in book.get("p").reason
    assert book.get("p").groups_used == 0  # trust is earned again, by volume as well


def test_clean_rounds_alone_do_not_make_a_peer_trusted_the_groups_trained_on_do():
    """The probation share is one pool: five identities filling it take five times longer each."""
    book = TrustBook(CFG)
    for r in range(10):
        play(book, "idle", r, 100, 0, used=0)  # clean, but never in a batch (trusted peers filled it)
    assert book.get("idle").state == "probation" and "0 of 6 groups" in book.get("idle").reason
    sybils = [f"s{i}" for i in range(5)]
    trusted_at: dict[str, int] = {}
    for r in range(40):
        for i, s in enumerate(sybils):  # one probation group a round, handed round-robin
            book.observe(s, r, 8, Counter())
            book.credit(s, int(r % 5 == i))
        book.end_round(r)
        trusted_at |= {s: r for s in sybils if s not in trusted_at and book.get(s).state == "trusted"}
    assert min(trusted_at.values()) >= 25 and len(trusted_at) == 5
    lone = TrustBook(CFG)
    for r in range(10):
        play(lone, "joiner", r, 8, 0, used=1)
        if lone.get("joiner").state == "trusted":
            break
    assert r == 5  # one group a round: trusted after its 6th


def test_a_peer_screened_above_the_threshold_twice_is_quarantined_for_a_while():
    book = TrustBook(CFG)
    play(book, "evil", 0, 100, 50)
    assert book.get("evil").state == "probation" and book.quarantine_reason("evil", 1) is None
    play(book, "evil", 1, 100, 50)
    peer = book.get("evil")
    assert peer.state == "quarantined" and peer.quarantined_until == 7
    assert book.quarantined(2) == {"evil"} and "implausible" in book.quarantine_reason("evil", 2)
    assert book.get("evil").screened == {"implausible": 100}
    for r in range(2, 6):
        book.end_round(r)
        assert book.get("evil").state == "quarantined"
    book.end_round(6)
    assert book.get("evil").state == "probation" and book.quarantine_reason("evil", 7) is None
    assert "evil" not in book.quarantined(7)


def test_only_hostile_reasons_count_and_packet_level_lies_count_as_one():
    book = TrustBook(CFG)
    book.observe("p", 0, 10, Counter({"stale": 10, "foreign_task": 10}))
    book.end_round(0)
    assert book.get("p").bad_rounds == 0 and book.get("p").clean_rounds == 1
    for r in (1, 2):
        book.observe("q", r, 0, Counter({"impersonation": 1}))  # rejected from its header: one unit
        book.end_round(r)
    assert book.get("q").state == "quarantined"


def test_no_probation_trusts_at_once():
    book = TrustBook(TrustConfig(probation_rounds=0))
    book.observe("p", 0, 10, Counter())
    assert book.trusted() == {"p"}


def test_five_clean_sybils_take_a_small_share_of_peer_samples_where_rounds_alone_let_them_take_most():
    """The node's own mix and trust, at its default batch, against 5 identities sending clean samples."""
    from node.bench.sybil import measure_share_capture

    for honest_groups in (8, 4):  # an honest peer that fills the peer budget, one that leaves room
        runs = [measure_share_capture(honest_groups=honest_groups, seed=s) for s in range(3)]
        assert max(r["sybil_share_of_peer_samples"] for r in runs) <= 0.25, runs
    rounds_only = measure_share_capture(honest_groups=4, trust=TrustConfig(trust_groups=0))
    assert rounds_only["sybil_share_of_peer_samples"] > 0.6 and rounds_only["sybils_trusted_at_round"] == 2
