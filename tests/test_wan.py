"""The emulated WAN of `ftis-node bench wan` and the fetch budget it led to.

The network tests need root (they create a network namespace of their own and delete it);
the short bench run over real `ftis-node join` processes is `make test-wan` (slow-marked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from node.bench.wan_net import WanNet, loss_bytecode
from node.swarm.gather import FetchBudget

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates a network namespace (root)")

_ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); print("up", flush=True)
c, _ = s.accept()
while data := c.recv(65536):
    c.sendall(data)
"""

_CLIENT = """
import json, socket, sys, time
c = socket.create_connection(("127.0.0.1", int(sys.argv[1]))); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times, got = [], b""
for i in range(int(sys.argv[2])):
    t = time.monotonic(); msg = b"%06d" % i; c.sendall(msg)
    while len(got) < 6 * (i + 1):
        got += c.recv(65536)
    times.append(time.monotonic() - t)
ok = got == b"".join(b"%06d" % i for i in range(int(sys.argv[2])))
print(json.dumps({"times": times, "in_order": ok}))
"""


def _echo_through_proxy(net: WanNet, exchanges: int) -> dict:
    server = subprocess.Popen(
        net.exec_prefix() + [sys.executable, "-c", _ECHO, str(net.node_port(0))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        done = subprocess.run(
            net.exec_prefix() + [sys.executable, "-c", _CLIENT, str(net.proxy_port(0)), str(exchanges)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    finally:
        server.kill()
        server.wait()


@needs_root
def test_proxy_delays_each_way_keeps_order_and_the_namespace_goes_away():
    with WanNet(1, delay_ms=50, jitter_ms=10, loss=0.0, seed=3) as net:
        name = net.name
        out = _echo_through_proxy(net, 20)
    assert out["in_order"]
    times = sorted(out["times"])
    # Each request crosses the proxy twice (there and back): ~100 ms, never under 2 x (50 - a few sigma).
    assert times[0] >= 0.04 and 0.08 <= times[len(times) // 2] <= 0.5, times
    assert net.proxy_stats["connections"] == 1 and net.proxy_stats["bytes"] == 2 * 20 * 6
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed


@needs_root
def test_loss_rule_drops_segments_of_proxied_hops_and_tcp_still_delivers():
    with WanNet(1, delay_ms=0, jitter_ms=0, loss=0.1, seed=4) as net:
        out = _echo_through_proxy(net, 300)
        counts = net.loss_counts()
    assert out["in_order"]
    # ~4 segments per exchange on the proxied hop (data and ACK, each way), 10 % of them dropped.
    assert 30 <= counts["dropped"] <= 300, counts


@needs_root
def test_namespace_is_deleted_when_setup_fails():
    net = WanNet(1, delay_ms=0, jitter_ms=0, loss=0.0)
    net.proxy_port = lambda i: 70000  # type: ignore[method-assign]  # no such port: the proxy cannot listen
    with pytest.raises(Exception):
        net.__enter__()
    assert net.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_loss_bytecode_is_classic_bpf_that_tc_accepts_in_shape():
    text = loss_bytecode(20000, 20999, 0.02)
    count, _, rest = text.partition(",")
    ops = [tuple(int(x) for x in op.split()) for op in rest.split(",")]
    assert int(count) == len(ops) == 16
    assert all(len(op) == 4 for op in ops)
    assert ops[-2][0] == ops[-1][0] == 0x06  # both exits are returns
    for i, (op, jt, jf, _) in enumerate(ops):  # every jump lands inside the program
        if op & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(ops)
    assert ops[13][3] == int(0.02 * 0xFFFFFFFF)


def test_fetch_budget_grows_from_measured_times_and_backs_off_on_timeouts():
    budget = FetchBudget(base_s=2.0, min_rate=1 << 20, max_s=10.0)
    assert budget.budget("p", 1 << 20) == pytest.approx(3.0)  # nothing measured: base + size / rate
    for _ in range(5):
        budget.observe("p", 0.3, timed_out=False)  # a near peer: the static floor stays
    assert budget.budget("p", 0) == pytest.approx(2.0)
    for seconds in (2.5, 3.5, 3.0, 4.0):  # a far, jittery peer: srtt + 4 rttvar rises over the floor
        budget.observe("far", seconds, timed_out=False)
    assert 4.0 < budget.budget("far", 0) <= 10.0
    budget.observe("x", 2.0, timed_out=True)
    assert budget.budget("x", 0) == pytest.approx(4.0)  # doubled, like a retransmission timeout
    for _ in range(10):
        budget.observe("x", 4.0, timed_out=True)
    assert budget.budget("x", 0) == 10.0  # never past fetch_timeout_s
    budget.observe("x", 1.0, timed_out=False)  # one success ends the backoff: its first sample, 1 + 4 x 0.5
    assert budget.budget("x", 0) == pytest.approx(3.0)


def test_fetch_budget_forgets_the_least_recent_peers():
    budget = FetchBudget(base_s=1.0, min_rate=1.0, max_s=10.0, max_peers=3)
    for peer in "abcd":
        budget.observe(peer, 5.0, timed_out=False)
    assert "a" not in budget and all(p in budget for p in "bcd")


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(600)
def test_wan_bench_short_run_keeps_every_node_in_the_swarm(tmp_path):
    """`make test-wan`: 3 nodes, 100 +- 20 ms each way, 2 % loss, a few short rounds."""
    out = tmp_path / "wan.json"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.console.cli",
            "bench",
            "wan",
            "--nodes",
            "3",
            "--rounds",
            "5",
            "--round-seconds",
            "10",
        ]
        + ["--prompts-per-round", "2", "--group-size", "4", "--max-tokens", "12", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["crashed"], result
    assert result["connections"]["direct_max"] == 0 and result["connections"]["proxied_max"] >= 2
    assert result["loss_dropped"]["dropped"] > 0
    assert result["node_rounds"] == 15
    assert result["peer_packet_rate"] >= 0.8, result  # loose: a loaded CI machine; the bench has the goals
    print(f"wan bench: {time.monotonic() - started:.0f} s", result["peer_packet_rate"], result["fetches"])


def test_reachability_check_at_start_says_whether_peers_can_dial_this_node():
    """Real DHTs on loopback: a joiner that listens where it announces is reachable; one that
    announces a port where nothing listens is told it is not, and what to set."""
    from node.swarm import Swarm, SwarmConfig
    from tests.procs import free_port

    def config(**extra) -> SwarmConfig:
        return SwarmConfig(swarm_id="reach", host="127.0.0.1", port=0, startup_timeout=30, **extra)

    with Swarm(config()).start() as boot:
        assert boot._require().reachable is None  # it started the swarm: nobody to ask
        with Swarm(config(initial_peers=boot.join_addrs()[:1])).start() as open_node:
            assert open_node._require().reachable is True, open_node._require().reachability
        dead_port = free_port()
        blocked = config(initial_peers=boot.join_addrs()[:1], announce_maddrs=[f"/ip4/127.0.0.1/tcp/{dead_port}"])
        with Swarm(blocked).start() as closed:
            line = closed._require().reachability
            assert closed._require().reachable is False, line
            assert f"/ip4/127.0.0.1/tcp/{dead_port} refused" in line and "--announce" in line


@needs_root
@pytest.mark.timeout(300)
def test_a_fetch_cut_by_the_deadline_is_delivered_by_the_next_gather():
    """Two real Swarms behind 400 ms proxies: the body of a gather that ran out of time arrives in the next."""
    script = os.path.join(os.path.dirname(__file__), "wan_late_fetch.py")
    with WanNet(2, delay_ms=400, jitter_ms=20, loss=0.0, seed=5) as net:
        ports = [str(p) for i in range(2) for p in (net.node_port(i), net.proxy_port(i))]
        env = os.environ | {"PYTHONPATH": os.path.dirname(os.path.dirname(script))}
        done = subprocess.run(
            net.exec_prefix() + [sys.executable, script, *ports], capture_output=True, text=True, timeout=280, env=env
        )
    assert done.returncode == 0, done.stderr[-3000:]
    tries = json.loads(done.stdout.strip().splitlines()[-1])
    last = tries[-1]
    assert last["first"]["carried"] == 1 and last["first"]["packets"] == 0, tries
    assert "fetch_timeout" not in last["first"]["rejected"], tries  # not judged at the deadline
    # The next gather (round r + 1) delivers B's round-r packet, intact, as a late fetch.
    assert [True, 0, True] in last["second"]["packets"] and last["second"]["late"] == 1, tries
    assert "fetch_timeout" not in last["second"]["rejected"], tries
