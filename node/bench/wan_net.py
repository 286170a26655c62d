"""An emulated WAN on one machine: a network namespace, delay proxies, random loss.

    with WanNet(nodes=4, delay_ms=100, jitter_ms=20, loss=0.02) as net:
        subprocess.Popen(net.exec_prefix() + ["ftis-node", "join", ...])   # inside the namespace

Everything lives in a namespace of our own (`ftis-wan-<pid>`), deleted on exit, also on
error: its addresses are 127.0.0.1 inside it and nothing reaches the host's network.

- Delay: netem where the kernel has it is not used, since we need it per link and this
  kernel has none; `node.bench.wan_proxy` holds each chunk gauss(D, J) ms. Node i listens
  on `node_port(i)` and announces `proxy_port(i)`, so every connection to it crosses one proxy.
- Loss: the namespace's loopback gets an htb root whose class 1:2 feeds a pfifo of limit 0
  (everything sent there is dropped); a classic-BPF filter sends a random `loss` fraction of
  the TCP segments to or from a proxy port into it. So loss hits the proxied hop of each
  link once, both directions. (A near-zero-rate class instead of limit 0 would hold the
  packet, not drop it, and TCP does not retransmit a segment still queued on its host:
  the connection stalls for minutes.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import TracebackType

__all__ = ["NODE_PORT", "PROXY_PORT", "WanError", "WanNet", "loss_bytecode"]

PROXY_PORT = 20000  # node i's proxy listens on PROXY_PORT + i (the loss filter matches this range)
NODE_PORT = 21000  # node i's p2pd listens on NODE_PORT + i
API_PORT = 22000
_PORT_RANGE = 1000

SKF_AD_RANDOM = 0xFFFFF000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM: loads a random u32


class WanError(RuntimeError):
    """The emulated WAN could not be set up (not root, no `ip`/`tc`, ...)."""


def loss_bytecode(lo: int, hi: int, loss: float) -> str:
    """`tc ... bpf bytecode` for: an IPv4 TCP segment with either port in [lo, hi], with probability `loss`.

    Classic BPF at tc's egress on loopback sees the 14-byte Ethernet header first.
    Returns -1 (take the filter's flowid, the drop class) or 0 (no match: the default class).
    """
    threshold = min(0xFFFFFFFF, int(loss * 0xFFFFFFFF))
    fail = 15
    code = [
        (0x28, 0, 0, 12),  # 0  ldh [12]: ethertype
        (0x15, 0, None, 0x800),  # 1  IPv4, else fail
        (0x30, 0, 0, 23),  # 2  ldb [23]: IP protocol
        (0x15, 0, None, 6),  # 3  TCP, else fail
        (0xB1, 0, 0, 14),  # 4  ldxb 4*([14]&0xf): IP header length
        (0x48, 0, 0, 14),  # 5  ldh [x+14]: source port
        (0x35, 0, 2, lo),  # 6  >= lo ? 7 : 9
        (0x25, 1, 0, hi),  # 7  > hi ? 9 : 8
        (0x05, 0, 0, 3),  # 8  ja 12: in range
        (0x48, 0, 0, 16),  # 9  ldh [x+16]: destination port
        (0x35, 0, None, lo),  # 10 < lo: fail
        (0x25, None, 0, hi),  # 11 > hi: fail
        (0x20, 0, 0, SKF_AD_RANDOM),  # 12 A = random u32
        (0x25, None, 0, threshold),  # 13 > threshold: fail
        (0x06, 0, 0, 0xFFFFFFFF),  # 14 match: the filter's flowid
        (0x06, 0, 0, 0),  # 15 fail: no match
    ]
    ops = [
        f"{op} {fail - i - 1 if jt is None else jt} {fail - i - 1 if jf is None else jf} {k}"
        for i, (op, jt, jf, k) in enumerate(code)
    ]
    return f"{len(ops)}," + ",".join(ops)


class WanNet:
    """The namespace, its loss rules and the delay proxy for `nodes` nodes; a context manager."""

    def __init__(self, nodes: int, delay_ms: float, jitter_ms: float, loss: float, *, seed: int | None = None) -> None:
        if not 1 <= nodes < _PORT_RANGE:
            raise ValueError(f"nodes must be 1..{_PORT_RANGE - 1}, got {nodes}")
        if delay_ms < 0 or jitter_ms < 0:
            raise ValueError("delay and jitter must be >= 0 ms")
        if not 0 <= loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        self.nodes, self.delay_ms, self.jitter_ms, self.loss, self.seed = nodes, delay_ms, jitter_ms, loss, seed
        self.name = f"ftis-wan-{os.getpid()}"
        self.proxy: subprocess.Popen | None = None
        self.proxy_stats: dict = {}
        self._created = False

    # ------------------------------------------------------------ addresses

    @staticmethod
    def node_port(i: int) -> int:
        return NODE_PORT + i

    @staticmethod
    def proxy_port(i: int) -> int:
        return PROXY_PORT + i

    @staticmethod
    def api_port(i: int) -> int:
        return API_PORT + i

    def announce(self, i: int) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.proxy_port(i)}"

    def unreachable(self, i: int) -> str:
        """An address for node i that nobody can dial: a port in the proxy range where nothing listens."""
        return f"/ip4/127.0.0.1/tcp/{PROXY_PORT + _PORT_RANGE - 1 - i}"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    # ------------------------------------------------------------ life cycle

    def __enter__(self) -> WanNet:
        if os.geteuid() != 0:
            raise WanError("the WAN bench needs root (it creates a network namespace)")
        for tool in ("ip", "tc", "ss"):
            if shutil.which(tool) is None:
                raise WanError(f"the WAN bench needs the '{tool}' command (iproute2)")
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise WanError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def _in_ns(self, *args: str) -> str:
        done = subprocess.run(self.exec_prefix() + list(args), capture_output=True, text=True)
        if done.returncode != 0:
            raise WanError(f"{' '.join(args)} (in {self.name}): {done.stderr.strip()}")
        return done.stdout

    def _setup(self) -> None:
        self._ip("netns", "add", self.name)
        self._created = True
        self._in_ns("ip", "link", "set", "lo", "up")
        if self.loss > 0:
            tc = ["tc"]
            self._in_ns(*tc, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1")
            self._in_ns(*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit")
            self._in_ns(*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", "1:2", "htb", "rate", "8bit")
            self._in_ns(*tc, "qdisc", "add", "dev", "lo", "parent", "1:2", "handle", "2:", "pfifo", "limit", "0")
            lo, hi = PROXY_PORT, PROXY_PORT + _PORT_RANGE - 1
            bytecode = loss_bytecode(lo, hi, self.loss)
            self._in_ns(*tc, "filter", "add", "dev", "lo", "parent", "1:", "bpf", "bytecode", bytecode, "flowid", "1:2")
        pairs = [f"{self.proxy_port(i)}:{self.node_port(i)}" for i in range(self.nodes)]
        cmd = [sys.executable, "-m", "node.bench.wan_proxy", "--delay-ms", str(self.delay_ms)]
        cmd += ["--jitter-ms", str(self.jitter_ms), *([] if self.seed is None else ["--seed", str(self.seed)])]
        self.proxy = subprocess.Popen(self.exec_prefix() + cmd + pairs, stdout=subprocess.PIPE, text=True)
        assert self.proxy.stdout is not None
        if self.proxy.stdout.readline().strip() != "ready":
            raise WanError("the delay proxy did not start")

    def loss_counts(self) -> dict[str, int]:
        """Segments of the proxied hops dropped, and all segments the loopback sent (tc's counters)."""
        if self.loss <= 0:
            return {"dropped": 0, "sent": 0}
        out = self._in_ns("tc", "-s", "-j", "qdisc", "show", "dev", "lo")
        counts = {"dropped": 0, "sent": 0}
        for q in json.loads(out):
            if q.get("handle") == "2:":
                counts["dropped"] = int(q.get("drops", 0))
            if q.get("handle") == "1:":
                counts["sent"] = int(q.get("packets", 0))
        return counts

    def connections(self) -> dict[str, int]:
        """Established TCP connections between p2pd daemons: through a proxy, or straight to a node port.

        A p2pd connection to a node port (not a proxy port) would bypass the emulated WAN.
        """
        out = self._in_ns("ss", "-tnpH", "state", "established")
        proxied = direct = 0
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 4 or "p2pd" not in line:
                continue
            port = int(fields[3].rsplit(":", 1)[-1])  # the remote end
            if PROXY_PORT <= port < PROXY_PORT + _PORT_RANGE:
                proxied += 1
            elif NODE_PORT <= port < NODE_PORT + _PORT_RANGE:
                direct += 1
        return {"proxied": proxied, "direct": direct}

    def close(self) -> None:
        """Stop the proxy and delete the namespace (idempotent)."""
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                out, _ = self.proxy.communicate(timeout=10)
                last = (out or "").strip().splitlines()
                self.proxy_stats = json.loads(last[-1]) if last else {}
            except (subprocess.TimeoutExpired, ValueError):
                self.proxy.kill()
                self.proxy.wait()
        if self._created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self._created = False
