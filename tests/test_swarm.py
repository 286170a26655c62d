"""The swarm layer over real hivemind DHTs on 127.0.0.1.

Node A runs in the test process; B, C and D are separate processes (tests/swarm_peer.py),
each with its own DHT process and p2pd. The module-scoped network is reused by the
tests that need several nodes; the last of them kills D and terminates C.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MPFuture, MSGPackSerializer
from swarm_peer import payload, sha

from node.swarm import RejectReason, Swarm, SwarmConfig, SwarmError, SwarmStartError
from node.swarm.bodies import BodyStore
from node.swarm.dht import dht_time
from node.swarm.record import MAX_RECORD_BYTES, HeaderRecord, HeaderRecordValidator, peer_id_of_owner
from node.swarm.shards import shard_key
from protocol.keys import round_at

HELPER = Path(__file__).with_name("swarm_peer.py")
SWARM_ID = "test-swarm"
SMALL = 48 << 10  # over the ~16 KiB that killed hivemind's DHT process (BUG 1), inline in the record
LARGE = 3 << 19  # 1.5 MiB: over inline_max_bytes, so it travels by body fetch
VALID_PEER_ID = "QmeshwnkVXRGw19PS1erBdJFiFprfSps9a2MUq1RVGrN9K"


def local_config(**overrides) -> SwarmConfig:
    base = dict(
        swarm_id=SWARM_ID, host="127.0.0.1", port=0, startup_timeout=30, bootstrap_attempts=3, bootstrap_backoff_s=0.2
    )
    return SwarmConfig(**{**base, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """A zombie counts as gone: PID 1 here does not reap re-parented children."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


class Peer:
    """A swarm_peer.py process: send a command, read its one-line JSON answer."""

    def __init__(self, name: str, config: SwarmConfig, log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), config.model_dump_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict = {}

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def read(self, timeout: float = 60) -> dict:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(
                f"{self.name} did not answer in {timeout} s; log:\n{self.log.read_text()[-3000:]}"
            ) from None

    def ready(self, timeout: float = 90) -> dict:
        self.info = self.read(timeout)
        assert self.info["event"] == "ready", self.info
        return self.info

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float = 60, **cmd) -> dict:
        self.send(**cmd)
        return self.read(timeout)

    @property
    def peer_id(self) -> str:
        return self.info["peer_id"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit", timeout=15)
            except (AssertionError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    logs = tmp_path_factory.mktemp("peers")
    a = Swarm(local_config()).start()
    peers = {name: Peer(name, local_config(initial_peers=a.join_addrs()), logs) for name in "BCD"}
    try:
        for p in peers.values():
            p.ready()
        yield a, peers
    finally:
        for p in peers.values():
            p.close()
        a.shutdown()


def base_round() -> int:
    return round_at(dht_time(), 30)


def gather_everywhere(a: Swarm, peers: dict[str, Peer], rnd: int, *, deadline: float, expect: int | None):
    """All nodes gather `rnd` at the same time; returns {name: (peer_id, round, size, sha) set, result}."""
    for p in peers.values():
        p.send(op="gather", round=rnd, deadline=deadline, expect=expect)
    res_a = a.gather(rnd, deadline_s=deadline, expect_peers=expect)
    out = {"A": ({(p.peer_id, p.round, len(p.data), sha(p.data)) for p in res_a.packets}, res_a)}
    for name, p in peers.items():
        r = p.read()
        out[name] = ({tuple(x) for x in r["packets"]}, r)
    return out


def test_every_node_sees_every_other_each_round(net):
    a, peers = net
    ids = {"A": a.peer_id, **{n: p.peer_id for n, p in peers.items()}}
    r0 = base_round()
    for k in range(3):
        rnd = r0 + k
        sent = {}
        for i, name in enumerate("ABCD"):
            seed = 1000 * k + i
            if name == "A":
                assert a.publish(rnd, payload(seed, SMALL))
            else:
                assert peers[name].call(op="publish", round=rnd, seed=seed, size=SMALL)["ok"]
            sent[name] = (ids[name], rnd, SMALL, sha(payload(seed, SMALL)))
        seen = gather_everywhere(a, peers, rnd, deadline=15, expect=3)
        for name, (packets, res) in seen.items():
            # exactly the other three, this round only (round k-1 was delivered by the last gather)
            assert packets == {v for n, v in sent.items() if n != name}, name
            assert (res.rejected if name == "A" else res["rejected"]) == {}


def test_large_packet_travels_by_body_fetch(net):
    a, peers = net
    rnd = base_round() + 10
    assert peers["C"].call(op="publish", round=rnd, seed=7, size=LARGE)["ok"]
    # Small, but it holds the marker RSASignatureValidator parses out of values: must go by reference too.
    marked = b"text with [signature:xyz] inside" * 10
    assert a.publish(rnd, marked)
    raw = a.dht.get(shard_key(SWARM_ID, rnd, 0), latest=True).value  # a small swarm has one shard
    records = {owner.hex(): HeaderRecord.from_wire(item.value) for owner, item in raw.items()}
    c_record, a_record = records[peers["C"].info["owner"]], records[a.owner_subkey.hex()]
    assert c_record.body is None and c_record.size == LARGE and c_record.peer == peers["C"].peer_id
    assert a_record.body is None and a_record.size == len(marked)

    peers["B"].send(op="gather", round=rnd, deadline=15, expect=2)
    res = a.gather(rnd, deadline_s=15, expect_peers=1)
    from_c = (peers["C"].peer_id, rnd, LARGE, sha(payload(7, LARGE)))
    assert {(p.peer_id, p.round, len(p.data), sha(p.data)) for p in res.packets} == {from_c}
    from_a = (a.peer_id, rnd, len(marked), sha(marked))
    assert {tuple(x) for x in peers["B"].read()["packets"]} == {from_c, from_a}


def test_tampered_body_is_rejected_once(net):
    a, peers = net
    rnd = base_round() + 20
    assert peers["D"].call(op="tamper", round=rnd, seed=11, size=LARGE)["ok"]
    assert peers["B"].call(op="publish", round=rnd, seed=12, size=SMALL)["ok"]
    # No expect_peers: wait the full deadline for D's fetch to finish (generous: CI hosts are slow).
    res = a.gather(rnd, deadline_s=6.0)
    assert res.peers == {peers["B"].peer_id}
    assert res.rejected == {RejectReason.HASH_MISMATCH: 1}
    assert res.rejected_by_peer == {peers["D"].peer_id: {RejectReason.HASH_MISMATCH: 1}}
    # Judged once: the next round's gather also reads this one (stale_rounds=1) and says nothing more.
    again = a.gather(rnd + 1, deadline_s=0.5)
    assert again.packets == [] and again.rejected == {}


def test_forged_write_into_another_owner_slot_is_rejected(net):
    a, peers = net
    rnd = base_round() + 30
    key = shard_key(SWARM_ID, rnd, 0)
    b_owner = bytes.fromhex(peers["B"].info["owner"])
    assert peers["B"].call(op="publish", round=rnd, seed=21, size=SMALL)["ok"]
    genuine = (peers["B"].peer_id, rnd, SMALL, sha(payload(21, SMALL)))

    fake = payload(22, SMALL)
    forged = HeaderRecord(
        round=rnd, peer=peers["B"].peer_id, size=len(fake), sha256=bytes.fromhex(sha(fake)), body=fake
    ).to_wire()
    later = dht_time() + 120  # a newer expiration would win if the record were accepted
    assert a.dht.store(key, forged, later, subkey=b_owner) is False  # unsigned
    # with a signature made by A's key spliced in (RSASignatureValidator looks for this marker)
    sig_value = {**forged, "body": fake[:-40] + b"[signature:" + b"A" * 28 + b"]"}
    assert a.dht.store(key, sig_value, later, subkey=b_owner) is False

    seen = gather_everywhere(a, {n: peers[n] for n in "CD"}, rnd, deadline=15, expect=1)
    for name, (packets, _) in seen.items():
        assert packets == {genuine}, name
    raw = a.dht.get(key, latest=True).value
    assert HeaderRecord.from_wire(raw[b_owner].value).sha256.hex() == genuine[3]


def test_a_record_claiming_another_peer_is_rejected_and_never_attributed_to_it(net):
    a, peers = net
    rnd = base_round() + 50
    b, c = peers["B"], peers["C"]
    # B signs, in its own slot, a header that names C (the slot readers of C's shard look at).
    forged = b.call(op="impersonate", round=rnd, seed=41, size=SMALL, claim=c.peer_id)
    assert forged["ok"]
    assert c.call(op="publish", round=rnd, seed=42, size=SMALL)["ok"]
    genuine = (c.peer_id, rnd, SMALL, sha(payload(42, SMALL)))

    seen = gather_everywhere(a, {n: peers[n] for n in "CD"}, rnd, deadline=4, expect=None)
    for name, (packets, res) in seen.items():
        by_peer = res.rejected_by_peer if name == "A" else res["by_peer"]
        assert by_peer == {b.peer_id: {RejectReason.IMPERSONATION: 1}}, name  # the signer's id, never C's
        assert forged["sha"] not in {p[3] for p in packets}, name
        if name != "C":
            assert packets == {genuine}, name  # C's own packet still arrives, under C's id
    assert b.call(op="gather", round=rnd, deadline=0.5)["by_peer"] == {}  # B skips its own slot


def test_excluded_peers_are_skipped_not_judged(net):
    a, peers = net
    rnd = base_round() + 60
    for i, name in enumerate("BC"):
        assert peers[name].call(op="publish", round=rnd, seed=51 + i, size=SMALL, model=f"m-{name}")["ok"]
    b, c = peers["B"].peer_id, peers["C"].peer_id
    res = a.gather(rnd, deadline_s=15, expect_peers=2, exclude_peers={b})
    assert res.peers == {c} and res.skipped == 1 and res.rejected == {}
    assert {p["peer_id"] for p in a.known_peers()} >= {b, c}  # a quarantined peer stays in the swarm view
    # not judged: once the exclusion is lifted the packet is delivered
    progress: list[int] = []  # a live view hears each peer as it is delivered
    assert a.gather(rnd, deadline_s=15, expect_peers=1, on_progress=progress.append).peers == {b}
    assert progress == [1]
    view = {p["peer_id"]: p for p in a.known_peers()}
    assert view[b]["model"] == "m-B" and view[c]["round"] == rnd and view[c]["size"] == SMALL
    assert {"peer_id", "model", "adapter_version", "round", "size", "last_seen"} <= set(view[b])


def test_the_same_content_is_delivered_once_whoever_relays_it(net):
    a, peers = net
    rnd = base_round() + 70
    assert peers["B"].call(op="publish", round=rnd, seed=61, size=SMALL)["ok"]
    assert peers["C"].call(op="relay", round=rnd, seed=61, size=SMALL)["ok"]  # B's bytes, C's header
    res = a.gather(rnd, deadline_s=3)
    assert [sha(p.data) for p in res.packets] == [sha(payload(61, SMALL))]
    relayer = ({peers["B"].peer_id, peers["C"].peer_id} - res.peers).pop()
    assert res.rejected_by_peer == {relayer: {RejectReason.DUPLICATE_CONTENT: 1}}


def test_sigkilled_node_does_not_stop_gathers_and_leaves_no_p2pd(net):
    a, peers = net
    rnd = base_round() + 80  # after every round the earlier tests used: bodies are kept for the newest rounds
    d = peers["D"]
    tree = d.call(op="descendants")
    assert "p2pd" in tree["names"], tree
    assert d.call(op="publish", round=rnd, seed=31, size=LARGE)["ok"]  # a body only D can serve
    for i, name in enumerate("BC"):
        assert peers[name].call(op="publish", round=rnd, seed=32 + i, size=SMALL)["ok"]
    assert a.publish(rnd, payload(34, SMALL))
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(timeout=10)

    ids = {"A": a.peer_id, "B": peers["B"].peer_id, "C": peers["C"].peer_id}
    # expect=3 counts D, so every gather runs to its deadline, and must end there
    seen = gather_everywhere(a, {n: peers[n] for n in "BC"}, rnd, deadline=4, expect=3)
    for name, (packets, res) in seen.items():
        elapsed, by_peer = (res.elapsed_s, res.rejected_by_peer) if name == "A" else (res["elapsed"], res["by_peer"])
        assert elapsed < 4 + 1.5, name
        assert {p[0] for p in packets} == set(ids.values()) - {ids[name]}, name
        assert list(by_peer) == [d.peer_id], name  # its body died with it
        assert set(by_peer[d.peer_id]) <= {RejectReason.FETCH_FAILED, RejectReason.FETCH_TIMEOUT}
    assert wait_gone(tree["pids"], timeout=10) == [], "D's DHT process or p2pd outlived it"


def test_sigterm_shuts_the_node_down_cleanly(net):
    _, peers = net
    c = peers["C"]
    tree = c.call(op="descendants")
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert wait_gone(tree["pids"], timeout=10) == []


# ---------------------------------------------------------------- start-up, single node


def test_identity_persists_and_two_nodes_cannot_share_it(tmp_path):
    identity = tmp_path / "node" / "identity.key"
    with Swarm(local_config(identity_path=identity)) as first:
        peer_id, owner = first.peer_id, first.owner_subkey
        assert identity.exists() and peer_id_of_owner(owner) == peer_id  # one key: the owner proves the id
        with pytest.raises(SwarmStartError, match="already used by another") as err:
            Swarm(local_config(identity_path=identity)).start()
        assert "\n" not in str(err.value)
        # the refused second node must not have released the first one's lock
        with pytest.raises(SwarmStartError, match="already used"):
            Swarm(local_config(identity_path=identity)).start()
    with Swarm(local_config(identity_path=identity)) as again:
        assert again.peer_id == peer_id and again.owner_subkey == owner
        assert any(addr.endswith(f"/p2p/{peer_id}") for addr in again.join_addrs())


def test_corrupt_identity_is_a_clear_error(tmp_path):
    identity = tmp_path / "identity.key"
    identity.write_bytes(b"not a key")
    with pytest.raises(SwarmStartError, match="identity .* is unreadable.*delete it") as err:
        Swarm(local_config(identity_path=identity)).start()
    assert "\n" not in str(err.value)
    # the failed start released the identity: a good key file lets the next start through
    identity.unlink()
    with Swarm(local_config(identity_path=identity)) as swarm:
        assert swarm.alive and peer_id_of_owner(swarm.owner_subkey) == swarm.peer_id


def test_identity_lock_is_held_against_another_process(tmp_path):
    identity = tmp_path / "identity.key"
    code = (
        "import sys, time; from node.swarm.identity import NodeIdentity; from pathlib import Path;"
        "i = NodeIdentity.acquire(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(identity)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SwarmStartError, match=f"pid {holder.pid}"):
            Swarm(local_config(identity_path=identity)).start()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    "maddr, reason",
    [
        ("/ip4/127.0.0.1/tcp/abc", "base 10"),
        ("/ip4/127.0.0.1/tcp/4001", "no /p2p/<peer id>"),
        ("127.0.0.1:4001", "Must begin with /"),
        ("/ip4/127.0.0.1/tcp/4001/p2p/not-base58!", "base58"),
    ],
)
def test_bad_multiaddr_fails_fast_with_one_line(maddr, reason):
    started = time.monotonic()
    with pytest.raises(SwarmStartError, match="invalid peer address") as err:
        Swarm(local_config(initial_peers=[maddr])).start()
    assert time.monotonic() - started < 0.5
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_unreachable_bootstrap_fails_within_the_retry_budget():
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{VALID_PEER_ID}"
    started = time.monotonic()
    with pytest.raises(SwarmStartError, match="could not reach any bootstrap peer") as err:
        Swarm(local_config(initial_peers=[dead], bootstrap_attempts=2, bootstrap_backoff_s=0.1)).start()
    assert time.monotonic() - started < 15
    assert "after 2 attempts" in str(err.value) and "\n" not in str(err.value)


def test_port_in_use_is_reported():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SwarmStartError, match=f"port {port} on 127.0.0.1 is already in use"):
            Swarm(local_config(port=port)).start()


def test_records_expire_after_ttl_rounds():
    with Swarm(local_config(round_seconds=0.5, ttl_rounds=2)) as swarm:
        key = shard_key(SWARM_ID, 5, 0)
        assert swarm.publish(5, b"short-lived")
        assert swarm.dht.get(key, latest=True) is not None
        time.sleep(1.3)  # ttl = 2 rounds of 0.5 s
        assert swarm.dht.get(key, latest=True) is None


def test_publish_rejects_bad_input_clearly():
    with Swarm(local_config(max_packet_bytes=1000)) as swarm:
        with pytest.raises(ValueError, match="over max_packet_bytes=1000"):
            swarm.publish(1, bytes(1001))
        with pytest.raises(TypeError, match="packet must be bytes"):
            swarm.publish(1, "text")
        with pytest.raises(ValueError, match="deadline_s"):
            swarm.gather(1, deadline_s=-1)


def test_a_dead_dht_process_makes_calls_fail_fast_not_hang():
    with Swarm(local_config()) as swarm:
        os.kill(swarm.dht.pid, signal.SIGKILL)
        swarm.dht.join(timeout=10)
        assert not swarm.alive
        started = time.monotonic()
        res = swarm.gather(1, deadline_s=5)
        assert res.errors == {"dht_down": 1} and res.packets == []
        assert swarm.publish(1, bytes(SMALL)) is False
        assert time.monotonic() - started < 1.0


async def _take_result_lock(_dht, _node) -> None:
    """Runs inside a DHT process: take the lock it holds while writing a result, as a kill mid-write leaves it."""
    MPFuture._update_lock.acquire()


def test_a_dht_killed_holding_the_result_lock_does_not_freeze_the_next_one():
    swarm = Swarm(local_config()).start()
    swarm.dht.run_coroutine(_take_result_lock, return_future=True)
    time.sleep(0.5)
    os.kill(swarm.dht.pid, signal.SIGKILL)
    swarm.dht.join(timeout=10)
    swarm.shutdown()
    started = time.monotonic()
    with Swarm(local_config(startup_timeout=5)) as again:
        assert again.publish(1, b"still answers")
    assert time.monotonic() - started < 10


def test_swarm_api_before_start_and_double_shutdown():
    swarm = Swarm(local_config())
    with pytest.raises(SwarmError, match="not running"):
        swarm.publish(1, b"x")
    swarm.shutdown()
    swarm.shutdown()


# ---------------------------------------------------------------- pieces, no DHT


def _record(value, subkey=b"[owner:ssh-rsa AAAA]") -> DHTRecord:
    return DHTRecord(b"k", MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), 0.0)


def test_record_validator_bounds_size_schema_and_slots():
    v = HeaderRecordValidator()
    good = HeaderRecord(round=3, peer=VALID_PEER_ID, size=4, sha256=bytes(32), body=b"abcd").to_wire()
    assert v.validate(_record(good))
    assert not v.validate(_record(good, subkey=b"anyone"))  # slots must be owner-signed
    assert not v.validate(_record(good, subkey=None))  # no plain values either
    assert not v.validate(_record({**good, "size": 5}))  # inline body disagrees with its size
    assert not v.validate(_record({**good, "extra": 1}))
    assert not v.validate(_record({**good, "sha256": b"short"}))
    assert not v.validate(_record([1, 2, 3]))
    assert not v.validate(_record({**good, "shards": 3}))  # shard counts are powers of two
    assert not v.validate(_record({**good, "model": "x" * 129}))
    assert not v.validate(_record({**good, "v": 1}))  # the old single-key layout
    big = {**good, "size": MAX_RECORD_BYTES, "body": bytes(MAX_RECORD_BYTES)}
    assert not v.validate(_record(big))
    ref = {**good, "body": None, "size": 50 << 20}
    assert v.validate(_record(ref))  # a reference may announce a large body


def test_body_store_keeps_recent_rounds_within_its_byte_bound():
    store = BodyStore(keep_rounds=2, max_bytes=100)
    store.put(b"a", 1, b"x" * 30)
    store.put(b"b", 2, b"y" * 30)
    assert store.get(b"a") and store.get(b"b")
    store.put(b"c", 3, b"z" * 30)  # round 1 falls out of the two newest rounds
    assert store.get(b"a") is None and store.get(b"b") == b"y" * 30
    store.put(b"d", 3, b"w" * 60)  # 120 bytes > 100: the oldest round goes first
    assert store.get(b"b") is None and store.get(b"c") and store.get(b"d")
    assert store.total_bytes == 90 and len(store) == 2


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="inline_max_bytes"):
        SwarmConfig(inline_max_bytes=MAX_RECORD_BYTES)
    with pytest.raises(ValueError, match="swarm id"):
        SwarmConfig(swarm_id="Bad Name")
    with pytest.raises(ValueError):
        SwarmConfig(port=70000)


@pytest.mark.slow  # the quick `bench all` in test_bench_suite runs the real gather bench by default
def test_gather_bench_runs_on_a_small_swarm():
    from node.bench.gather import format_gather_bench, run_gather_bench

    result = run_gather_bench(peers=(3,), rounds=1, simulate=1000)
    size = result["by_size"]["3"]
    assert size["gathers"] == 3 and size["incomplete_gathers"] == 0 and size["peers_seen"] == 2
    assert 0 < result["gather_s_median"]["3"] < 10 and size["memory_per_peer_mib"] > 0
    # two ~80 KB packets of random tokens, plus the headers of the one shard
    assert 2 * size["packet_bytes"] < size["bytes_read_per_node"] < 2 * size["packet_bytes"] + (64 << 10)
    assert {row["nodes"] for row in result["simulation"]["rows"]} == {3, 100, 1000}
    assert "gather, 3 nodes" in format_gather_bench(result) and "model, 1000 nodes" in format_gather_bench(result)
    with pytest.raises(ValueError, match="swarm sizes"):
        run_gather_bench(peers=(1,))


def test_gather_volume_model_grows_with_k_not_with_the_swarm():
    from node.bench.gather_sim import simulate_volume

    measured = {  # the shape of one `bench gather` size (32 nodes, S = 2, 8 bodies of 78 KB)
        "nodes": 32,
        "packet_bytes": 78_000,
        "headers_read_per_node": 64,
        "header_bytes_per_node": 64 * 900,
        "dht_rpc_in_per_node": 6 * 64 * 900,
        "bytes_read_per_node": 8 * 78_000 + 64 * 900,
    }
    sim = simulate_volume(measured, max_nodes=10_000, k=8)
    rows = {row["nodes"]: row for row in sim["rows"]}
    assert sim["inputs"]["shard_reads_per_gather"] == 2 and sim["inputs"]["rpc_bytes_per_header_byte"] == 6
    assert rows[32]["read_bytes_per_node"] == sim["check"]["measured_read_bytes"]  # the model fits its input
    bodies = 8 * 78_000
    for n in (100, 1000, 10_000):
        assert rows[n]["body_read_bytes_per_node"] == bodies
        assert 16 <= rows[n]["headers_per_shard"] < 32  # about shard_target, whatever n
        assert rows[n]["read_bytes_per_node"] < 1.5 * rows[32]["read_bytes_per_node"]
        assert rows[n]["single_key_read_bytes_per_node"] > n / 40 * rows[n]["read_bytes_per_node"]
