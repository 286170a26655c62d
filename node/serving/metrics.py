"""Prometheus metrics of one node, built from its status snapshot at scrape time.

    GET /metrics   text exposition format, every name prefixed `ftis_`

Nothing is counted twice: a collector reads `NodeStatus.snapshot()` on each scrape, so
`/metrics` and `/status` always agree. Each node has its own `CollectorRegistry` (several
nodes may share a process, as in the tests and `ftis-node experiment`).

Peer ids label the per-peer series. They come from the network, so their number is
bounded: the `max_peers` peers with the most samples admitted (then the most rejections)
keep their own label; the rest are summed into `peer="other"` for counters and left out
of gauges, which do not add up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from node.serving.status import NodeStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER = "other"  # the label of peers past the cardinality bound
UNATTRIBUTED = "none"  # rejections no peer could be named for (e.g. unparseable records)
DEFAULT_MAX_PEERS = 20
PHASES = (
    "starting",
    "joining swarm",
    "loading model",
    "ready",
    "waiting for round",
    "generating",
    "publishing",
    "gathering",
    "training",
    "checkpointing",
    "serving last packet",
    "stopping",
    "stopped",
)
TRUST_STATES = ("probation", "trusted", "quarantined")
# (metric suffix, key in a peer's `offpolicy` dict, help)
PEER_OFFPOLICY = (
    ("is_weight_mean", "is_weight_mean", "Mean truncated IS weight min(pi/pi_gen, C) of the peer's tokens"),
    ("is_frac_capped", "frac_capped", "Fraction of the peer's tokens whose IS weight was capped at C"),
    ("ess", "ess", "Effective sample size 1/mean(w^2) of the peer's tokens"),
    ("frac_filtered", "frac_filtered", "Fraction of the peer's sequences the KL filter dropped"),
    ("mean_abs_delta", "mean_abs_delta", "Mean |logp_local - logp_gen| over the peer's tokens"),
)
# (metric suffix, key in the last round's metrics, help): the whole batch of the last step.
TRAIN_METRICS = (
    ("loss", "loss", "F-TIS loss of the last step"),
    ("grad_norm", "grad_norm", "Gradient norm of the last step (before clipping)"),
    ("is_weight_mean", "is_weight_mean", "Mean truncated IS weight over the last batch"),
    ("is_frac_capped", "frac_capped", "Fraction of the last batch's tokens whose IS weight was capped at C"),
    ("ess", "ess", "Effective sample size 1/mean(w^2) over the last batch"),
    ("frac_filtered", "frac_filtered", "Fraction of the last batch's sequences the KL filter dropped"),
    ("tokens", "tokens", "Completion tokens in the last batch"),
)
KL_QUANTILES = (("0.1", "kl_p10"), ("0.5", "kl_p50"), ("0.9", "kl_p90"))


def top_peers(peers: dict[str, dict[str, Any]], max_peers: int) -> set[str]:
    """The peers that keep their own label: most samples admitted, then most rejections, then id."""

    def weight(pid: str) -> tuple[int, int, str]:
        p = peers[pid]
        return (-int(p.get("samples_admitted") or 0), -sum((p.get("rejected") or {}).values()), pid)

    return set(sorted(peers, key=weight)[:max_peers])


class StatusCollector(Collector):
    """Turns one snapshot into metric families; registered in a node's own registry."""

    def __init__(self, status: NodeStatus, max_peers: int = DEFAULT_MAX_PEERS) -> None:
        if max_peers < 1:
            raise ValueError("max_peers must be >= 1")
        self.status, self.max_peers = status, max_peers

    def collect(self) -> Iterator[Metric]:
        s = self.status.snapshot()
        yield from _node_metrics(s)
        yield from _round_metrics(s.get("last_round") or {})
        yield from peer_families(s, self.max_peers)


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> Iterator[Metric]:
    if value is None:
        return
    g = GaugeMetricFamily(f"ftis_{name}", doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), float(value))
    yield g


def _node_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    info = InfoMetricFamily("ftis_node", "The node's name, model, task and loss")
    info.add_metric([], {k: str(s.get(k) or "") for k in ("name", "model", "task", "loss", "peer_id")})
    yield info
    phase = GaugeMetricFamily("ftis_phase", "1 for the phase the round loop is in", labels=["phase"])
    for name in dict.fromkeys((*PHASES, s["phase"])):
        phase.add_metric([name], 1.0 if name == s["phase"] else 0.0)
    yield phase
    yield from _gauge("round", "Current round: the DHT time bucket (the local round number when solo)", s["round"])
    yield from _gauge("round_in_run", "Rounds counted from the start of this run", s.get("round_in_run"))
    rounds = CounterMetricFamily("ftis_rounds_done", "Rounds finished by this run")
    rounds.add_metric([], s["rounds_done"])
    yield rounds
    yield from _gauge("uptime_seconds", "Seconds since the node started", s["uptime_s"])
    totals = s.get("totals") or {}
    own = CounterMetricFamily("ftis_own_samples", "Own samples generated and scored")
    own.add_metric([], totals.get("own_samples", 0))
    yield own
    published = CounterMetricFamily("ftis_packet_bytes_published", "Bytes of own packets published to the swarm")
    published.add_metric([], totals.get("bytes_published", 0))
    yield published
    read = CounterMetricFamily("ftis_packet_bytes_read", "Bytes of peers' packets read from the swarm")
    read.add_metric([], totals.get("bytes_read", 0))
    yield read
    errors = CounterMetricFamily("ftis_dht_errors", "This node's own DHT trouble, by kind", labels=["kind"])
    for kind, count in sorted((s.get("swarm_errors") or {}).items()):
        errors.add_metric([kind], count)
    yield errors
    failures = s.get("failures") or {}
    network = CounterMetricFamily(
        "ftis_network_failures",
        "Fetches and DHT calls that did not complete, by kind (the link, not the peer's content)",
        labels=["kind"],
    )
    for kind, count in sorted((failures.get("network") or {}).items()):
        network.add_metric([kind], count)
    yield network
    content = CounterMetricFamily(
        "ftis_content_rejected",
        "Things peers sent that were judged and refused, by reason (all peers)",
        labels=["reason"],
    )
    for reason, count in sorted((failures.get("content") or {}).items()):
        content.add_metric([reason], count)
    yield content
    yield from _gauge(
        "swarm_known_peers", "Peers the swarm layer saw publish in the last few rounds", s.get("swarm_size")
    )


def _round_metrics(last: dict[str, Any]) -> Iterator[Metric]:
    """Gauges of the last finished round."""
    if not last:
        return
    m = last.get("metrics") or {}
    yield from _gauge("reward_mean", "Mean reward of own samples in the last round", last.get("reward_mean"))
    yield from _gauge("round_duration_seconds", "Wall time of the last round", last.get("seconds"))
    yield from _gauge(
        "gather_duration_seconds", "Time the last round spent gathering peers' packets", last.get("gather_seconds")
    )
    yield from _gauge("step_duration_seconds", "Time of the last training step", m.get("seconds"))
    yield from _gauge("peers_answered", "Peers whose packets arrived in the last round", last.get("peers_answered"))
    yield from _gauge("round_peer_samples", "Peers' samples trained on in the last round", last.get("peer_samples"))
    for suffix, key, doc in TRAIN_METRICS:
        yield from _gauge(f"train_{suffix}", doc, m.get(key))
    kl = GaugeMetricFamily("ftis_train_kl", "Quantiles of kl_i over the last batch", labels=["quantile"])
    for q, key in KL_QUANTILES:
        if key in m:
            kl.add_metric([q], float(m[key]))
    yield kl


def peer_families(s: dict[str, Any], max_peers: int) -> Iterator[Metric]:
    """Per-peer families from a snapshot: counters with a bounded peer label, gauges of the kept peers."""
    peers: dict[str, dict[str, Any]] = s["peers"]
    keep = top_peers(peers, max_peers)

    def label(pid: str) -> str:
        return pid if pid in keep else OTHER

    counters = {
        "packets": CounterMetricFamily("ftis_peer_packets", "Packets received, by peer", labels=["peer"]),
        "samples_admitted": CounterMetricFamily(
            "ftis_peer_samples_admitted", "Peers' samples admitted, by peer", labels=["peer"]
        ),
        "samples_used": CounterMetricFamily(
            "ftis_peer_samples_used", "Peers' samples trained on, by peer", labels=["peer"]
        ),
    }
    sums: dict[str, dict[str, float]] = {k: {} for k in counters}
    rejected: dict[tuple[str, str], float] = {}
    screened: dict[tuple[str, str], float] = {}
    for pid, p in peers.items():
        for key in counters:
            sums[key][label(pid)] = sums[key].get(label(pid), 0) + (p.get(key) or 0)
        for reason, count in (p.get("rejected") or {}).items():
            rejected[(reason, label(pid))] = rejected.get((reason, label(pid)), 0) + count
        for reason, count in (p.get("screened") or {}).items():
            screened[(reason, label(pid))] = screened.get((reason, label(pid)), 0) + count
    for reason, total in (s.get("rejected") or {}).items():  # what no peer could be named for
        attributed = sum(c for (r, _), c in rejected.items() if r == reason)
        if total > attributed:
            rejected[(reason, UNATTRIBUTED)] = total - attributed
    for key, family in counters.items():
        for peer, value in sorted(sums[key].items()):
            family.add_metric([peer], value)
        yield family
    rej = CounterMetricFamily("ftis_rejected", "Things rejected, by reason and peer", labels=["reason", "peer"])
    for (reason, peer), count in sorted(rejected.items()):
        rej.add_metric([reason, peer], count)
    yield rej
    scr = CounterMetricFamily(
        "ftis_screened", "Peers' samples screened out, by reason and peer", labels=["reason", "peer"]
    )
    for (reason, peer), count in sorted(screened.items()):
        scr.add_metric([reason, peer], count)
    yield scr

    # Gauges: only the peers that keep their own label.
    kept = sorted(pid for pid in peers if pid in keep)
    reward = GaugeMetricFamily(
        "ftis_peer_reward_mean", "Mean reward of the peer's last admitted samples, re-scored here", labels=["peer"]
    )
    seen = GaugeMetricFamily(
        "ftis_peer_last_seen_timestamp_seconds", "When the peer's last packet arrived", labels=["peer"]
    )
    trust = GaugeMetricFamily("ftis_peer_trust", "1 for the peer's trust state", labels=["peer", "state"])
    for pid in kept:
        p = peers[pid]
        if p.get("reward_mean") is not None:
            reward.add_metric([pid], float(p["reward_mean"]))
        if p.get("last_seen") is not None:
            seen.add_metric([pid], float(p["last_seen"]))
        if p.get("trust"):
            for state in dict.fromkeys((*TRUST_STATES, p["trust"])):
                trust.add_metric([pid, state], 1.0 if state == p["trust"] else 0.0)
    # A peer's name and model as labels of an info series, not of every series: a name can change,
    # and a label that changes would start a new series (join on `peer` to show names).
    info = InfoMetricFamily("ftis_peer", "A peer's --name and model, as its newest packet claims", labels=["peer"])
    for pid in kept:
        info.add_metric([pid], {"name": str(peers[pid].get("name") or ""), "model": str(peers[pid].get("model") or "")})
    yield from (reward, seen, trust, info)
    for suffix, key, doc in PEER_OFFPOLICY:
        gauge = GaugeMetricFamily(f"ftis_peer_{suffix}", doc + " (last step that used them)", labels=["peer"])
        for pid in kept:
            reading = (peers[pid].get("offpolicy") or {}).get(key)
            if isinstance(reading, (int, float)):
                gauge.add_metric([pid], float(reading))
        yield gauge
    kl = GaugeMetricFamily("ftis_peer_kl", "Quantiles of kl_i over the peer's sequences", labels=["peer", "quantile"])
    for pid in kept:
        offpolicy = peers[pid].get("offpolicy") or {}
        for q, key in KL_QUANTILES:
            if isinstance(offpolicy.get(key), (int, float)):
                kl.add_metric([pid, q], float(offpolicy[key]))
    yield kl


class NodeMetrics:
    """A node's own registry with its status collector; `render()` is the /metrics body."""

    def __init__(self, status: NodeStatus, max_peers: int = DEFAULT_MAX_PEERS) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(status, max_peers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
