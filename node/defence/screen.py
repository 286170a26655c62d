"""Screening: what this node is willing to learn from a peer's completion, judged by its OWN model.

Admission proves who sent a packet, rebuilds the task and re-scores the reward. It cannot
prove the text is harmless: a completion that injects a phrase in front of a correct
answer ("Hail to the Thief", arXiv 2511.09780) earns reward 1 like any other. The screen
looks at each completion through this node's own policy, at the sampling parameters the
sender declared, and drops what this node would essentially never have written:

    a token is FLAGGED  if  log pi_local(token) < logprob_floor
                        or  its rank in our logits >= support_top_k   (0 = off)
    a completion is DROPPED (`implausible`)  if  it has a run of >= max_run flagged tokens
                                             or  more than max_flagged of its tokens are flagged

Single odd tokens pass: an honest peer sampling at temperature 1 draws some tokens our
model finds unlikely, and another model (size, training, tokenizer) disagrees on some
more; the defaults keep >= 95 % of honest samples of the demo's heterogeneous swarm
(measured by `ftis-node bench attack`, docs/security.md). An injected phrase is a run.

Claimed log-probs. F-TIS weights a peer's token by w = min(pi_local / pi_gen, C), and
pi_gen is what the sender CLAIMS. A sender that claims a tiny pi_gen for its injected
tokens buys them the cap C instead of the tiny weight an honest claim would give. The
rule (`honest_claims`): for every flagged token of a completion that was let through,
the claim is raised to at least our own log-prob minus `claim_margin`, AND to at least
`logprob_floor`, so its weight is at most min(exp(claim_margin), exp(local - floor)):
the sender's claim can lower the weight of a token we find implausible, never raise it
above what our own view allows. The floor matters for a single odd token after a correct
answer: capped at weight 1, a lie of -40 on it still pulled its log-prob up by 19 nats in 24
rounds (`ftis-node bench attack`, the evasive tail). A token our model puts at -28 now
weighs exp(-19), whatever is claimed; an honest sender's tokens lose little, since a
sampler rarely draws a token at a probability below the floor. Tokens we find plausible
keep the claimed value: there, a lie buys at most C on text we would write.

The interface is small so other screens plug in (node/defence/judge.py adds an LLM judge):
`Screen.screen(group, views) -> one Verdict per sequence`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # torch stays out of this module's import
    import torch

    from node.groups import ScoredGroup

__all__ = [
    "IMPLAUSIBLE",
    "PlausibilityScreen",
    "Screen",
    "ScreenConfig",
    "TokenView",
    "Verdict",
    "honest_claims",
    "longest_run",
    "score_completions",
]

IMPLAUSIBLE = "implausible"


class ScreenConfig(BaseModel):
    """The plausibility screen's thresholds (the node's `screen_*` settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    logprob_floor: float = Field(-9.0, lt=0, description="A token below this local log-prob is flagged.")
    support_top_k: int = Field(0, ge=0, description="A token ranked >= this in our logits is flagged (0 = off).")
    max_run: int = Field(3, ge=1, description="This many flagged tokens in a row drop a completion.")
    max_flagged: float = Field(0.25, ge=0, le=1, description="A larger share of flagged tokens drops a completion.")
    claim_margin: float = Field(0.0, ge=0, description="A flagged token's weight is capped at exp(margin).")


@dataclass(frozen=True)
class TokenView:
    """This node's view of one completion, at the sampling parameters its sender declared."""

    logp: np.ndarray  # float32 [T]: log pi_local(token), exactly as the trainer will score it
    rank: np.ndarray  # int64 [T]: the token's rank among our logits (0 = our most likely token)


@dataclass(frozen=True)
class Verdict:
    """A screen's judgement of one completion."""

    ok: bool
    reason: str = ""  # why it was dropped, a reason code (`implausible`, `judge`, ...)
    detail: str = ""  # one human-readable line for the dashboard
    flagged: np.ndarray | None = None  # bool [T]: tokens found implausible (also in passed ones)

    @staticmethod
    def passed(flagged: np.ndarray | None = None) -> Verdict:
        return Verdict(True, flagged=flagged)


class Screen(Protocol):
    """A stage that judges each sequence of a peer's group; `views[i]` belongs to `group.sequences[i]`."""

    name: str

    def screen(self, group: ScoredGroup, views: Sequence[TokenView]) -> list[Verdict]: ...


def longest_run(mask: np.ndarray) -> int:
    """Length of the longest run of True in a 1-D bool array."""
    best = run = 0
    for flag in mask.tolist():
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


class PlausibilityScreen:
    """HTTT's logit check: drop completions with runs (or a large share) of tokens outside our support."""

    name = "plausibility"

    def __init__(self, cfg: ScreenConfig | None = None) -> None:
        self.cfg = cfg or ScreenConfig()

    def flags(self, view: TokenView) -> np.ndarray:
        flagged = view.logp < self.cfg.logprob_floor
        if self.cfg.support_top_k > 0:
            flagged |= view.rank >= self.cfg.support_top_k
        return flagged

    def screen(self, group: ScoredGroup, views: Sequence[TokenView]) -> list[Verdict]:
        return [self.judge(view) for view in views]

    def judge(self, view: TokenView) -> Verdict:
        flagged = self.flags(view)
        n = len(flagged)
        run = longest_run(flagged)
        share = float(flagged.mean()) if n else 0.0
        if run >= self.cfg.max_run or share > self.cfg.max_flagged:
            worst = float(view.logp.min()) if n else 0.0
            return Verdict(
                False,
                IMPLAUSIBLE,
                f"{int(flagged.sum())}/{n} tokens below log-prob {self.cfg.logprob_floor:g} under our model "
                f"(longest run {run}, min {worst:.1f})",
                flagged,
            )
        return Verdict.passed(flagged)


def honest_claims(
    logp_gen: np.ndarray, local_logp: np.ndarray, flagged: np.ndarray, margin: float, floor: float = -np.inf
) -> np.ndarray:
    """The sender's claimed log-probs, each flagged token's claim raised to >= max(local - margin, floor).

    F-TIS's weight is exp(local - gen); after this, a flagged token's weight is
    <= min(exp(margin), exp(local - floor)).
    """
    least = np.maximum(local_logp.astype(np.float32) - np.float32(margin), np.float32(floor))
    out = np.where(flagged, np.maximum(logp_gen, least), logp_gen)
    return np.minimum(out, 0.0).astype(np.float32)  # still a log-probability


class _KeepLogits:
    """Wraps a causal LM so the logits of the last forward stay readable (shares its parameters)."""

    def __init__(self, model) -> None:
        self.model = model
        self.logits: torch.Tensor | None = None

    def parameters(self):
        return self.model.parameters()

    def __call__(self, **kwargs):
        out = self.model(**kwargs)
        self.logits = out.logits
        return out


def score_completions(
    model,
    prompt_ids: list[int],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    pad_id: int,
    token_budget: int = 4096,
) -> list[TokenView]:
    """Our log-prob and rank of every token of `completions` (all answering `prompt_ids`).

    The log-probs come from `sequence_logprobs`, the trainer's own function, so the screen
    judges exactly the numbers the loss will use. Runs without gradient, in chunks of about
    `token_budget` padded tokens to bound the logits' memory.
    """
    import torch

    from node.train.logprobs import sequence_logprobs

    views: list[TokenView] = []
    keep = _KeepLogits(model)
    i = 0
    while i < len(completions):
        width = len(prompt_ids) + max(len(c) for c in completions[i:])
        rows = max(1, token_budget // max(width, 1))
        chunk = [list(c) for c in completions[i : i + rows]]
        with torch.no_grad():
            logp, _ = sequence_logprobs(
                keep,
                [prompt_ids] * len(chunk),
                chunk,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                pad_id=pad_id,
            )
            assert keep.logits is not None, "sequence_logprobs ran the model's forward pass"
            logits = keep.logits[:, :-1, :].float()
            t_max = logits.shape[1]
            targets = torch.full((len(chunk), t_max), 0, dtype=torch.long, device=logits.device)
            for row, c in enumerate(chunk):
                targets[row, : len(c)] = torch.as_tensor(c, dtype=torch.long)
            chosen = logits.gather(-1, targets.unsqueeze(-1))
            rank = (logits > chosen).sum(-1)
        for row, c in enumerate(chunk):
            views.append(
                TokenView(
                    logp=logp[row, : len(c)].float().cpu().numpy(),
                    rank=rank[row, : len(c)].cpu().numpy().astype(np.int64),
                )
            )
        keep.logits = None
        i += len(chunk)
    return views
