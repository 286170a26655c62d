"""A whole task from the user's code: ``py:<module>:<factory>[?key=value&...]``, or a task kind
an installed package adds under the entry-point group ``ftis_node.tasks``
(``--task <kind>:<rest>`` calls that factory with ``rest``).

A factory is called with the query's pairs as keyword arguments (values as text) and returns
a `Task` (see node/tasks/base.py and docs/tasks.md). Every node of a swarm loads the same
factory with the same arguments, so each rebuilds the same problems from an id.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from node.tasks.base import Task, TaskError, text_options
from node.tasks.rewards import import_object

__all__ = ["ENTRY_POINT_GROUP", "installed_task_kinds", "plugin_task"]

ENTRY_POINT_GROUP = "ftis_node.tasks"


def installed_task_kinds() -> dict[str, Any]:
    """Task kinds installed packages add: kind -> its entry point."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _built(factory: Any, where: str, *args: Any, **kwargs: Any) -> Task:
    if not callable(factory):
        raise TaskError(f"{where} is a {type(factory).__name__}, not a function that returns a Task")
    try:
        task = factory(*args, **kwargs)
    except TaskError:
        raise
    except Exception as err:  # the user's code: one line saying what it raised
        raise TaskError(f"{where} raised {type(err).__name__}: {err}") from None
    if not isinstance(task, Task):
        raise TaskError(f"{where} returned {type(task).__name__}, not a node.tasks.Task")
    for attr in ("name", "id_prefix"):
        if not isinstance(getattr(task, attr, None), str):
            raise TaskError(f"{where}: the task it returned has no string {attr!r}")
    return task


def plugin_task(spec: str) -> Task:
    """The task ``py:<module>:<factory>[?k=v...]`` builds."""
    target, _, query = spec.partition("?")
    where = f"task factory {target!r}"
    factory = import_object(target, "task factory")
    return _built(factory, where, **text_options(query, f"py:{spec}"))


def entry_point_task(kind: str, rest: str) -> Task:
    """The task the installed kind ``kind`` builds from the rest of its spec."""
    entry = installed_task_kinds()[kind]
    try:
        factory = entry.load()
    except Exception as err:
        raise TaskError(f"task kind {kind!r} ({entry.value}) does not load ({type(err).__name__}: {err})") from None
    return _built(factory, f"task kind {kind!r} ({entry.value})", rest)
