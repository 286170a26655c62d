"""NodeStatus: what the loop notes during a round lands in that round's record, and only there."""

from __future__ import annotations

from node.serving.status import NodeStatus, RoundRecord
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


def _record(status: NodeStatus, r: int) -> None:
    status.record_round(
        RoundRecord(round=r, started_at=0, seconds=1, reward_mean=0, own_samples=1, peer_samples=0, peers_answered=0),
        adapter_version=None,
    )


def test_network_failures_are_counted_per_kind_apart_from_content_rejections():
    status = NodeStatus(name="n", model="m", task="t", loss="f-tis")
    status.reject(PEER_M, "fetch_timeout", count=2)
    status.reject(PEER_L, "impersonation")
    status.swarm_error("dht_timeout")
    _record(status, 0)
    status.reject(PEER_M, "fetch_timeout")
    _record(status, 1)
    _record(status, 2)  # a round with no failure at all
    history = status.history_dump()
    assert [r["network_failures"] for r in history] == [
        {"fetch_timeout": 2, "dht_timeout": 1},
        {"fetch_timeout": 1},
        {},
    ]
    failures = status.snapshot()["failures"]
    assert failures["network"] == {"fetch_timeout": 3, "dht_timeout": 1}
    assert failures["content"] == {"impersonation": 1}
    assert failures["network_per_round"] == {"fetch_timeout": 1.0, "dht_timeout": 0.333}
    # The console's lines name what failed in the last round: none after round 2 ...
    assert status.failure_lines() == []
    status.reject(PEER_M, "fetch_failed")
    status.reject(PEER_L, "bad_record", count=4)
    _record(status, 3)
    # ... each kind after round 3, with the run's total and its rate (never "logged once").
    assert status.failure_lines() == [
        "network failures: fetch_failed 1 (run 1, 0.25/round)",
        "rejected: bad_record 4 (run 4, 1/round)",
    ]


def test_swarm_size_counts_only_peers_that_published_recently():
    status = NodeStatus(name="n", model="m", task="t", loss="f-tis")
    peers = [{"peer_id": f"Qm{i}", "round": r} for i, r in enumerate((100, 99, 97, 90))]
    status.set_swarm_peers(peers, current_round=100)
    assert status.snapshot()["swarm_size"] == 2  # 97 and 90 stopped publishing 3+ rounds ago
    assert [p["active"] for p in status.swarm_dump()["peers"]] == [True, True, False, False]
    status.set_swarm_peers(peers, current_round=103)  # the bootstrap and the rest went quiet
    assert status.snapshot()["swarm_size"] == 0


def test_phase_seconds_add_up_per_phase_since_the_last_round():
    status = NodeStatus(name="n", model="m", task="t", loss="f-tis")
    status.set_phase("generating", 5)
    status.phase_since -= 3.0  # three seconds of generating, without sleeping through them
    status.set_phase("gathering", 5)
    status.phase_since -= 1.0
    spent = status.phase_seconds()
    assert 2.9 < spent["generating"] < 3.5 and 0.9 < spent["gathering"] < 1.5
    _record(status, 5)
    assert status.phase_seconds().get("generating", 0.0) == 0.0  # a new round starts from zero


def test_a_status_file_whose_node_is_gone_reads_as_stopped(tmp_path):
    import json
    import subprocess
    import sys

    from node.serving.status import read_status_file

    status = fill_status(NodeStatus(name="n", model="m", task="t", loss="f-tis"), rounds=2)
    status.set_phase("loading weights", 1001)
    path = tmp_path / "status.json"
    path.write_text(status.file_text())
    live = read_status_file(path)  # written by this process, which runs
    assert live["running"] is True and live["phase"] == "loading weights" and len(live["history"]) == 2
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    data = json.loads(path.read_text()) | {"pid": dead.pid}
    path.write_text(json.dumps(data))
    gone = read_status_file(path)
    assert gone["running"] is False and gone["phase"] == "stopped" and gone["phase_at_exit"] == "loading weights"
    # A pid reused by another process is not the node: its start time differs.
    path.write_text(json.dumps(data | {"pid": 1}))
    assert read_status_file(path)["phase"] == "stopped"
