"""GET /metrics: Prometheus text that a Prometheus parser reads, with the values /status shows."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.serving.api import ApiServer
from node.serving.metrics import OTHER, UNATTRIBUTED, NodeMetrics, peer_families
from node.serving.status import NodeStatus
from tests.observed import PEER_L, PEER_M, PEER_NAMES, fill_status


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of every sample in an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scraped, name: str, **labels: str) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


@pytest.fixture()
def node():
    status = fill_status(NodeStatus(name="n1", model="tiny-s", task="toy", loss="f-tis"), rounds=3)
    server = ApiServer(status, host="127.0.0.1", port=0).start()
    yield status, server
    server.stop()


def test_metrics_agree_with_status(node):
    _, server = node
    with httpx.Client(base_url=server.url, timeout=5) as client:
        response = client.get("/metrics")
        s = client.get("/status").json()
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    m = samples(response.text)
    assert all(name.startswith("ftis_") for name, _ in m)
    last = s["last_round"]

    assert value(m, "ftis_round") == s["round"] == 1003
    assert value(m, "ftis_rounds_done_total") == s["rounds_done"] == 3
    assert value(m, "ftis_round_in_run") == s["round_in_run"] == 4
    assert value(m, "ftis_phase", phase="generating") == 1 and value(m, "ftis_phase", phase="training") == 0
    assert value(m, "ftis_reward_mean") == pytest.approx(last["reward_mean"])
    assert value(m, "ftis_own_samples_total") == s["totals"]["own_samples"] == 48
    assert value(m, "ftis_packet_bytes_published_total") == s["totals"]["bytes_published"] == 1000 + 1001 + 1002
    assert value(m, "ftis_packet_bytes_read_total") == s["totals"]["bytes_read"] == 2000 + 2010 + 2020
    assert value(m, "ftis_dht_errors_total", kind="dht_timeout") == s["swarm_errors"]["dht_timeout"] == 1
    assert value(m, "ftis_gather_duration_seconds") == pytest.approx(last["gather_seconds"]) == 2.5
    assert value(m, "ftis_step_duration_seconds") == pytest.approx(last["metrics"]["seconds"])
    for key, metric in [
        ("is_weight_mean", "ftis_train_is_weight_mean"),
        ("ess", "ftis_train_ess"),
        ("frac_capped", "ftis_train_is_frac_capped"),
        ("frac_filtered", "ftis_train_frac_filtered"),
    ]:
        assert value(m, metric) == pytest.approx(last["metrics"][key])
    assert value(m, "ftis_train_kl", quantile="0.9") == pytest.approx(last["metrics"]["kl_p90"])

    for pid in (PEER_M, PEER_L):
        peer = s["peers"][pid]
        assert value(m, "ftis_peer_samples_admitted_total", peer=pid) == peer["samples_admitted"] == 24
        assert value(m, "ftis_peer_samples_used_total", peer=pid) == peer["samples_used"] == 12
        assert value(m, "ftis_peer_reward_mean", peer=pid) == pytest.approx(peer["reward_mean"])
        assert value(m, "ftis_peer_is_weight_mean", peer=pid) == pytest.approx(peer["offpolicy"]["is_weight_mean"])
        assert value(m, "ftis_peer_ess", peer=pid) == pytest.approx(peer["offpolicy"]["ess"])
        assert value(m, "ftis_peer_frac_filtered", peer=pid) == pytest.approx(peer["offpolicy"]["frac_filtered"])
        assert value(m, "ftis_peer_kl", peer=pid, quantile="0.5") == pytest.approx(peer["offpolicy"]["kl_p50"])
        assert value(m, "ftis_peer_is_frac_capped", peer=pid) == pytest.approx(peer["offpolicy"]["frac_capped"])
        assert value(m, "ftis_peer_trust", peer=pid, state=peer["trust"]) == 1
        # The name its packets carry, escaped by the exposition and read back intact.
        info = ("ftis_peer_info", tuple(sorted({"peer": pid, "name": PEER_NAMES[pid], "model": peer["model"]}.items())))
        assert m[info] == 1
    assert (
        value(m, "ftis_screened_total", reason="implausible", peer=PEER_M)
        == s["peers"][PEER_M]["screened"]["implausible"]
        == 3
    )
    assert (
        value(m, "ftis_rejected_total", reason="foreign_task", peer=PEER_L)
        == s["peers"][PEER_L]["rejected"]["foreign_task"]
        == 6
    )
    # Rejections no peer could be named for keep their own label, so the reason's total adds up.
    assert value(m, "ftis_rejected_total", reason="bad_record", peer=UNATTRIBUTED) == s["rejected"]["bad_record"] == 3


def test_peer_labels_are_bounded_and_counters_still_add_up():
    status = NodeStatus(name="n", model="m", task="t", loss="f-tis")
    for i in range(30):
        status.peer_update(f"peer{i:02d}", packets=1, samples_admitted=i, samples_used=1)
        status.reject(f"peer{i:02d}", "stale", count=1)
    scraped = samples(NodeMetrics(status, max_peers=5).render().decode())
    peers = {dict(labels).get("peer") for name, labels in scraped if name == "ftis_peer_samples_admitted_total"}
    assert peers == {"peer29", "peer28", "peer27", "peer26", "peer25", OTHER}
    assert value(scraped, "ftis_peer_samples_admitted_total", peer=OTHER) == sum(range(25))
    assert value(scraped, "ftis_rejected_total", reason="stale", peer=OTHER) == 25
    assert sum(v for (name, _), v in scraped.items() if name == "ftis_peer_samples_used_total") == 30


def test_fields_other_parts_add_are_exported_when_present():
    """Screened samples and trust states (PeerStats fields of the screening stage), from a snapshot's data."""
    snapshot = {
        "rejected": {},
        "peers": {
            "p1": {"samples_admitted": 5, "screened": {"implausible": 3}, "trust": "quarantined", "rejected": {}},
            "p2": {"samples_admitted": 9, "screened": {"implausible": 1, "judge": 2}, "trust": "trusted"},
        },
    }
    scraped = {}
    for family in peer_families(snapshot, max_peers=10):
        for s in family.samples:
            scraped[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert value(scraped, "ftis_screened_total", reason="implausible", peer="p1") == 3
    assert value(scraped, "ftis_screened_total", reason="judge", peer="p2") == 2
    assert value(scraped, "ftis_peer_trust", peer="p1", state="quarantined") == 1
    assert value(scraped, "ftis_peer_trust", peer="p1", state="trusted") == 0


def test_two_nodes_in_one_process_have_their_own_registries():
    a = fill_status(NodeStatus(name="a", model="m", task="t", loss="f-tis"), rounds=1)
    b = fill_status(NodeStatus(name="b", model="m", task="t", loss="f-tis"), rounds=2)
    ma, mb = samples(NodeMetrics(a).render().decode()), samples(NodeMetrics(b).render().decode())
    assert value(ma, "ftis_rounds_done_total") == 1 and value(mb, "ftis_rounds_done_total") == 2
