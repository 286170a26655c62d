"""Errors raised by the swarm layer.

Only start-up failures are exceptions: once a node runs, bad data from the network is
counted and logged (see `gather.GatherResult`), never raised.
"""

from __future__ import annotations

__all__ = ["DHTUnavailableError", "SwarmError", "SwarmStartError"]


class SwarmError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class SwarmStartError(SwarmError):
    """The DHT could not start. The message is one line that says what to do; the CLI prints it as is."""


class DHTUnavailableError(SwarmError):
    """The DHT process is gone (crashed or shut down); calls fail at once instead of blocking on its pipe."""
