"""The swarm layer: a node's hivemind DHT and the packets it exchanges over it.

    with Swarm(SwarmConfig(initial_peers=[...], identity_path=...)).start() as swarm:
        print("join with:", swarm.join_addrs()[0])
        swarm.publish(r, packet_bytes, model="tiny-s", adapter_version="ab12")
        result = swarm.gather(r, deadline_s=5, expect_peers=3)

The API is synchronous (the daemon's training loop is). Packets are opaque bytes. The
modules: `dht` (settings, start-up, identity, hivemind work-arounds), `record` (the
signed header and who wrote it), `shards` (where headers go, what a node reads),
`bodies` (packet bodies over libp2p), `client` (calls into the DHT process), `ledger`
(what was judged, who was seen), `gather` (one gather), `packets` (publish + gather).
docs/scale.md explains the layout and its costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator

from node.swarm.client import RecordClient
from node.swarm.dht import SwarmConfig, SwarmDHT, dht_time, install_sigterm_handler, start_dht
from node.swarm.errors import DHTUnavailableError, SwarmError, SwarmStartError
from node.swarm.gather import BodyCheck, GatheredPacket, GatherResult
from node.swarm.identity import NodeIdentity
from node.swarm.packets import PacketExchange
from node.swarm.record import HeaderRecordValidator, RejectReason
from protocol.keys import round_at

__all__ = [
    "DHTUnavailableError",
    "GatherResult",
    "GatheredPacket",
    "RejectReason",
    "Swarm",
    "SwarmConfig",
    "SwarmError",
    "SwarmStartError",
    "dht_time",
    "install_sigterm_handler",
]

logger = logging.getLogger(__name__)


class Swarm:
    """One node's membership in the swarm. `start()` it, use it, `shutdown()` it (or use `with`)."""

    def __init__(self, config: SwarmConfig | None = None, *, body_check: BodyCheck | None = None) -> None:
        """`body_check(signer, body)`: a reason to refuse a fetched body before it is delivered,
        or None (a node passes `node.swarm.ledger.body_verdict`, which reads the packet's own
        header); without it bodies are opaque bytes."""
        self.config = config or SwarmConfig()
        self.body_check = body_check
        self._identity: NodeIdentity | None = None
        self._dht: SwarmDHT | None = None
        self._exchange: PacketExchange | None = None
        self._peer_id: str | None = None
        self._join_addrs: list[str] = []

    # ------------------------------------------------------------ life cycle

    def start(self) -> Swarm:
        """Start the DHT and join the swarm; raises `SwarmStartError` with a one-line reason."""
        if self._identity is not None:
            raise SwarmError("this Swarm was already started; make a new one")
        cfg = self.config
        identity = NodeIdentity.acquire(cfg.identity_path)
        self._identity = identity
        if cfg.identity_path is not None:  # the resolved file that is locked
            cfg = self.config = cfg.model_copy(update={"identity_path": identity.identity_path})
        try:
            # Records are signed with the libp2p identity key (not hivemind's process-wide key),
            # so the owner subkey of every record proves its writer's peer id.
            signer = RSASignatureValidator(identity.key)
            self._dht = start_dht(cfg, [signer, HeaderRecordValidator()], identity)
            self._peer_id = str(self._dht.peer_id)
            if self._peer_id != identity.peer_id:
                raise SwarmStartError(f"p2pd runs as {self._peer_id}, not as the identity {identity.peer_id}")
            maddrs = self._dht.get_visible_maddrs()
            self._join_addrs = _loopback_last([str(m) for m in maddrs])
            client = RecordClient(self._dht, read_beam=cfg.read_beam)
            self._exchange = PacketExchange(
                client, cfg, self._peer_id, signer.local_public_key, body_check=self.body_check
            )
            self._exchange.install()
        except SwarmStartError:
            self.shutdown()
            raise
        except Exception as e:  # started, then stopped answering: still a start-up failure for the caller
            self.shutdown()
            raise SwarmStartError(f"the DHT started but then failed: {' '.join(str(e).split()) or repr(e)}") from e
        except BaseException:
            self.shutdown()
            raise
        logger.info("joined swarm %r as %s", cfg.swarm_id, self._peer_id)
        return self

    def shutdown(self) -> None:
        """Stop the DHT process (and p2pd) and release the identity. Safe to call twice."""
        dht, exchange = self._dht, self._exchange
        self._dht = self._exchange = None
        if dht is not None:
            try:
                if exchange is not None:
                    exchange.client.shutdown()  # under the pipe lock
                else:
                    dht.shutdown()
            except Exception as e:  # the pipe may already be gone with the DHT process
                logger.debug("DHT shutdown: %r", e)
                if dht.is_alive():
                    dht.terminate()
        if self._identity is not None:
            self._identity.release()

    def __enter__(self) -> Swarm:
        return self if self._dht is not None else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._dht is not None and self._dht.is_alive()

    # ------------------------------------------------------------ identity

    @property
    def peer_id(self) -> str:
        self._require()
        return self._peer_id  # type: ignore[return-value]

    @property
    def owner_subkey(self) -> bytes:
        """The DHT subkey only this node can write (its record key's public half)."""
        return self._require().owner_subkey

    def join_addrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<peer id>) that other nodes pass to join; loopback ones last."""
        self._require()
        return list(self._join_addrs)

    @staticmethod
    def dht_time() -> float:
        return dht_time()

    def current_round(self) -> int:
        return round_at(dht_time(), self.config.round_seconds)

    def shards_for(self, round: int) -> int:
        """How many shard keys this node uses for `round` (the setting, or from its swarm-size estimate)."""
        return self._require().shards_for(round)

    # ------------------------------------------------------------ packets

    def publish(self, round: int, packet: bytes, *, model: str = "", adapter_version: str = "") -> bool:
        """Publish this node's packet for `round` (one per round; peers that already took one ignore a second).

        `model` and `adapter_version` go into the signed header, for other nodes' swarm view.
        """
        return self._require().publish(round, packet, model=model, adapter_version=adapter_version)

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
        """Peers' new packets for `round` (and `stale_rounds` before it); limits default to the config.

        At most `max_peers` (default `max_peers_per_round`) packets; peers in `exclude_peers`
        (quarantined by the node) are neither fetched nor judged, only counted in `skipped`;
        peers in `trusted_peers` are fetched first, and a quarter of the slots is kept for them.
        `on_progress(n)` hears how many peers have delivered so far, as it changes.
        """
        return self._require().gather(
            round,
            deadline_s=deadline_s,
            expect_peers=expect_peers,
            max_packet_bytes=max_packet_bytes,
            max_total_bytes=max_total_bytes,
            stale_rounds=stale_rounds,
            max_peers=max_peers,
            exclude_peers=exclude_peers,
            trusted_peers=trusted_peers,
            on_progress=on_progress,
        )

    def known_peers(self) -> list[dict[str, Any]]:
        """Every peer with a valid header in recent rounds (bounded), most recent first:
        {peer_id, model, adapter_version, round, size, last_seen}."""
        return self._require().known_peers()

    @property
    def dht(self) -> SwarmDHT:
        """The underlying hivemind DHT, for tools and tests that need raw records."""
        self._require()
        return self._dht  # type: ignore[return-value]

    def _require(self) -> PacketExchange:
        if self._exchange is None:
            raise SwarmError("the swarm is not running; call start() first")
        return self._exchange


def _loopback_last(addrs: list[str]) -> list[str]:
    return sorted(addrs, key=lambda a: a.startswith(("/ip4/127.", "/ip6/::1/")))
