"""The node's own model as admission and the vLLM engine ask about it: what it thinks of
someone else's tokens. One object instead of bound methods of `Node`, so the screen and
the engine's self-check depend on the trainer's model, not on the daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from node.defence.screen import TokenView
    from node.train.trainer import Trainer


class LocalModel:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def views(self, prompt_ids, completions, temperature, top_k, top_p) -> list[TokenView]:
        """Our log-prob and rank of each token of `completions` (the screen's input): no autograd,
        and the output head a chunk of positions at a time, so no [tokens, vocab] logits stay."""
        from node.defence.screen import TokenView
        from node.train.logprobs import completion_views

        rows = completion_views(
            self.trainer.model,
            prompt_ids,
            completions,
            temperature,
            top_k,
            top_p,
            self.trainer.pad_id,
            token_budget=self.trainer.cfg.micro_batch_tokens,
        )
        return [TokenView(logp=logp, rank=rank) for logp, rank in rows]

    def logprobs(self, prompt_ids, completion_ids, temperature, top_k, top_p) -> np.ndarray:
        """Our sampling log-prob of each of `completion_ids` after `prompt_ids` (float32)."""
        import torch

        from node.train.logprobs import sequence_logprobs

        with torch.no_grad():
            logp, _ = sequence_logprobs(
                self.trainer.model,
                [prompt_ids],
                [completion_ids],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                pad_id=self.trainer.pad_id,
            )
        return logp[0, : len(completion_ids)].float().cpu().numpy()
