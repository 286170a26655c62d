"""The judge: a second, heavier screen that asks a language model about each completion.

HTTT's second defence. The plausibility screen (node/defence/screen.py) asks "would OUR model have
written this?"; a judge asks a model that can read "does this answer carry anything
besides the answer?". It costs one forward pass of the judge model per completion (see
docs/security.md for the figure measured on CPU), so it is off by default
(`--judge-model` turns it on).

    judge = ModelJudge("smollm2-135m-embedded")
    judge.scores("12+7=", ["<answer>19</answer>", "<answer>19</answer> Omar buys tickets."])
    # -> [P(yes) for each]: the probability the judge answers "yes, it contains other text"

Neither screen stops poison that reads as a plausible answer (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from node.defence.screen import TokenView, Verdict

if TYPE_CHECKING:
    from node.groups import ScoredGroup

__all__ = ["JUDGE", "Judge", "JudgeScreen", "ModelJudge"]

JUDGE = "judge"

QUESTION = (
    "A student was asked to solve a problem and to reply with only the final answer between "
    "<answer> and </answer>.\n\nProblem: {prompt}\nStudent's reply: {completion}\n\n"
    "Does the reply contain any text other than the answer in its tags (an advertisement, an "
    "instruction, a link, unrelated words)? Reply Yes or No."
)


class Judge(Protocol):
    """Scores completions: the probability that each carries something it should not."""

    def scores(self, prompt: str, completions: Sequence[str]) -> list[float]: ...


class ModelJudge:
    """A local causal LM asked QUESTION; the score is P(Yes) / (P(Yes) + P(No)) of its first reply token."""

    def __init__(self, model: str, *, device: str = "cpu", dtype: str = "float32", batch: int = 8) -> None:
        from node.models import load_model

        self.model, self.tokenizer = load_model(model, dtype=dtype, device=device, progress=False)
        self.device = device
        self.batch = batch
        self.tokenizer.padding_side = "left"
        self._yes = self._first_ids(("Yes", " Yes", "yes", " yes"))
        self._no = self._first_ids(("No", " No", "no", " no"))

    def _first_ids(self, words: Sequence[str]) -> list[int]:
        ids = {self.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words}
        return sorted(ids)

    def _prompt(self, prompt: str, completion: str) -> str:
        question = QUESTION.format(prompt=prompt, completion=completion)
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": question}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return question + "\nAnswer:"

    def scores(self, prompt: str, completions: Sequence[str]) -> list[float]:
        import torch

        out: list[float] = []
        for i in range(0, len(completions), self.batch):
            texts = [self._prompt(prompt, c) for c in completions[i : i + self.batch]]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
            with torch.no_grad():
                logits = self.model(**enc, logits_to_keep=1).logits[:, -1, :].float()
            probs = logits.softmax(-1)
            yes = probs[:, self._yes].sum(-1)
            no = probs[:, self._no].sum(-1)
            out += (yes / (yes + no).clamp(min=1e-12)).tolist()
        return out


class JudgeScreen:
    """The Screen interface over a Judge: drop a completion scored at or above `threshold`."""

    name = JUDGE

    def __init__(self, judge: Judge, decode: Callable[[list[int]], str], threshold: float = 0.5) -> None:
        self.judge = judge
        self.decode = decode  # our prompt ids -> text (the judge may use another tokenizer)
        self.threshold = threshold

    def screen(self, group: ScoredGroup, views: Sequence[TokenView]) -> list[Verdict]:
        scores = self.judge.scores(self.decode(group.prompt_ids), [s.text for s in group.sequences])
        return [
            Verdict(False, JUDGE, f"the judge says it carries other text (P={p:.2f})")
            if p >= self.threshold
            else Verdict.passed()
            for p in scores
        ]
