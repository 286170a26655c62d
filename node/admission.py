"""Admission: turn a peer's packet bytes into groups this node may train on, or reasons not to.

Nothing a peer sends is trusted: the packet is decoded under limits, every task is
rebuilt from its id by our own code and every completion is re-scored by our own
verifier (the sender's reward is never read). A packet from a node with our tokenizer
is used at the token level (the F-TIS path). One with another tokenizer has no
token-level ratio: its text is re-tokenized and the whole sequence gets the GRAFT weight

    s = exp(mean_t log pi_local(text) - mean_t log pi_gen(text)),  admitted if s > 0.8,
                                                                   weighted min(s, 1)

or it is dropped, by configuration. Every rejection is counted by reason and peer, and
nothing raises: bad input from the network is data.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from node.groups import ScoredGroup, ScoredSequence
from node.tasks import Task
from protocol import Limits, ProtocolError, RolloutPacket, decode

# (prompt_ids, completion_ids, temperature, top_k, top_p) -> local per-token log-probs
LocalLogprobs = Callable[[list[int], list[int], float, int, float], np.ndarray]

GRAFT_MIN_WEIGHT = 0.8


@dataclass
class Admitted:
    """What one packet yielded: groups to train on, and rejections by reason."""

    peer_id: str
    round: int | None = None
    groups: list[ScoredGroup] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)
    details: dict[str, str] = field(default_factory=dict)

    def reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        self.details.setdefault(reason, detail)

    @property
    def samples(self) -> int:
        return sum(len(g.sequences) for g in self.groups)


class Admission:
    """The checks between the swarm and the trainer, for one node."""

    def __init__(
        self,
        *,
        task: Task,
        tokenizer,
        fingerprint: str,
        swarm_id: str,
        local_logprobs: LocalLogprobs,
        cross_tokenizer: Literal["graft", "drop"] = "graft",
        limits: Limits | None = None,
        stale_rounds: int = 2,
        min_group_size: int = 2,
        chat_template: bool = False,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.swarm_id = swarm_id
        self.local_logprobs = local_logprobs
        self.cross_tokenizer = cross_tokenizer
        self.limits = limits or Limits()
        self.stale_rounds = stale_rounds
        self.min_group_size = min_group_size
        self.chat_template = chat_template
        self._prompt_cache: dict[str, list[int]] = {}

    def prompt_ids(self, prompt: str) -> list[int]:
        """Our tokenization of a prompt, the one place prompts become ids: own prompts and the
        prompts rebuilt for peers' samples get the same ids (and the same chat template, if on)."""
        if prompt not in self._prompt_cache:
            if len(self._prompt_cache) > 4096:
                self._prompt_cache.clear()
            text = prompt
            if self.chat_template:
                from node.models.chat import chat_prompt

                text = chat_prompt(self.tokenizer, prompt)
            self._prompt_cache[prompt] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._prompt_cache[prompt]

    def admit(self, peer_id: str, data: bytes, current_round: int) -> Admitted:
        result = Admitted(peer_id=peer_id)
        try:
            packet = decode(data, self.limits)
        except ProtocolError as err:
            result.reject(err.code, str(err))
            return result
        header = packet.header
        result.round = header.round
        if header.sender_peer_id != peer_id:
            result.reject("sender_mismatch", f"header names {header.sender_peer_id!r}, the signed record {peer_id!r}")
            return result
        if header.swarm_id != self.swarm_id:
            result.reject("wrong_swarm", f"packet for swarm {header.swarm_id!r}, we are {self.swarm_id!r}")
            return result
        if not current_round - self.stale_rounds <= header.round <= current_round + 1:
            result.reject("stale", f"round {header.round}, current {current_round} (bound {self.stale_rounds})")
            return result
        same_tokenizer = header.tokenizer_fingerprint == self.fingerprint
        if not same_tokenizer and self.cross_tokenizer == "drop":
            result.reject("foreign_tokenizer", f"tokenizer {header.tokenizer_fingerprint[:12]} differs; dropping")
            return result
        for group in packet.groups:
            self._admit_group(result, packet, group, same_tokenizer)
        return result

    def _admit_group(self, result: Admitted, packet: RolloutPacket, group, same_tokenizer: bool) -> None:
        if not self.task.owns(group.task_id):
            result.reject("foreign_task", f"task id {group.task_id!r} is not of task {self.task.name!r}")
            return
        try:
            problem = self.task.problem(group.task_id)
        except ValueError as err:
            result.reject("bad_task_id", str(err))
            return
        if len(group.completions) < self.min_group_size:
            result.reject("group_too_small", f"{len(group.completions)} completions, need {self.min_group_size}")
            return
        s = group.sampling
        scored = ScoredGroup(
            source=result.peer_id,
            task_id=group.task_id,
            generator=group.generator_model_id,
            prompt_ids=self.prompt_ids(problem.prompt),
            temperature=float(s.temperature),
            top_k=int(s.top_k),
            top_p=float(s.top_p),
        )
        for completion in group.completions:
            if same_tokenizer:
                ids = completion.token_ids.tolist()
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                seq = ScoredSequence(ids, np.asarray(completion.logprobs, dtype=np.float32), 0.0, 1.0, text)
            else:
                seq = self._graft(result, scored, completion)
                if seq is None:
                    continue
            seq.reward = float(self.task.reward(problem, seq.text))
            scored.sequences.append(seq)
        if len(scored.sequences) >= self.min_group_size:
            result.groups.append(scored)
        elif scored.sequences:
            result.reject("group_too_small", f"only {len(scored.sequences)} completions survived admission")

    def _graft(self, result: Admitted, group: ScoredGroup, completion) -> ScoredSequence | None:
        """The sequence-level path for a peer with another tokenizer."""
        if not completion.text:
            result.reject("no_text", "foreign tokenizer and the completion carries no text")
            return None
        ids = self.tokenizer(completion.text, add_special_tokens=False)["input_ids"]
        if self.tokenizer.eos_token_id is not None and completion.finish_reason == "stop":
            ids = ids + [self.tokenizer.eos_token_id]
        if not ids or len(completion.logprobs) == 0:
            result.reject("empty_completion", "nothing to score")
            return None
        local = np.asarray(self.local_logprobs(group.prompt_ids, ids, group.temperature, group.top_k, group.top_p))
        log_s = float(local.mean()) - float(np.mean(completion.logprobs))
        weight = math.exp(min(log_s, 0.0))
        if log_s <= math.log(GRAFT_MIN_WEIGHT):
            result.reject("graft_weight", f"sequence weight {math.exp(log_s):.3f} <= {GRAFT_MIN_WEIGHT}")
            return None
        # No token-level ratio exists: train it as on-policy text (w = 1) weighted by min(s, 1).
        return ScoredSequence(ids, local.astype(np.float32), 0.0, weight, completion.text)
