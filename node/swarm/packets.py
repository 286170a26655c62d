"""Publishing and gathering one node's packets; used through `node.swarm.Swarm`.

Publish: the body goes into this node's `BodyStore` (served P2P) unless it is tiny, and a
signed `HeaderRecord` into shard `hash(peer id) mod S` of the round. Gather: a `GatherRun`
over this node's own shard plus a random sample of others (`shards.read_order`).

The state kept between gathers is explicit and owned here: the `GatherLedger` (what was
judged), `KnownPeers` (who was seen) and the `SizeEstimate` (how many peers there are,
which sets S when the `shards` setting is 0).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from functools import partial
from typing import Any

from hivemind.utils import MPFuture, MSGPackSerializer

from node.swarm import reach
from node.swarm.client import RecordClient
from node.swarm.dht import SwarmConfig, dht_time
from node.swarm.gather import BodyCheck, FetchBudget, GatherPlan, GatherResult, GatherRun
from node.swarm.ledger import GatherLedger, KnownPeers
from node.swarm.record import SIGNATURE_MARK, HeaderRecord
from node.swarm.rejoin import rejoin
from node.swarm.shards import SizeEstimate, read_order, shard_count, shard_key, shard_of

__all__ = ["PacketExchange"]

logger = logging.getLogger(__name__)


class PacketExchange:
    """One node's packets in the swarm: publish its own, gather its peers'."""

    def __init__(
        self,
        client: RecordClient,
        config: SwarmConfig,
        peer_id: str,
        owner_subkey: bytes,
        *,
        body_check: BodyCheck | None = None,
    ) -> None:
        self.client, self.config = client, config
        self.body_check = body_check
        self.peer_id, self.owner_subkey = peer_id, owner_subkey
        self.ledger = GatherLedger()
        self.known = KnownPeers(max_peers=config.known_peers_max, keep_rounds=config.known_peers_rounds)
        self.estimate = SizeEstimate()
        self.budget = FetchBudget(config.fetch_base_s, config.fetch_min_bytes_per_s, config.fetch_timeout_s)
        self._carried: list = []  # fetches the last gather left running, for the next one
        self._gathers = 0
        self.reachable: bool | None = None  # can peers dial this node (None: not checked); see `reach`
        self.reachability = ""
        self._shards_by_round: dict[int, int] = {}  # S this node used for a round, fixed once chosen
        self._state_lock = threading.Lock()  # one gather at a time (the ledger is not shared)
        self._shards_lock = threading.Lock()  # publish may run while a gather does
        self._logged: set[str] = set()
        self._rejoin: tuple[float, MPFuture | None] = (-math.inf, None)  # (when sent, its future)

    # ------------------------------------------------------------ start-up

    def install(self) -> None:
        cfg = self.config
        installing = self.client.install_body_service(cfg.body_keep_rounds, cfg.body_store_max_bytes)
        installing.result(timeout=cfg.startup_timeout)
        self.client.run(reach.install_reach_service).result(timeout=cfg.startup_timeout)
        self.reachable, self.reachability = self.check_reachability()

    def check_reachability(self) -> tuple[bool | None, str]:
        """Ask the first bootstrap peer whether it can dial this node; logs one line unless it can."""
        cfg = self.config
        if not cfg.initial_peers:
            return None, "reachability: not checked (this node started the swarm)"
        peer = cfg.initial_peers[0].rsplit("/p2p/", 1)[-1]
        try:
            addrs = [str(m) for m in self.client.dht.get_visible_maddrs()]
            asking = partial(reach.ask_reachability, peer=peer, addrs=addrs, timeout=4 * cfg.rpc_timeout_s)
            answer = self.client.run(asking).result(timeout=5 * cfg.rpc_timeout_s)
        except Exception as e:  # a start-up check: never worth failing the start
            logger.debug("reachability check failed: %r", e)
            addrs, answer = [], None
        reachable, line = reach.verdict(answer, addrs, peer)
        (logger.info if reachable else logger.warning)(line)
        return reachable, line

    # ------------------------------------------------------------ shards

    def shards_for(self, round: int) -> int:
        """S for `round`: the setting, or from the swarm-size estimate; the same for the whole round."""
        with self._shards_lock:
            if round not in self._shards_by_round:
                cfg = self.config
                s = cfg.shards or shard_count(self.estimate.value, cfg.shard_target)
                self._shards_by_round[round] = s
                for old in [r for r in self._shards_by_round if r < round - 2 * cfg.ttl_rounds]:
                    del self._shards_by_round[old]
            return self._shards_by_round[round]

    # ------------------------------------------------------------ publish

    def publish(self, round: int, packet: bytes, *, model: str = "", adapter_version: str = "") -> bool:
        """Store this node's packet for `round`; False (logged) if the DHT did not take it."""
        if not isinstance(packet, (bytes, bytearray, memoryview)):
            raise TypeError(f"packet must be bytes, got {type(packet).__name__}")
        packet = bytes(packet)
        cfg = self.config
        if len(packet) > cfg.max_packet_bytes:
            raise ValueError(f"packet has {len(packet)} bytes, over max_packet_bytes={cfg.max_packet_bytes}")
        shards = self.shards_for(round)
        key = shard_key(cfg.swarm_id, round, shard_of(self.peer_id, shards))
        digest = hashlib.sha256(packet).digest()
        record = HeaderRecord(
            round=round,
            peer=self.peer_id,
            shards=shards,
            model=_printable(model),
            adapter=_printable(adapter_version),
            size=len(packet),
            sha256=digest,
            body=packet,
        )
        value = record.to_wire()
        inline = len(packet) <= cfg.inline_max_bytes and SIGNATURE_MARK not in MSGPackSerializer.dumps(value)
        try:
            if not inline:
                self.client.offer_body(digest, round, packet).result(timeout=self._call_timeout)
                value = record.model_copy(update={"body": None}).to_wire()
            expiration = dht_time() + cfg.ttl_rounds * cfg.round_seconds
            stored = self.client.store(key, value, expiration, self.owner_subkey).result(timeout=self._call_timeout)
        except TimeoutError:
            self._log_once("publish_timeout", "publishing round %d timed out; is the DHT process alive?", round)
            return False
        except Exception as e:  # a broken pipe, or whatever failed inside the DHT process
            self._log_once("publish_error", "publishing round %d failed: %r", round, e)
            return False
        if not stored:
            self._log_once("publish_refused", "no DHT peer stored our record for round %d", round)
        return bool(stored)

    @property
    def _call_timeout(self) -> float:
        return max(10.0, 4 * self.config.rpc_timeout_s)

    # ------------------------------------------------------------ gather

    def gather(
        self,
        round: int,
        *,
        deadline_s: float,
        expect_peers: int | None = None,
        max_packet_bytes: int | None = None,
        max_total_bytes: int | None = None,
        stale_rounds: int | None = None,
        max_peers: int | None = None,
        exclude_peers: Collection[str] = (),
        trusted_peers: Collection[str] = (),
        on_progress: Callable[[int], None] | None = None,
    ) -> GatherResult:
        """Peers' packets for `round` (and up to `stale_rounds` before it) that this node has not seen yet.

        Returns when `expect_peers` distinct peers (or `max_peers`, whichever is fewer)
        delivered a packet, or after `deadline_s`. Nothing from the network raises: it is
        counted in the result.
        """
        cfg = self.config
        if not (isinstance(deadline_s, (int, float)) and math.isfinite(deadline_s) and deadline_s >= 0):
            raise ValueError(f"deadline_s must be a finite number >= 0, got {deadline_s!r}")
        if expect_peers is not None and expect_peers < 0:
            raise ValueError(f"expect_peers must be >= 0 or None, got {expect_peers}")
        stale = cfg.stale_rounds if stale_rounds is None else stale_rounds
        if stale < 0:
            raise ValueError(f"stale_rounds must be >= 0, got {stale}")
        k = cfg.max_peers_per_round if max_peers is None else max_peers
        if k < 1:
            raise ValueError(f"max_peers must be >= 1, got {k}")
        self.maintain()
        shards = self.shards_for(round)
        with self._state_lock:
            plan = GatherPlan(
                round=round,
                stale=tuple(range(round - 1, max(round - stale, 0) - 1, -1)),
                order=tuple(read_order(self.peer_id, round, shards)),
                first_reads=min(shards, 1 + cfg.sample_shards),
                max_reads=max(1 + cfg.sample_shards, cfg.max_shard_reads),
                deadline=time.monotonic() + deadline_s,
                expect_peers=expect_peers,
                max_peers=k,
                max_packet_bytes=cfg.max_packet_bytes if max_packet_bytes is None else max_packet_bytes,
                max_total_bytes=cfg.max_total_bytes if max_total_bytes is None else max_total_bytes,
                exclude=frozenset(exclude_peers),
                trusted=frozenset(trusted_peers),
            )
            self.ledger.forget_before(round - stale - 2)
            self.known.prune(round)
            self._gathers += 1
            run = GatherRun(
                self.client,
                cfg,
                cfg.swarm_id,
                self.peer_id,
                plan,
                self.ledger,
                self.known,
                self._log_once,
                on_progress,
                budget=self.budget,
                carried=self._carried,
                serial=self._gathers,
                body_check=self.body_check,
            )
            result = run.run()
            self._carried = run.carry
            if result.shards_read:
                self.estimate.add(result.shards_read, run.writer_shards.values())
            return result

    def known_peers(self) -> list[dict[str, Any]]:
        return self.known.view()

    def maintain(self) -> None:
        """Start a `rejoin` check in the DHT process unless one ran recently; never waits for it."""
        cfg = self.config
        sent, future = self._rejoin
        if time.monotonic() - sent < cfg.rejoin_interval_s or (future is not None and not future.done()):
            return
        known = [p["peer_id"] for p in self.known.view()[: cfg.rejoin_known_peers]]
        coro = partial(
            rejoin,
            bootstrap=list(cfg.initial_peers),
            known=known,
            min_neighbors=cfg.rejoin_min_neighbors,
            timeout=cfg.rpc_timeout_s,
        )
        try:
            self._rejoin = (time.monotonic(), self.client.run(coro))
        except Exception as e:  # the DHT is gone: the gather will say so
            logger.debug("rejoin not started: %r", e)

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            # The detail of the first of its kind; every one is counted, per kind, on the round lines and in /status.
            logger.warning(message + " (the first of its kind; later ones are counted on the round lines)", *args)


def _printable(text: str) -> str:
    """Header text fields are short printable ASCII (shown on dashboards as they are)."""
    return "".join(c if " " <= c <= "~" else "?" for c in str(text))[:128]
