"""Starting a node's hivemind DHT: its settings, its start-up, and three work-arounds.

The DHT runs in its own process (`hivemind.DHT` forks a child that owns a `DHTNode`
and a `p2pd` daemon). Three defects of hivemind 1.1.12 are fixed here, in our code:

* Large calls kill the DHT process. Under uvloop, `loop.add_reader` puts the command
  pipe into non-blocking mode; `multiprocessing` writes a message over 16 KiB as a
  header and a body, so `recv()` hits EAGAIN half-way, the stream is corrupt and the
  child dies (the caller then waits forever). `SwarmDHT.run` makes the pipe blocking
  for the length of each `recv()`; the writer always sends whole messages, so a
  blocking read never waits for long.
* A killed DHT process can freeze every later one. All processes forked from the node
  share one lock (`MPFuture._update_lock`) around writing results back to it; a DHT
  process killed while holding it (a window right after it answers) never releases
  it, and the next DHT started by the same node hangs before it is ready. Before each
  fork, `SwarmDHT.start` checks the lock and replaces it if it stays taken longer than
  any write takes; the new DHT process inherits the replacement.
* Killing the node orphans `p2pd`. SIGTERM/SIGKILL of the owning process leave the
  DHT child and its `p2pd` running. The child asks the kernel to SIGKILL it when its
  parent dies (`PR_SET_PDEATHSIG`), and a watchdog thread covers the cases the kernel
  cannot (the parent died before the call; the DHT was started from a thread other
  than the main one, whose exit would otherwise fire the signal). `p2pd` gets the same
  signal from the kernel when the DHT child dies (`_p2pd_dies_with_this_process`):
  left to itself it exits only once it notices, which a stopped or starved p2pd never
  does. `install_sigterm_handler` turns SIGTERM into a normal exit so that the DHT is
  shut down cleanly.

Identity (the one key that fixes the peer id and signs records) is in `identity`.
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import atexit
import ctypes
import ipaddress
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from node.swarm.errors import SwarmStartError
from node.swarm.identity import NodeIdentity
from node.swarm.record import MAX_RECORD_BYTES, RECORD_OVERHEAD_BYTES
from node.swarm.shards import MAX_SHARDS
from protocol.codec import Limits
from protocol.errors import ProtocolError
from protocol.keys import STALE_ROUNDS, validate_swarm_id

__all__ = [
    "DEFAULT_PORT",
    "SwarmConfig",
    "SwarmDHT",
    "dht_time",
    "install_sigterm_handler",
    "start_dht",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 31337

_PR_SET_PDEATHSIG = 1
_WATCHDOG_PERIOD_S = 0.5
_LOCK_STUCK_S = 1.0  # a result write holds the lock for milliseconds; this long means its holder died


def dht_time() -> float:
    """The swarm's clock (seconds). Rounds are buckets of this clock."""
    return get_dht_time()


class SwarmConfig(BaseModel):
    """How one node joins the swarm and exchanges packets. Tests use host 127.0.0.1, port 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    swarm_id: str = Field("ftis", description="Only nodes with the same swarm id exchange packets.")
    # --- networking
    host: str = Field("0.0.0.0", description="IP address to listen on.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port (0 = any free port).")
    announce_maddrs: list[str] = Field(default_factory=list, description="Public multiaddrs to announce.")
    initial_peers: list[str] = Field(
        default_factory=list, description="Bootstrap peers, /ip4/<ip>/tcp/<port>/p2p/<peer id>. Empty: new swarm."
    )
    client_mode: bool = Field(False, description="Serve no DHT requests (for nodes others cannot reach).")
    use_relay: bool = Field(True, description="Allow libp2p circuit relays.")
    use_auto_relay: bool = Field(False, description="Look for relays to become reachable from behind NAT.")
    persistent_conn_max_msg_size: int = Field(
        32 << 20,
        ge=4 << 20,
        description="Largest libp2p message; a shard key's answer (all its headers) must fit. Same on all nodes.",
    )
    # --- identity
    identity_path: Path | None = Field(
        None,
        description="libp2p key file (created if missing); it also signs our records. None: a new key each start.",
    )
    # --- start-up
    startup_timeout: float = Field(60.0, gt=0, description="Seconds to wait for p2pd and the DHT to start.")
    bootstrap_attempts: int = Field(30, ge=1, description="Tries to reach the bootstrap peers, at most.")
    bootstrap_wait_s: float = Field(
        120.0, gt=0, description="Keep trying the bootstrap peers this long (a busy machine's peer may still start)."
    )
    bootstrap_backoff_s: float = Field(1.0, ge=0, description="First wait between tries; doubles each time.")
    bootstrap_backoff_max_s: float = Field(30.0, ge=0, description="Longest wait between tries.")
    rpc_timeout_s: float = Field(3.0, gt=0, description="A DHT request with no answer in this time is lost.")
    # --- records
    round_seconds: float = Field(30.0, gt=0, description="Length of a round; records live ttl_rounds of them.")
    ttl_rounds: int = Field(3, ge=1, description="Records expire this many rounds after publishing.")
    inline_max_bytes: int = Field(
        2 << 10, ge=0, description="Packets up to this size ride inside their DHT header; larger ones are fetched P2P."
    )
    max_packet_bytes: int = Field(
        Limits().max_bytes,
        gt=0,
        description="Largest packet published or fetched; the codec's Limits.max_bytes, so both limits are one.",
    )
    max_total_bytes: int = Field(256 << 20, gt=0, description="Largest total of packets one gather holds.")
    stale_rounds: int = Field(
        STALE_ROUNDS, ge=0, description="A gather for round r also reads rounds r-1 .. r-stale_rounds."
    )
    body_keep_rounds: int = Field(4, ge=1, description="Bodies are served for this many recent rounds.")
    body_store_max_bytes: int = Field(256 << 20, gt=0, description="Memory bound on served bodies.")
    # --- gather at scale
    max_peers_per_round: int = Field(8, ge=1, description="Peers' packets one gather fetches at most (k).")
    shards: int = Field(
        0,
        ge=0,
        le=MAX_SHARDS,
        description="Shard keys per round (a power of two, the same on every node); 0: from the swarm-size estimate.",
    )
    shard_target: int = Field(16, ge=1, description="With shards=0: peers per shard the shard count aims at.")
    sample_shards: int = Field(1, ge=0, description="Other shards read each round besides this node's own.")
    max_shard_reads: int = Field(
        16, ge=1, description="Shards of one round read at most while they hold fewer than k peers."
    )
    read_beam: int = Field(
        5,
        ge=1,
        description="DHT nodes a read walks to (hivemind's beam size); 5 = the nodes each store goes to.",
    )
    fetch_timeout_s: float = Field(10.0, gt=0, description="Longest wait for one body fetch.")
    fetch_base_s: float = Field(
        2.0, gt=0, description="A fetch may take this long plus its size / fetch_min_bytes_per_s."
    )
    fetch_min_bytes_per_s: float = Field(
        1 << 20, gt=0, description="Slowest transfer rate a fetch is allowed before it times out."
    )
    poll_interval_s: float = Field(0.1, gt=0, description="Pause between DHT reads while gathering.")
    rejoin_interval_s: float = Field(
        5.0, gt=0, description="How often a node checks that its bootstrap peers are in its routing table."
    )
    rejoin_min_neighbors: int = Field(
        3, ge=0, description="Below this many DHT neighbours, a node also pings peers it saw recently."
    )
    rejoin_known_peers: int = Field(16, ge=0, description="Recently seen peers pinged then, at most.")
    known_peers_max: int = Field(1024, ge=1, description="Peers remembered for the swarm view.")
    known_peers_rounds: int = Field(10, ge=1, description="A peer unseen for this many rounds is forgotten.")

    @field_validator("swarm_id")
    @classmethod
    def _valid_swarm_id(cls, value: str) -> str:
        try:
            return validate_swarm_id(value)
        except ProtocolError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _consistent(self) -> SwarmConfig:
        limit = MAX_RECORD_BYTES - RECORD_OVERHEAD_BYTES
        if self.inline_max_bytes > limit:
            raise ValueError(f"inline_max_bytes must be <= {limit} (a DHT record holds at most {MAX_RECORD_BYTES})")
        return self

    @field_validator("shards")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be 0 or a power of two, got {value}")
        return value


# ---------------------------------------------------------------- the DHT process


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Make this (DHT child) process go away when the node process does."""
    if use_pdeathsig:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux/glibc: the watchdog alone does it
            pass

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_WATCHDOG_PERIOD_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="ftis-dht-watchdog", daemon=True).start()


def _p2pd_dies_with_this_process() -> None:
    """Have every process this (DHT) process starts, i.e. `p2pd`, get SIGKILL when it dies.

    p2pd is the node's grandchild: the DHT child's PDEATHSIG does not reach it. Left to
    itself it exits only when it notices that its control connection closed, i.e. only if
    it gets to run (0.05-0.5 s measured with both cores busy; never, if it is stopped or
    starved). With the kernel's signal it needs no help from p2pd. hivemind starts p2pd
    with `asyncio.subprocess.create_subprocess_exec`; in this process only, that call gets
    a `preexec_fn` setting PR_SET_PDEATHSIG in the new child. The function is looked up
    before the fork: nothing is loaded between fork and exec.
    """
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return
    me = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != me:  # this process died before the call: the signal will never come
            os.kill(os.getpid(), signal.SIGKILL)

    start = asyncio.subprocess.create_subprocess_exec

    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("preexec_fn", in_child)
        return await start(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


def _make_recv_blocking(conn) -> None:
    """Read each pipe message with the fd in blocking mode (the event loop keeps it non-blocking)."""
    nonblocking_recv = conn.recv

    def recv():
        os.set_blocking(conn.fileno(), True)
        try:
            return nonblocking_recv()
        finally:
            os.set_blocking(conn.fileno(), False)

    conn.recv = recv


_results_lock_guard = threading.Lock()


def _renew_result_lock_if_stuck() -> None:
    """Check the lock DHT processes hold while writing a result back to this process.

    It is shared by all of them, since a result over 4 KiB is several writes to one
    pipe; if it stays taken, its holder was killed mid-write and it would block every
    later DHT forever, so DHT processes forked from now on get a new one.
    """
    with _results_lock_guard:
        lock = MPFuture._update_lock
        if lock.acquire(timeout=_LOCK_STUCK_S):
            lock.release()
        else:
            logger.warning("a DHT process died holding the result lock; later DHT processes use a new one")
            MPFuture._update_lock = mp.Lock()


class SwarmDHT(hivemind.DHT):
    """`hivemind.DHT` with the work-arounds applied (in `start` before the fork, in the child's `run`)."""

    def __init__(self, *args, **kwargs):
        # PDEATHSIG fires when the forking *thread* exits, so only use it from the main thread.
        self._use_pdeathsig = threading.current_thread() is threading.main_thread()
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        _renew_result_lock_if_stuck()  # in the node process, just before the fork
        super().start()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the node's handler, if it was installed before the fork
        _die_with_parent(self._parent_pid, self._use_pdeathsig)
        _p2pd_dies_with_this_process()  # run() is this process's main thread: it forks p2pd
        _make_recv_blocking(self._inner_pipe)
        super().run()


# ---------------------------------------------------------------- start-up


_MADDR_EXAMPLE = "/ip4/1.2.3.4/tcp/31337/p2p/QmPeerId..., as printed by the first node"


def _check_peer_maddr(text: str) -> str:
    try:
        maddr = Multiaddr(text)
        PeerID.from_base58(maddr["p2p"])
    except Exception as e:  # the multiaddr library raises several unrelated types
        reason = str(e).replace("\n", " ")
        if "does not contain protocol" in reason:
            reason = "it has no /p2p/<peer id> part"
        raise SwarmStartError(f"invalid peer address {text!r}: {reason}; expected {_MADDR_EXAMPLE}") from None
    return str(maddr)


def _check_announce_maddr(text: str) -> str:
    try:
        maddr = Multiaddr(text)
    except Exception as e:
        raise SwarmStartError(f"invalid announce address {text!r}: {e}; expected e.g. /ip4/1.2.3.4/tcp/31337") from None
    if ("tcp" in maddr.protocols() and maddr["tcp"] == "0") or ("udp" in maddr.protocols() and maddr["udp"] == "0"):
        raise SwarmStartError(f"announce address {text!r} needs an explicit port, not 0")
    return str(maddr)


def _listen_maddr(host: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise SwarmStartError(f"host {host!r} is not an IP address; use e.g. 0.0.0.0 (all interfaces)") from None
    return f"/ip{ip.version}/{ip}/tcp/{port}"


def _check_port_free(host: str, port: int) -> None:
    """Fail early and clearly: p2pd binds with SO_REUSEPORT and would share a busy port silently."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SwarmStartError(
                f"port {port} on {host} is already in use ({e.strerror}); stop the other program "
                "or choose another port (--port, 0 = any free port)"
            ) from None


def _is_bootstrap_failure(error: BaseException) -> bool:
    text = str(error)
    return "failed to connect to bootstrap peers" in text or "bootstrap failed" in text


def _start_error(error: BaseException, config: SwarmConfig) -> SwarmStartError:
    text = " ".join(str(error).split())
    if "address already in use" in text:
        return SwarmStartError(
            f"port {config.port} on {config.host} is already in use; choose another port (--port, 0 = any free port)"
        )
    if "is already taken by another peer" in text:
        return SwarmStartError(
            f"identity {config.identity_path} is already in use by another peer of the swarm; "
            "give each node its own identity (--data-dir)"
        )
    if "failed to start in" in text:
        return SwarmStartError(
            f"the p2p daemon did not start within {config.startup_timeout:.0f} s; "
            "the machine may be overloaded: raise the start-up timeout (--startup-timeout)"
        )
    return SwarmStartError(f"the DHT failed to start: {text or type(error).__name__}")


def start_dht(
    config: SwarmConfig, record_validators: Iterable[RecordValidatorBase], identity: NodeIdentity
) -> SwarmDHT:
    """Start and return a ready `SwarmDHT` on `identity`, or raise `SwarmStartError` (one line, says what to do).

    Bad addresses and busy ports fail before any process starts. Bootstrap failures are
    retried with exponential backoff for `bootstrap_wait_s` (at most `bootstrap_attempts` tries).
    """
    initial_peers = [_check_peer_maddr(p) for p in config.initial_peers]
    announce = [_check_announce_maddr(a) for a in config.announce_maddrs]
    listen = _listen_maddr(config.host, config.port)
    if config.port != 0:
        _check_port_free(config.host, config.port)
    validators = list(record_validators)
    kwargs = dict(
        host_maddrs=[listen],
        announce_maddrs=announce or None,
        identity_path=str(identity.identity_path),
        check_if_identity_free=not identity.fresh,  # a key made just now is nobody else's
        client_mode=config.client_mode,
        use_relay=config.use_relay,
        use_auto_relay=config.use_auto_relay,
        use_ipfs=False,  # would dial public IPFS bootstrap nodes
        startup_timeout=config.startup_timeout,
        persistent_conn_max_msg_size=config.persistent_conn_max_msg_size,
        wait_timeout=config.rpc_timeout_s,
        ensure_bootstrap_success=True,
    )
    # One attempt may start two p2pd (hivemind first checks that a reused identity is free).
    ready_timeout = 2 * config.startup_timeout + 2 * config.rpc_timeout_s + 5
    attempts = config.bootstrap_attempts if initial_peers else 1
    started = time.monotonic()
    attempt = 0
    while True:
        dht = SwarmDHT(initial_peers=initial_peers or None, start=False, record_validators=validators, **kwargs)
        dht.start()
        attempt_started = time.monotonic()
        try:
            dht.wait_until_ready(timeout=ready_timeout)
            return dht
        except TimeoutError:
            if time.monotonic() - attempt_started < ready_timeout:  # a TimeoutError from inside the child
                _stop_failed(dht)
                raise SwarmStartError(f"the DHT failed to start: {config.rpc_timeout_s} s DHT timeout") from None
            _stop_failed(dht)
            raise SwarmStartError(
                f"the DHT did not become ready within {ready_timeout:.0f} s; "
                "the machine may be overloaded: raise the start-up timeout (--startup-timeout)"
            ) from None
        except Exception as e:
            _stop_failed(dht)
            if not _is_bootstrap_failure(e):
                raise _start_error(e, config) from None
        attempt += 1
        waited = time.monotonic() - started
        delay = min(config.bootstrap_backoff_s * 2 ** (attempt - 1), config.bootstrap_backoff_max_s)
        if attempt >= attempts or waited + delay >= config.bootstrap_wait_s:
            break
        # A warning, so the console shows it: the node is waiting, not stuck.
        logger.warning(
            "waiting for the bootstrap peer(s) %s to answer (try %d, %.0f s of %.0f s); retrying in %.1f s",
            ", ".join(initial_peers),
            attempt,
            waited,
            config.bootstrap_wait_s,
            delay,
        )
        time.sleep(delay)
    raise SwarmStartError(
        f"could not reach any bootstrap peer ({', '.join(initial_peers)}) after {attempt} attempts in "
        f"{time.monotonic() - started:.0f} s; check the address, that the peer runs and that its port is "
        "reachable (firewall/NAT), or leave out --swarm to start a new swarm"
    )


def _stop_failed(dht: SwarmDHT) -> None:
    dht.join(timeout=5)
    if dht.is_alive():
        dht.terminate()
        dht.join(timeout=5)


# ---------------------------------------------------------------- signals


def install_sigterm_handler(on_exit: Callable[[], None]) -> None:
    """Make SIGTERM a normal exit of the main thread, and run `on_exit` (e.g. `Swarm.shutdown`) at exit.

    The handler raises SystemExit instead of shutting down itself: it may interrupt the
    main thread half-way through a call on the DHT pipe, and `finally` blocks, context
    managers and the `atexit` hook then run the shutdown outside the handler.
    """

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    atexit.register(on_exit)
