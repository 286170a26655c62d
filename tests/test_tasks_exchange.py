"""Two nodes on a user's own task: one's packet of `py:` / `hf:` ids is rebuilt, re-scored with
the receiver's own reward and admitted; a node holding other data rejects it as another task's."""

from __future__ import annotations

import random

from node.defence.admission import Admission
from node.models import tokenizer_fingerprint
from node.tasks import get_task, with_rewards
from tests.test_admission import PEER, local, packet
from tests.test_tasks_custom import docs_example, on_path, write_rows

__all__ = ["local", "on_path"]  # pytest fixtures, imported to be shared


def receiver(local, task) -> Admission:
    tokenizer, _, local_view = local
    fp = tokenizer_fingerprint(tokenizer)
    return Admission(
        task=task, tokenizer=tokenizer, fingerprint=fp, swarm_id="s", local_view=local_view, max_positions=512
    )


def test_a_py_task_peer_packet_is_rescored_by_the_receiver(local, on_path) -> None:
    (on_path / "my_task.py").write_text(docs_example("my_task.py"))
    sender = get_task("py:my_task:make?limit=20")
    ids = [sender.sample(random.Random(i)) for i in range(2)]
    right = [f"<answer>{sender.problem(i).answer}</answer>" for i in ids]
    data = packet(local[0], task_ids=ids[:1], texts=[right[0], "<answer>-1</answer>"] * 2)
    got = receiver(local, get_task("py:my_task:make?limit=20")).admit(PEER, data, current_round=5)
    assert not got.rejected and len(got.groups) == 1 and got.groups[0].task_id == ids[0]
    assert got.groups[0].rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # the receiver's verdict
    other = receiver(local, get_task("py:my_task:make?limit=9")).admit(PEER, data, current_round=5)
    assert other.rejected.get("foreign_task") == 1 and not other.groups


def test_hf_peers_with_the_same_rows_exchange_with_their_own_reward(local, on_path) -> None:
    (on_path / "my_rewards.py").write_text(docs_example("my_rewards.py"))
    spec = f"hf:{write_rows(on_path / 'p.jsonl')}?prompt=q&answer=a"
    sender = get_task(spec)
    task_id = f"{sender.id_prefix}5"  # answer "10"
    data = packet(local[0], task_ids=[task_id], texts=["it is 10", "it is 11"] * 2)
    got = receiver(local, with_rewards(get_task(spec), "my_rewards:exact")).admit(PEER, data, current_round=5)
    assert not got.rejected and got.groups[0].rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    write_rows(on_path / "fewer.jsonl", n=15)  # other data: another digest in the ids
    fewer = receiver(local, get_task(f"hf:{on_path / 'fewer.jsonl'}?prompt=q&answer=a")).admit(
        PEER, data, current_round=5
    )
    assert fewer.rejected.get("foreign_task") == 1 and "is not of task" in fewer.details["foreign_task"]
