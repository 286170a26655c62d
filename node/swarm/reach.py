"""Can other nodes dial this one? A check at start, answered by a peer we are connected to.

Peers fetch a node's packet bodies from the node itself, so a node others cannot dial
(behind NAT or a firewall, or announcing an address that is not its own) has its headers
in the DHT but its bodies out of reach, except over connections it opened itself.

The check: the node sends a peer (its bootstrap) the addresses it announces; the peer
opens a plain TCP connection to each and says which answered, and from which address it
sees the node. To keep this from being a port scanner for anyone, a peer only dials
addresses on the IP the request's own connection comes from, at most `_MAX_ADDRS` of
them, sends nothing on them, and answers each peer at most once per `_PER_PEER_S`.

Runs inside the DHT process, like `bodies`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time

from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer
from hivemind.utils.multiaddr import Multiaddr

__all__ = ["REACH_HANDLER", "ask_reachability", "install_reach_service", "verdict"]

logger = logging.getLogger(__name__)

REACH_HANDLER = "ftis.reach.v1"
_MAX_ADDRS = 4
_MAX_REQUEST = 4096
_DIAL_TIMEOUT_S = 3.0
_PER_PEER_S = 30.0
_LEN_BYTES = 8


def _tcp_target(maddr: str) -> tuple[str, int] | None:
    try:
        m = Multiaddr(maddr)
        protocols = {p.name for p in m.protocols()}
        host = m["ip4"] if "ip4" in protocols else m["ip6"] if "ip6" in protocols else None
        return (host, int(m["tcp"])) if host is not None and "tcp" in protocols else None
    except Exception:  # the multiaddr library raises several unrelated types
        return None


def _ip_of(maddr: Multiaddr) -> str | None:
    target = _tcp_target(str(maddr))
    return None if target is None else str(ipaddress.ip_address(target[0]))


async def _dial(host: str, port: int) -> str:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _DIAL_TIMEOUT_S)
    except TimeoutError:
        return "timeout"
    except OSError:
        return "refused"
    writer.close()
    return "open"


async def _serve_reach(answered: dict[str, float], stream_info, reader, writer) -> None:
    """Request: msgpack list of multiaddrs (length-prefixed). Answer: {"seen_from": str, "results": {addr: status}}."""
    try:
        peer, now = str(stream_info.peer_id), time.monotonic()
        if now - answered.get(peer, -_PER_PEER_S) < _PER_PEER_S:
            return
        answered[peer] = now
        if len(answered) > 4096:  # bounded memory: forget the oldest
            del answered[next(iter(answered))]
        size = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
        if size > _MAX_REQUEST:
            return
        addrs = MSGPackSerializer.loads(await reader.readexactly(size))
        if not isinstance(addrs, list):
            return
        seen_ip = _ip_of(stream_info.addr)
        results: dict[str, str] = {}
        for text in [a for a in addrs if isinstance(a, str)][:_MAX_ADDRS]:
            target = _tcp_target(text)
            if target is None:
                results[text] = "not_tcp"
            elif str(ipaddress.ip_address(target[0])) != seen_ip:
                results[text] = "other_ip"  # not the address this connection comes from: not dialled
            else:
                results[text] = await _dial(*target)
        answer = {"seen_from": str(stream_info.addr), "results": results}
        await P2P.send_raw_data(MSGPackSerializer.dumps(answer), writer)
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def install_reach_service(_dht, node) -> None:
    answered: dict[str, float] = {}
    await node.p2p.add_binary_stream_handler(REACH_HANDLER, lambda *a: _serve_reach(answered, *a))


async def ask_reachability(_dht, node, peer: str, addrs: list[str], timeout: float) -> dict | None:
    """The peer's answer, or None if it did not give one (an older node, or no answer in `timeout`)."""
    try:
        async with asyncio.timeout(timeout):
            _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), REACH_HANDLER)
            try:
                await P2P.send_raw_data(MSGPackSerializer.dumps(list(addrs)), writer)
                size = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
                if size > _MAX_REQUEST * 4:
                    return None
                answer = MSGPackSerializer.loads(await reader.readexactly(size))
            finally:
                writer.close()
    except Exception as e:  # no handler, no answer, a reset stream: the check is not possible
        logger.debug("reachability check with %s failed: %r", peer, e)
        return None
    return answer if isinstance(answer, dict) else None


def verdict(answer: dict | None, addrs: list[str], peer: str) -> tuple[bool | None, str]:
    """(reachable, one line for the user): True, False, or None when it could not be checked."""
    fix = (
        "peers cannot fetch this node's packets unless it opened the connection itself; forward a port to it "
        "and pass --announce /ip4/<public ip>/tcp/<port>, or run it with --client-mode (docs/network.md)"
    )
    if not addrs:
        return False, f"reachability: this node announces no address; {fix}"
    if answer is None:
        return None, f"reachability: not checked (peer {peer[:12]}… gave no answer)"
    results = {str(a).split("/p2p/")[0]: status for a, status in (answer.get("results") or {}).items()}
    seen = str(answer.get("seen_from", "?"))
    open_ = [a for a, status in results.items() if status == "open"]
    if open_:
        return True, f"reachability: peers can dial this node at {open_[0]} (checked from {peer[:12]}…)"
    if results and all(status == "other_ip" for status in results.values()):
        return False, (
            f"reachability: peers see this node as {seen}, not at its addresses ({', '.join(results)}): "
            f"behind NAT or announcing the wrong address; {fix}"
        )
    shown = ", ".join(f"{a} {s}" for a, s in results.items())
    return False, f"reachability: peer {peer[:12]}… could not dial this node ({shown}); {fix}"
