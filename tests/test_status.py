"""NodeStatus: what the loop notes during a round lands in that round's record, and only there."""

from __future__ import annotations

from node.status import NodeStatus, RoundRecord
from tests.observed import MARKUP, PEER_L, PEER_M, fill_status


def test_each_round_record_holds_what_was_noted_during_it():
    status = fill_status(NodeStatus(name="n", model="tiny-s", task="toy", loss="f-tis"), rounds=3)
    history = status.history_dump()
    assert [r["round_in_run"] for r in history] == [1, 2, 3]
    assert [r["round"] for r in history] == [1000, 1001, 1002]
    assert [r["bytes_published"] for r in history] == [1000, 1001, 1002]
    assert [r["bytes_read"] for r in history] == [2000, 2010, 2020]
    assert [r["gather_seconds"] for r in history] == [0.5, 1.5, 2.5]
    assert [r["dht_errors"] for r in history] == [0, 1, 0]
    for r in history:
        assert r["rejected"] == {"bad_record": 1, "foreign_task": 2}
        m, big = r["peers"][PEER_M], r["peers"][PEER_L]
        assert (m["admitted"], m["used"], m["rejected"], m["reward_mean"]) == (8, 4, 0, 0.25)
        assert (big["admitted"], big["used"], big["rejected"], big["reward_mean"]) == (8, 4, 2, 0.75)
        assert set(m["offpolicy"]) == {
            "is_weight_mean",
            "frac_capped",
            "ess",
            "frac_filtered",
            "kl_p10",
            "kl_p50",
            "kl_p90",
        }
    assert history[2]["peers"][PEER_M]["offpolicy"]["is_weight_mean"] == 0.92
    s = status.snapshot()
    assert s["rounds_done"] == 3 and s["totals"] == {"own_samples": 48, "bytes_published": 3003, "bytes_read": 6030}
    assert s["peers"][PEER_M]["model"] == "tiny-m" and s["peers"][PEER_M]["adapter_version"] == "v2"
    assert s["peers"][PEER_L]["reward_mean"] == 0.75
    assert MARKUP in s["rejected_examples"]["foreign_task"]


def test_rounds_done_counts_past_the_bounded_history():
    status = NodeStatus(name="n", model="m", task="t", loss="f-tis", history=2)
    for r in range(5):
        status.record_round(
            RoundRecord(
                round=r, started_at=0, seconds=1, reward_mean=0, own_samples=1, peer_samples=0, peers_answered=0
            ),
            adapter_version=None,
        )
    assert status.snapshot()["rounds_done"] == 5
    assert [r["round_in_run"] for r in status.history_dump()] == [4, 5]


def test_swarm_view_is_the_swarm_layers_list_once_pushed():
    status = fill_status(NodeStatus(name="n", model="m", task="t", loss="f-tis"), rounds=1)
    heard = status.swarm_dump()
    assert heard["source"] == "gathered"
    assert {p["peer_id"]: p["model"] for p in heard["peers"]} == {PEER_M: "tiny-m", PEER_L: "tiny-l"}
    known = [{"peer_id": "Qm1", "model": "qwen", "adapter_version": "a", "round": 7, "size": 100, "last_seen": 1.0}]
    status.set_swarm_peers(known)
    view = status.swarm_dump()
    assert view["source"] == "dht" and view["peers"] == known and view["updated_at"] is not None
    assert status.snapshot()["swarm_size"] == 1
