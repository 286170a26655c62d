"""Admission: turn a peer's packet bytes into groups this node may train on, or reasons not to.

Nothing a peer sends is trusted. In order, cheapest first:

1. a quarantined peer's packet is refused unread (node/defence/trust.py);
2. the header alone (`peek_header`, the body is not decoded): the sender it names must be
   the verified sender (`impersonation`), the swarm ours, the round current; a peer with
   our tokenizer must declare our vocabulary size (`vocab_mismatch`);
3. the full decode, under the protocol's limits;
4. every group against THIS node's limits: a task of ours (rebuilt from its id by our own
   code), sampling parameters we can score under (`bad_sampling`: a temperature of 1e-40
   turns every log-prob into NaN), completions of >= 1 token (`empty_completion`) that fit
   our model's positions with the prompt (`too_long`), ids inside our vocabulary
   (`bad_token_id`);
5. the screen (node/defence/screen.py): each completion under our OWN model at the declared
   sampling parameters; implausible ones are dropped, and a claimed log-prob may not raise
   the weight of a token we find implausible;
6. our own verifier re-scores every completion (the sender's reward is never read), and
   what follows the answer's closing tag is cut (`tail_tokens_cut`; `cut_tails`, on with
   the screen): no verifier vouched for it.

A packet from a node with our tokenizer is used at the token level (the F-TIS path). One
with another tokenizer has no token-level ratio: its text is re-tokenized and the whole
sequence gets the GRAFT weight

    s = exp(mean_t log pi_local(text) - mean_t log pi_gen(text)),  admitted if s > 0.8,
                                                                   weighted min(s, 1)

or it is dropped, by configuration. Every rejection is counted by reason and peer, and
nothing raises: bad input from the network is data.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from node.defence.screen import PlausibilityScreen, Screen, ScreenConfig, TokenView, honest_claims
from node.defence.trust import HOSTILE_REASONS, TrustBook
from node.groups import ScoredGroup, ScoredSequence
from node.tasks import Task
from node.tasks.answer import ANSWER_CLOSE
from protocol import Limits, PacketHeader, ProtocolError, RolloutPacket, decode, peek_header
from protocol.keys import STALE_ROUNDS

# (prompt_ids, [completion_ids, ...], temperature, top_k, top_p) -> our view of each completion
LocalView = Callable[[list[int], list[list[int]], float, int, float], list[TokenView]]

GRAFT_MIN_WEIGHT = 0.8
# Sampling temperatures this node scores under. Below ~1e-38 logits / T overflow fp32 (NaN
# weights after one step); far outside this range no honest sampler runs anyway.
TEMPERATURE_RANGE = (0.05, 10.0)


@dataclass
class Admitted:
    """What one packet yielded: groups to train on, and rejections by reason."""

    peer_id: str
    round: int | None = None
    header: PacketHeader | None = None  # as the sender wrote it (unverified but for the sender id)
    groups: list[ScoredGroup] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)
    details: dict[str, str] = field(default_factory=dict)
    offered: int = 0  # completions in the decoded packet
    screen_checked: int = 0  # completions that reached the screen
    tail_tokens_cut: int = 0  # tokens after an answer's closing tag, not trained on (`cut_tail`)

    def reject(self, reason: str, detail: str, count: int = 1) -> None:
        self.rejected[reason] += count
        self.details.setdefault(reason, detail)

    @property
    def samples(self) -> int:
        return sum(len(g.sequences) for g in self.groups)

    @property
    def screened(self) -> Counter[str]:
        """The rejections held against the sender (node/defence/trust.py), by reason."""
        return Counter({k: v for k, v in self.rejected.items() if k in HOSTILE_REASONS})


@dataclass
class _Candidate:
    ids: list[int]
    claimed: np.ndarray  # the sender's logp_gen
    text: str
    finish_reason: str


class Admission:
    """The checks between the swarm and the trainer, for one node."""

    def __init__(
        self,
        *,
        task: Task,
        tokenizer,
        fingerprint: str,
        swarm_id: str,
        local_view: LocalView,
        vocab_size: int | None = None,
        max_positions: int | None = None,
        screens: Sequence[Screen] | None = None,
        claim_margin: float = 0.0,
        claim_floor: float = ScreenConfig().logprob_floor,
        cut_tails: bool = True,
        trust: TrustBook | None = None,
        cross_tokenizer: Literal["graft", "drop"] = "graft",
        limits: Limits | None = None,
        stale_rounds: int = STALE_ROUNDS,
        min_group_size: int = 2,
        chat_template: bool = False,
        temperature_range: tuple[float, float] = TEMPERATURE_RANGE,
    ) -> None:
        """`vocab_size`: ids this node's model takes (default: the tokenizer's size); `screens`:
        None for the default plausibility screen, [] for none; `trust`: where screened counts go
        and whose packets are refused unread."""
        self.task = task
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.swarm_id = swarm_id
        self.local_view = local_view
        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))
        self.max_positions = max_positions
        self.screens: list[Screen] = [PlausibilityScreen()] if screens is None else list(screens)
        self.claim_margin = claim_margin
        self.claim_floor = claim_floor
        self.cut_tails = cut_tails
        self.trust = trust
        self.cross_tokenizer = cross_tokenizer
        self.limits = limits or Limits()
        self.stale_rounds = stale_rounds
        self.min_group_size = min_group_size
        self.chat_template = chat_template
        self.temperature_range = temperature_range
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

    # ------------------------------------------------------------------ the packet
    def admit(self, peer_id: str, data: bytes, current_round: int) -> Admitted:
        """`peer_id` is the VERIFIED sender (the key that signed its record), never a field it wrote."""
        result = Admitted(peer_id=peer_id)
        if self.trust is not None and (why := self.trust.quarantine_reason(peer_id, current_round)):
            result.reject("quarantined", why)
            return result  # not decoded, and not held against it again
        self._admit(result, peer_id, data, current_round)
        if self.trust is not None:
            self.trust.observe(peer_id, current_round, result.offered, result.screened)
        return result

    def _admit(self, result: Admitted, peer_id: str, data: bytes, current_round: int) -> None:
        try:
            header = peek_header(data, self.limits)
        except ProtocolError as err:
            result.reject(err.code, str(err))
            return
        result.round, result.header = header.round, header
        if header.sender_peer_id != peer_id:
            named = header.sender_peer_id
            result.reject("impersonation", f"header names {named!r}, the verified sender is {peer_id!r}")
            return
        if header.swarm_id != self.swarm_id:
            result.reject("wrong_swarm", f"packet for swarm {header.swarm_id!r}, we are {self.swarm_id!r}")
            return
        if not current_round - self.stale_rounds <= header.round <= current_round + 1:
            result.reject("stale", f"round {header.round}, current {current_round} (bound {self.stale_rounds})")
            return
        same_tokenizer = header.tokenizer_fingerprint == self.fingerprint
        if same_tokenizer and header.vocab_size != len(self.tokenizer):
            result.reject(
                "vocab_mismatch",
                f"our tokenizer's fingerprint with vocab_size {header.vocab_size}; ours is {len(self.tokenizer)}",
            )
            return
        if not same_tokenizer and self.cross_tokenizer == "drop":
            result.reject("foreign_tokenizer", f"tokenizer {header.tokenizer_fingerprint[:12]} differs; dropping")
            return
        try:
            packet = decode(data, self.limits)
        except ProtocolError as err:
            result.reject(err.code, str(err))
            return
        result.offered = sum(len(g.completions) for g in packet.groups)
        for group in packet.groups:
            self._admit_group(result, packet, group, same_tokenizer)

    # ------------------------------------------------------------------ one group
    def _admit_group(self, result: Admitted, packet: RolloutPacket, group, same_tokenizer: bool) -> None:
        n = len(group.completions)
        if not self.task.owns(group.task_id):
            result.reject("foreign_task", f"task id {group.task_id!r} is not of task {self.task.name!r}")
            return
        try:
            problem = self.task.problem(group.task_id)
        except ValueError as err:
            result.reject("bad_task_id", str(err))
            return
        if n < self.min_group_size:
            result.reject("group_too_small", f"{n} completions, need {self.min_group_size}")
            return
        s = group.sampling
        lo, hi = self.temperature_range
        if not lo <= s.temperature <= hi:
            result.reject("bad_sampling", f"temperature {s.temperature:g} outside [{lo:g}, {hi:g}]", count=n)
            return
        scored = ScoredGroup(
            source=result.peer_id,
            task_id=group.task_id,
            generator=group.generator_model_id,
            prompt_ids=self.prompt_ids(problem.prompt),
            temperature=float(s.temperature),
            top_k=int(s.top_k),
            top_p=float(s.top_p),
        )
        candidates = [
            c
            for c in (self._candidate(result, scored, comp, same_tokenizer) for comp in group.completions)
            if c is not None
        ]
        if not candidates:
            return
        try:
            views = self.local_view(
                scored.prompt_ids, [c.ids for c in candidates], scored.temperature, scored.top_k, scored.top_p
            )
        except Exception as err:  # our model could not score it: the data's fault, not a reason to stop
            result.reject("unscorable", f"{type(err).__name__}: {err}", count=len(candidates))
            return
        kept: list[tuple[ScoredSequence, TokenView]] = []
        for cand, view in zip(candidates, views, strict=True):
            if not np.all(np.isfinite(view.logp)):
                result.reject("nonfinite_local", "our model gives a non-finite log-prob at these sampling parameters")
                continue
            seq: ScoredSequence | None
            if same_tokenizer:
                seq = ScoredSequence(cand.ids, cand.claimed, 0.0, 1.0, cand.text, cand.finish_reason)
            else:
                seq = self._graft(result, cand, view)
                if seq is None:
                    continue
            kept.append((seq, view))
        kept = self._screen(result, scored, kept, same_tokenizer)
        for seq, _ in kept:
            seq.reward = float(self.task.reward(problem, seq.text))
            if self.cut_tails:
                result.tail_tokens_cut += self._cut_tail(seq)
            scored.sequences.append(seq)
        if len(scored.sequences) >= self.min_group_size:
            result.groups.append(scored)
        elif scored.sequences:
            result.reject("group_too_small", f"only {len(scored.sequences)} completions survived admission")

    def _cut_tail(self, seq: ScoredSequence) -> int:
        """Keep a peer's completion only up to its answer's closing tag (and an end-of-sequence
        right after it); returns the tokens cut.

        The reward judged the answer, never what follows it, so a tail after the tag is text no
        verifier vouched for: learning it from a peer buys nothing and is how a lie slips past
        the screen (one odd token or two after a correct answer, claimed at -40, pulled its
        log-prob up 22 nats in 24 rounds: `ftis-node bench attack`, the evasive tail).
        """
        ids = seq.completion_ids
        if ANSWER_CLOSE not in seq.text:
            return 0
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds the tag (monotone in length)
        while lo < hi:
            mid = (lo + hi) // 2
            if ANSWER_CLOSE in self.tokenizer.decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        if ANSWER_CLOSE not in self.tokenizer.decode(ids[:lo]):
            return 0  # the text had the tag but these ids never spell it (a grafted oddity): keep all
        end = lo + 1 if lo < len(ids) and ids[lo] == self.tokenizer.eos_token_id else lo
        if end == len(ids):
            return 0
        seq.completion_ids, seq.logp_gen = list(ids[:end]), seq.logp_gen[:end]
        return len(ids) - end

    def _candidate(self, result: Admitted, group: ScoredGroup, completion, same_tokenizer: bool) -> _Candidate | None:
        """A completion as ids THIS model can take, or None (rejected with a reason)."""
        if same_tokenizer:
            ids = completion.token_ids.tolist()
            if ids and max(ids) >= self.vocab_size:
                result.reject("bad_token_id", f"token id {max(ids)} outside our vocabulary [0, {self.vocab_size})")
                return None
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        else:
            if not completion.text:
                result.reject("no_text", "foreign tokenizer and the completion carries no text")
                return None
            text = completion.text
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.tokenizer.eos_token_id is not None and completion.finish_reason == "stop":
                ids = ids + [self.tokenizer.eos_token_id]
        if not ids or len(completion.logprobs) == 0:
            result.reject("empty_completion", "a completion of no tokens")
            return None
        length = len(group.prompt_ids) + len(ids)
        if self.max_positions is not None and length > self.max_positions:
            result.reject("too_long", f"prompt + completion is {length} tokens, our model has {self.max_positions}")
            return None
        claimed = np.asarray(completion.logprobs, dtype=np.float32)
        return _Candidate(ids, claimed, text, completion.finish_reason)

    def _graft(self, result: Admitted, cand: _Candidate, view: TokenView) -> ScoredSequence | None:
        """The sequence-level path for a peer with another tokenizer."""
        log_s = float(view.logp.mean()) - float(np.mean(cand.claimed))
        weight = math.exp(min(log_s, 0.0))
        if not log_s > math.log(GRAFT_MIN_WEIGHT):  # written so that a NaN is refused too
            result.reject("graft_weight", f"sequence weight {math.exp(log_s):.3f} <= {GRAFT_MIN_WEIGHT}")
            return None
        # No token-level ratio exists: train it as on-policy text (w = 1) weighted by min(s, 1).
        return ScoredSequence(cand.ids, view.logp.astype(np.float32), 0.0, weight, cand.text, cand.finish_reason)

    def _screen(
        self, result: Admitted, group: ScoredGroup, kept: list[tuple[ScoredSequence, TokenView]], same_tokenizer: bool
    ) -> list[tuple[ScoredSequence, TokenView]]:
        """Drop what a screen rejects; cap what the claims of the survivors' flagged tokens buy."""
        if not self.screens or not kept:
            return kept
        result.screen_checked += len(kept)
        flagged = [np.zeros(len(seq.completion_ids), dtype=bool) for seq, _ in kept]
        alive = [True] * len(kept)
        for screen in self.screens:
            idx = [i for i in range(len(kept)) if alive[i]]
            if not idx:
                break
            probe = _with_sequences(group, [kept[i][0] for i in idx])
            verdicts = screen.screen(probe, [kept[i][1] for i in idx])
            for i, verdict in zip(idx, verdicts, strict=True):
                if verdict.flagged is not None:
                    flagged[i] |= verdict.flagged
                if not verdict.ok:
                    alive[i] = False
                    result.reject(verdict.reason or screen.name, verdict.detail)
        survivors = []
        for i, (seq, view) in enumerate(kept):
            if not alive[i]:
                continue
            if same_tokenizer and flagged[i].any():
                seq.logp_gen = honest_claims(seq.logp_gen, view.logp, flagged[i], self.claim_margin, self.claim_floor)
            survivors.append((seq, view))
        return survivors


def _with_sequences(group: ScoredGroup, sequences: list[ScoredSequence]) -> ScoredGroup:
    return ScoredGroup(
        source=group.source,
        task_id=group.task_id,
        generator=group.generator,
        prompt_ids=group.prompt_ids,
        temperature=group.temperature,
        top_k=group.top_k,
        top_p=group.top_p,
        sequences=sequences,
    )
