"""Small helpers of the tests that start real processes: a free port, a node's status, the live p2pd processes."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_of(url: str) -> dict:
    """A node's GET /status, or {} while it does not answer (still loading, or gone)."""
    import httpx

    try:
        return httpx.get(url + "/status", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent pid) of a process, from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]
    return state, int(ppid)


def p2pd_pids(under: Path | None = None) -> set[int]:
    """Every running p2pd (hivemind's daemon): a node must leave none behind.

    A zombie counts as gone (it has exited; PID 1 here reaps re-parented children late).
    With `under`, only the daemons whose identity file lies below that folder: the ones a
    test's own nodes started, not those of other tests running on the same machine.
    """
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "p2pd" or _stat(int(entry.name))[0] == "Z":
                continue
            if under is not None and str(under) not in (entry / "cmdline").read_text().replace("\0", " "):
                continue
        except (OSError, ValueError):  # it exited while we looked
            continue
        pids.add(int(entry.name))
    return pids


def describe(pids: set[int]) -> str:
    """One line per process: pid, state, parent, command line (for a failure message)."""
    lines = []
    for pid in sorted(pids):
        try:
            state, ppid = _stat(pid)
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:300]
            lines.append(f"pid {pid} state {state} parent {ppid}: {cmd}")
        except (OSError, ValueError):
            lines.append(f"pid {pid}: gone")
    return "\n".join(lines)
