"""What `--swarm` accepts: a peer's multiaddr, or the URL of any running node's status API.

    --swarm /ip4/1.2.3.4/tcp/31337/p2p/QmXy76...     used as it is
    --swarm http://1.2.3.4:8470                         asks that node for its peer id

The URL form is what compose files and Kubernetes use (a peer id is unknown until a
node first starts), and what a person can type from a dashboard's address bar. The
node's announced addresses are rewritten to the host of the URL, because the address a
node sees for itself (a container's, a pod's) is often not the one others reach.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlparse

import httpx

from node.swarm.errors import SwarmStartError

WAIT_NOTICE_S = 10.0  # how often a joiner that waits says so
_EXAMPLE = "a multiaddr like /ip4/1.2.3.4/tcp/31337/p2p/QmXy76... or a node's status URL like http://1.2.3.4:8470"


def resolve_initial_peers(
    entries: list[str], timeout: float = 120.0, on_wait: Callable[[str], None] | None = None
) -> list[str]:
    """Multiaddrs for `hivemind.DHT(initial_peers=...)`; SwarmStartError with one clear line otherwise.

    A status URL that does not answer yet is asked again with backoff until `timeout`;
    `on_wait` gets a line saying what it waits for (after 2 s, then every `WAIT_NOTICE_S`).
    """
    out: list[str] = []
    for entry in entries:
        entry = entry.strip()
        if entry.startswith("/"):
            out.append(entry)
        elif entry.startswith(("http://", "https://")):
            out.extend(addrs_from_status_url(entry, timeout, on_wait))
        else:
            raise SwarmStartError(f"--swarm {entry!r} is not {_EXAMPLE}")
    return list(dict.fromkeys(out))


def addrs_from_status_url(url: str, timeout: float, on_wait: Callable[[str], None] | None = None) -> list[str]:
    """Ask a node's API for its join addresses, retrying until `timeout` (it may be starting)."""
    parsed = urlparse(url)
    if not parsed.hostname:
        raise SwarmStartError(f"--swarm {url!r} has no host; use {_EXAMPLE}")
    status_url = url.rstrip("/") + "/status"
    started = time.monotonic()
    deadline = started + timeout
    delay, last_error = 0.5, ""
    noticed = started - WAIT_NOTICE_S + 2.0  # the first notice after 2 s (a quick answer needs none)
    while True:
        try:
            reply = httpx.get(status_url, timeout=min(5.0, max(deadline - time.monotonic(), 0.5)))
            reply.raise_for_status()
            status = reply.json()
            addrs = status.get("join_addrs") or []
            if addrs:
                return _rewrite_host(addrs, parsed.hostname)
            # A node loads its model before it joins: say which phase it is in.
            last_error = f"it answers but has not joined its swarm yet (phase: {status.get('phase', '?')})"
        except (httpx.HTTPError, ValueError, AttributeError) as err:
            last_error = _reason(err)
        now = time.monotonic()
        if now + delay > deadline:
            raise SwarmStartError(
                f"could not get join addresses from {status_url} within {timeout:.0f}s ({last_error}); "
                "check that the node runs and its API listens there (--api-host 0.0.0.0 on that node)"
            )
        if on_wait is not None and now - noticed >= WAIT_NOTICE_S:
            noticed = now
            on_wait(
                f"waiting for {status_url} to give its join addresses: {last_error} "
                f"({now - started:.0f} s of {timeout:.0f} s)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def _reason(err: BaseException) -> str:
    if isinstance(err, httpx.ConnectError):
        return "nothing listens there yet (connection refused)" if "refused" in str(err).lower() else str(err)
    return " ".join(str(err).split()) or type(err).__name__


def _rewrite_host(addrs: list[str], host: str) -> list[str]:
    """Point each /ip4|ip6|dns/<x>/tcp/<port>/p2p/<id> address at `host`, keeping port and id."""
    try:
        ip = socket.gethostbyname(host)
    except OSError as err:
        raise SwarmStartError(f"cannot resolve {host!r} from --swarm ({err.strerror})") from None
    rewritten = []
    for addr in addrs:
        parts = addr.split("/")
        # ['', 'ip4', '10.0.0.5', 'tcp', '31337', 'p2p', '12D3...']
        if len(parts) >= 7 and parts[3] == "tcp" and parts[5] == "p2p":
            rewritten.append(f"/ip4/{ip}/tcp/{parts[4]}/p2p/{parts[6]}")
    return list(dict.fromkeys(rewritten)) or addrs


def join_swarm(cfg):
    """The node's swarm (`node.swarm.Swarm`), started: `cfg.swarm` resolved to multiaddrs (a
    status URL is asked, waiting up to --swarm-wait) and the identity key kept in the data dir."""
    from node.swarm import Swarm
    from node.swarm.ledger import body_verdict

    cfg.node_dir.mkdir(parents=True, exist_ok=True)
    return Swarm(
        cfg.swarm_config(
            initial_peers=resolve_initial_peers(cfg.swarm, timeout=cfg.swarm_wait),
            identity_path=cfg.node_dir / "identity.key",
        ),
        body_check=body_verdict,  # junk and relayed copies never use up a slot or a true sender's delivery
    ).start()
