"""Several tasks as one: each prompt is drawn from one of them, at random (SAPO trains on a mix
of reasoning-gym task types).

    mix:<spec>,<spec>,...     e.g. mix:gym:chain_sum?max_terms=2,gym:products?max_digits=1

Ids are the members' own ids, so a peer on the same mix rebuilds and re-scores every
problem with the member that issued it; a peer on one member alone still owns that
member's ids. Members are any task spec but another mix.
"""

from __future__ import annotations

from node.tasks.base import Problem, Rng, Task, TaskError, draw_int

__all__ = ["MixTask"]


class MixTask(Task):
    """Prompts from each member in turn of a random draw; ids, problems and rewards are the members'."""

    def __init__(self, members: list[Task], spec: str) -> None:
        if len(members) < 2:
            raise TaskError(f"task spec {spec!r}: a mix needs at least two tasks, separated by ','")
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise TaskError(f"task spec {spec!r}: a task repeats in the mix")
        self.members = members
        self.name = spec
        self.id_prefix = ""  # no common prefix: `owns` asks the members

    def _member(self, task_id: str) -> Task:
        for member in self.members:
            if member.owns(task_id):
                return member
        raise TaskError(f"task id {task_id!r} belongs to none of the tasks of {self.name!r}")

    def owns(self, task_id: str) -> bool:
        return isinstance(task_id, str) and any(m.owns(task_id) for m in self.members)

    def sample(self, rng: Rng) -> str:
        return self.members[draw_int(rng, 0, len(self.members) - 1)].sample(rng)

    def problem(self, task_id: str) -> Problem:
        return self._member(task_id).problem(task_id)

    def reward(self, problem: Problem, completion: str) -> float:
        return self._member(problem.task_id).reward(problem, completion)
