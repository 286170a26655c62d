"""`ftis-node bench wan`: real `ftis-node join` processes over an emulated WAN.

N nodes (tiny-m and tiny-s, alternating) run in a network namespace of our own
(`wan_net.WanNet`): each behind a delay proxy it announces, random loss on the proxied
hop. Node 0 starts the swarm, the others join through its status URL. Once every node
has played `rounds` rounds they are stopped (SIGINT), and each node's first `rounds`
rounds are read from its status.json:

- a peer packet arrived (peers answered >= 1), over the rounds after the first two;
- body fetches: delivered, timed out (fetch_timeout), failed (fetch_failed, body_not_found);
- rounds within their bucket (the round took at most round_seconds);
- peers answered per round;
- with `blocked` > 0, the last `blocked` nodes announce an address nobody can dial (a port
  where nothing listens: inbound connections are refused, as behind a NAT or a firewall);
  for each of their rounds after the first two, whether another node received their
  packet in the same round.

Also checked: no p2pd connection goes straight to a node port (`ss -tnp`, sampled during
the run: every node-to-node connection crosses a proxy), and how many segments the loss
rule dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from node.bench.wan_net import WanNet

__all__ = ["format_wan_bench", "run_wan_bench"]

WARMUP_ROUNDS = 2  # the first rounds: peers are still joining, not a network figure
_START_S = 300.0  # model load and join on a loaded machine, before the first round
_STOP_S = 120.0
_SAMPLE_S = 2.0


def _node_cmd(net: WanNet, i: int, data: Path, opts: dict[str, Any], blocked: bool = False) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "node.console.cli",
        "join",
        "--name",
        f"n{i}",
        "--model",
        "tiny-m" if i % 2 == 0 else "tiny-s",
    ]
    cmd += ["--data-dir", str(data / f"n{i}"), "--swarm-id", "wan", "--seed", str(1000 + i), "--threads", "1"]
    announce = net.unreachable(i) if blocked else net.announce(i)
    cmd += ["--host", "127.0.0.1", "--port", str(net.node_port(i)), "--announce", announce]
    cmd += ["--api-host", "127.0.0.1", "--api-port", str(net.api_port(i))]
    if i > 0:
        cmd += ["--swarm", f"http://127.0.0.1:{net.api_port(0)}", "--swarm-wait", str(_START_S)]
    for flag, value in opts.items():
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    return cmd


def _read_status(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_wan_bench(
    *,
    nodes: int = 4,
    rounds: int = 20,
    delay_ms: float = 100.0,
    jitter_ms: float = 20.0,
    loss: float = 0.02,
    round_seconds: float | None = None,
    gather_seconds: float | None = None,
    prompts_per_round: int | None = None,
    group_size: int | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    blocked: int = 0,
    blocked_flags: tuple[str, ...] = (),
    keep: Path | None = None,
    progress=None,
) -> dict[str, Any]:
    """Run the swarm over the emulated WAN and return the figures (see the module doc)."""
    if nodes < 2 or rounds < 1:
        raise ValueError("the WAN bench needs nodes >= 2 and rounds >= 1")
    if not 0 <= blocked < nodes:
        raise ValueError(f"blocked must be 0..{nodes - 1} (node 0 starts the swarm and must be reachable)")
    from node.models import model_folder, resolve_model

    for model in ("tiny-s", "tiny-m"):
        model_folder(resolve_model(model))  # built once, before the nodes race for it
    say = progress or (lambda text: None)
    opts = {
        "round_seconds": round_seconds,
        "gather_seconds": gather_seconds,
        "prompts_per_round": prompts_per_round,
        "group_size": group_size,
        "max_tokens": max_tokens,
    }
    data = Path(tempfile.mkdtemp(prefix="ftis-wan-")) if keep is None else keep
    data.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    logs = []
    conns = {"proxied_max": 0, "direct_max": 0, "samples": 0}
    crashed: dict[str, int] = {}
    try:
        with WanNet(nodes, delay_ms, jitter_ms, loss, seed=seed) as net:
            env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
            for i in range(nodes):
                log = open(data / f"n{i}.log", "w")
                logs.append(log)
                is_blocked = i >= nodes - blocked
                cmd = net.exec_prefix() + _node_cmd(net, i, data, opts, is_blocked)
                cmd += list(blocked_flags) if is_blocked else []
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            say(f"{nodes} nodes started in namespace {net.name}")
            status_files = [data / f"n{i}" / "status.json" for i in range(nodes)]
            bucket = None
            while True:
                time.sleep(_SAMPLE_S)
                statuses = [_read_status(p) for p in status_files]
                done = [int(s.get("rounds_done") or 0) for s in statuses]
                bucket = bucket or next((s.get("round_seconds") for s in statuses if s.get("round_seconds")), None)
                c = net.connections()
                conns["samples"] += 1
                conns["proxied_max"] = max(conns["proxied_max"], c["proxied"])
                conns["direct_max"] = max(conns["direct_max"], c["direct"])
                for i, p in enumerate(procs):
                    if p.poll() is not None and f"n{i}" not in crashed:
                        crashed[f"n{i}"] = p.returncode
                if min(done) >= rounds or crashed:
                    break
                limit = _START_S + rounds * (bucket or 30.0) * 3
                if time.monotonic() - started > limit:
                    crashed["hang"] = -1
                    break
                say(f"rounds done: {done}")
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for i, p in enumerate(procs):
                try:
                    p.wait(timeout=_STOP_S)
                except subprocess.TimeoutExpired:
                    crashed[f"n{i}-stop"] = -1
                    p.kill()
                    p.wait()
            loss_counts = net.loss_counts()
            net.close()
            proxy = net.proxy_stats
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    statuses = [_read_status(data / f"n{i}" / "status.json") for i in range(nodes)]
    result = _figures(statuses, rounds, bucket or 30.0)
    result["blocked"] = _blocked_reach(statuses, rounds, blocked)
    result.update(
        settings={
            "nodes": nodes,
            "rounds": rounds,
            "delay_ms": delay_ms,
            "jitter_ms": jitter_ms,
            "loss": loss,
            "blocked": blocked,
            "blocked_flags": list(blocked_flags),
            "round_seconds": bucket,
            "gather_seconds": next((s.get("gather_seconds") for s in statuses if s.get("gather_seconds")), None),
            **{k: v for k, v in opts.items() if v is not None and k not in ("round_seconds", "gather_seconds")},
        },
        connections=conns,
        loss_dropped=loss_counts,
        proxy=proxy,
        crashed=crashed,
        load_before=[round(x, 2) for x in load_before],
        load_after=[round(x, 2) for x in os.getloadavg()],
        cpu_count=os.cpu_count(),
        wall_s=round(time.monotonic() - started, 1),
        logs=str(data) if keep is not None or crashed else None,
    )
    if keep is None and not crashed:
        shutil.rmtree(data, ignore_errors=True)
    return result


def _figures(statuses: list[dict[str, Any]], rounds: int, bucket: float) -> dict[str, Any]:
    per_node = {}
    after = with_peer = in_bucket = total = 0
    ok = timeout = failed = 0
    answered: list[int] = []
    gathers: list[float] = []
    for i, s in enumerate(statuses):
        history = [h for h in s.get("history", []) if (h.get("round_in_run") or 0) <= rounds]
        node_answered = [int(h.get("peers_answered", 0)) for h in history]
        for h in history:
            rejected = h.get("rejected") or {}
            total += 1
            in_bucket += float(h.get("seconds", 0)) <= bucket
            if (h.get("round_in_run") or 0) > WARMUP_ROUNDS:
                after += 1
                with_peer += int(h.get("peers_answered", 0)) >= 1
            ok += int(h.get("peers_answered", 0))
            timeout += int(rejected.get("fetch_timeout", 0))
            failed += int(rejected.get("fetch_failed", 0)) + int(rejected.get("body_not_found", 0))
        answered += node_answered
        gathers += [float(h["gather_seconds"]) for h in history if h.get("gather_seconds") is not None]
        per_node[f"n{i}"] = {
            "model": s.get("model"),
            "rounds": len(history),
            "peers_answered": node_answered,
            "seconds": [round(float(h.get("seconds", 0)), 2) for h in history],
            "rejected": {k: v for k, v in (s.get("rejected") or {}).items()},
            "swarm_errors": s.get("swarm_errors") or {},
        }
    fetches = ok + timeout + failed
    return {
        "node_rounds": total,
        "peer_packet_rate": round(with_peer / after, 4) if after else None,
        "node_rounds_after_warmup": after,
        "fetches": {"ok": ok, "timeout": timeout, "failed": failed},
        "fetch_failure_rate": round((timeout + failed) / fetches, 4) if fetches else None,
        "in_bucket_rate": round(in_bucket / total, 4) if total else None,
        "peers_answered_mean": round(sum(answered) / len(answered), 3) if answered else None,
        # Time in the gather (network) apart from the round (also generation and training, CPU-bound).
        "gather_seconds_mean": round(sum(gathers) / len(gathers), 2) if gathers else None,
        "gather_seconds_max": round(max(gathers), 2) if gathers else None,
        "per_node": per_node,
    }


def _blocked_reach(statuses: list[dict[str, Any]], rounds: int, blocked: int) -> dict[str, Any]:
    """Per blocked node: the share of its rounds (after the warm-up) whose packet some peer received that round."""
    out: dict[str, Any] = {}
    for i in range(len(statuses) - blocked, len(statuses)):
        me = statuses[i].get("peer_id")
        mine = [h["round"] for h in statuses[i].get("history", []) if (h.get("round_in_run") or 0) <= rounds]
        mine = mine[WARMUP_ROUNDS:]
        heard = {h["round"] for j, s in enumerate(statuses) if j != i for h in s.get("history", []) if _received(h, me)}
        reached = sum(r in heard for r in mine)
        rate = round(reached / len(mine), 4) if mine else None
        out[f"n{i}"] = {"rounds": len(mine), "reached": reached, "rate": rate}
    return out


def _received(record: dict[str, Any], peer: str | None) -> bool:
    """Whether a round's record shows a packet from `peer`: samples admitted, or an entry in a round
    without network failures (a packet whose content was rejected still arrived)."""
    entry = (record.get("peers") or {}).get(peer)
    if entry is None:
        return False
    network = sum(int((record.get("rejected") or {}).get(k, 0)) for k in _NETWORK_FAILURES)
    return (entry.get("admitted") or 0) > 0 or network == 0


_NETWORK_FAILURES = ("fetch_timeout", "fetch_failed", "body_not_found")


GOALS = {  # (delay_ms, loss) -> thresholds from issue 22
    (100.0, 0.02): {"peer_packet_rate": 0.95, "fetch_failure_rate_max": 0.05, "in_bucket_rate": 0.95},
    (300.0, 0.05): {"peer_packet_rate": 0.90},
}


def check_goals(result: dict[str, Any]) -> dict[str, bool]:
    """Which of the issue's goals for these link settings the run met (empty: none set for them)."""
    s = result["settings"]
    goal = GOALS.get((float(s["delay_ms"]), float(s["loss"])), {})
    met = {"no crash or hang": not result["crashed"], "all through proxies": result["connections"]["direct_max"] == 0}
    if "peer_packet_rate" in goal:
        met[f"peer packet rate >= {goal['peer_packet_rate']}"] = (result["peer_packet_rate"] or 0) >= goal[
            "peer_packet_rate"
        ]
    if "fetch_failure_rate_max" in goal:
        rate = result["fetch_failure_rate"]
        met[f"fetch failures <= {goal['fetch_failure_rate_max']}"] = rate is not None and (
            rate <= goal["fetch_failure_rate_max"]
        )
    for name, b in result.get("blocked", {}).items():
        met[f"blocked {name} reaches a peer in >= 90 % of its rounds"] = (b["rate"] or 0) >= 0.9
    if "in_bucket_rate" in goal:
        met[f"rounds in bucket >= {goal['in_bucket_rate']}"] = (result["in_bucket_rate"] or 0) >= goal["in_bucket_rate"]
    return met


def format_wan_bench(result: dict[str, Any]) -> str:
    s, f = result["settings"], result["fetches"]
    lines = [
        f"WAN bench: {s['nodes']} nodes, {s['rounds']} rounds, {s['delay_ms']:g} ± {s['jitter_ms']:g} ms each way, "
        f"{100 * s['loss']:g} % loss, round {s['round_seconds']} s, gather {s['gather_seconds']} s",
        f"  node-rounds with a peer packet (after round {WARMUP_ROUNDS}): {_pct(result['peer_packet_rate'])} "
        f"of {result['node_rounds_after_warmup']}",
        f"  body fetches: {f['ok']} delivered, {f['timeout']} timed out, {f['failed']} failed "
        f"({_pct(result['fetch_failure_rate'])} not delivered)",
        f"  rounds within their bucket: {_pct(result['in_bucket_rate'])} of {result['node_rounds']} "
        f"(gather {result['gather_seconds_mean']} s on average, {result['gather_seconds_max']} s at most)",
        f"  peers answered per round: {result['peers_answered_mean']} on average",
    ]
    for name, node in result["per_node"].items():
        lines.append(f"    {name} ({node['model']}): answered {node['peers_answered']}")
    c, d = result["connections"], result["loss_dropped"]
    lines.append(
        f"  p2pd connections: up to {c['proxied_max']} through proxies, {c['direct_max']} direct "
        f"({c['samples']} samples); loss rule dropped {d['dropped']} of {d['sent']} segments on loopback"
    )
    lines.append(
        f"  load average {result['load_before'][0]} -> {result['load_after'][0]} on {result['cpu_count']} CPUs; "
        f"{result['wall_s']} s; crashed: {result['crashed'] or 'none'}"
    )
    for name, b in result.get("blocked", {}).items():
        lines.append(f"  blocked {name}: its packet reached a peer in {b['reached']} of its {b['rounds']} rounds")
    for goal, met in check_goals(result).items():
        lines.append(f"  goal {goal}: {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"
