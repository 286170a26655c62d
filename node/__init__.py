"""ftis-node: the node daemon (config, CLI, swarm, rollout engines, tasks, trainer, API)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ftis-node")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"
