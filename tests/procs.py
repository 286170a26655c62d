"""Small helpers of the tests that start real processes: a free port, the live p2pd processes."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def p2pd_pids() -> set[int]:
    """Every running p2pd (hivemind's daemon): a node must leave none behind."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "p2pd":
                    pids.add(int(entry.name))
            except OSError:
                pass
    return pids
