"""Finding the swarm again after losing it (the bootstrap node went away, then came back).

hivemind drops a node from its routing table the first time a request to it fails, and
never asks for it again; a bootstrap node that restarts has an empty table and asks
nobody. Without help, a node whose only link was the bootstrap stays alone for good.

So before each gather (at most every `rejoin_interval_s`) the node checks, inside its DHT
process, that its bootstrap peers are in its routing table, and pings those that are not,
dialling their multiaddrs first (the address book of p2pd forgets a dead peer's address).
When its table has fewer than `rejoin_min_neighbors` nodes, it also pings peers it saw
headers from recently (p2pd dials them by the addresses it still remembers). A ping that
is answered puts both nodes in each other's tables, and the swarm is whole again.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

__all__ = ["rejoin"]

logger = logging.getLogger(__name__)


async def rejoin(_dht, node, bootstrap: list[str], known: list[str], min_neighbors: int, timeout: float) -> int:
    """Runs in the DHT process. Pings the missing bootstrap peers (and known peers, if the table is thin).

    Returns how many of them answered.
    """
    table = node.protocol.routing_table
    present = {str(p) for p in table.peer_id_to_uid}
    me = str(node.peer_id)
    by_peer: dict[str, list[Multiaddr]] = {}
    for addr in bootstrap:
        maddr = Multiaddr(addr)
        by_peer.setdefault(maddr["p2p"], []).append(maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}")))
    targets = [p for p in by_peer if p not in present and p != me]
    if len(present) < min_neighbors:
        targets += [p for p in known if p not in present and p != me and p not in by_peer]

    async def ping(peer: str) -> bool:
        peer_id = PeerID.from_base58(peer)
        try:
            async with asyncio.timeout(timeout):
                if peer in by_peer:
                    await node.p2p._client.connect(peer_id, by_peer[peer])  # p2pd's address book may have lost it
                return await node.protocol.call_ping(peer_id) is not None
        except Exception as e:  # down, unreachable, or not a DHT node: try again next time
            logger.debug("rejoin: %s did not answer: %r", peer, e)
            return False

    answered = await asyncio.gather(*(ping(p) for p in targets))
    return sum(answered)
