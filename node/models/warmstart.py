"""Supervised warm-start of the tiny models on toy arithmetic.

A freshly initialised model never writes ``<answer>N</answer>``, so its reward is 0 and
GRPO has no signal. A short teacher-forced run (prompt ``12+7=`` -> completion
``<answer>19</answer><|endoftext|>``, loss on the completion tokens only) teaches some
arithmetic and most of the format: 40 % of the examples stop before ``</answer>``, so
the model closes its answer only part of the time. That leaves the sampled reward well
above 0 and well below 1, with room RL can fill quickly (closing the tag, then
sharpening toward its greedy answers); the arithmetic itself is too hard to learn from
a binary reward in a few hundred steps at this size. The number of steps is fixed per
model, so the result is a pure function of (model config, recipe); bigger models end a
bit better.

``skill`` restricts the warm-start to one half of the toy task ("add" or "sub"), which
gives pairs of nodes with different expertise.

Prompt and completion are tokenized separately and concatenated, exactly as a rollout
sees them (the prompt's ids, then the ids the model generates).
"""

from __future__ import annotations

import math
import random
import time
import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from node.tasks.answer import ANSWER_CLOSE
from node.tasks.base import Problem, Task
from node.tasks.toy import ToyTask, toy_completion

if TYPE_CHECKING:
    import torch

Skill = Literal["add", "sub"]
#: The skills a tiny model can be warm-started on (``tiny-s:add``).
TINY_SKILLS: tuple[str, ...] = typing.get_args(Skill)


class WarmStartRecipe(BaseModel):
    """Hyper-parameters of one warm-start; part of a tiny model's cache key."""

    model_config = ConfigDict(frozen=True)

    # Small batches and many steps: at this scale that learns far more per example
    # (measured: 16 x 3000 beat 64 x 1000 on the same model).
    steps: int = Field(1000, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = 0.0
    seed: int = 0
    # Share of examples that close the tag; the rest end unclosed ("<answer>19"), which
    # earns 0. The format is left partly unlearnt, as in a base model, so RL has something
    # it can learn in ~100 rounds: the arithmetic itself barely moves at this scale
    # (measured: with every example closed, no lr from 1e-8 to 1e-2 beat the lr-0 control).
    closed_fraction: float = Field(0.6, gt=0, le=1)


class WarmStartReport(BaseModel):
    """What a warm-start did, saved next to the model (``ftis_build.json``)."""

    steps: int
    skill: Skill | None
    first_loss: float
    final_loss: float
    seconds: float
    cpu_seconds: float  # process CPU time: comparable across runs on a busy machine


def encode_example(tokenizer: Any, problem: Problem, closed: bool = True) -> tuple[list[int], list[int]]:
    """(input ids, labels) for one problem: labels are -100 on the prompt, so the loss is
    on the completion (answer and end-of-text) only. ``closed=False``: no ``</answer>``."""
    prompt = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
    text = toy_completion(problem.answer)
    text = text if closed else text.removesuffix(ANSWER_CLOSE)
    completion = tokenizer(text, add_special_tokens=False)["input_ids"]
    completion = completion + [tokenizer.eos_token_id]
    return prompt + completion, [-100] * len(prompt) + completion


def _batch(tokenizer: Any, problems: list[Problem], closed: list[bool]) -> dict[str, torch.Tensor]:
    import torch

    pairs = [encode_example(tokenizer, p, t) for p, t in zip(problems, closed)]
    width = max(len(ids) for ids, _ in pairs)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(pairs), width), pad, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(pairs):  # right padding: positions start at 0 for every row
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def warm_start(model: Any, tokenizer: Any, recipe: WarmStartRecipe, skill: Skill | None = None) -> WarmStartReport:
    """Train ``model`` in place on fresh toy problems; deterministic for a given recipe."""
    import torch

    task = ToyTask(skill or "id")
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.98))

    def schedule(step: int) -> float:  # linear warm-up, then cosine decay to 10 %
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    start, cpu_start, losses = time.perf_counter(), time.process_time(), []
    # One thread: the matrices are tiny, so extra threads mostly wait on each other (and
    # on a busy machine slow the run down several-fold); and the same thread count on
    # every host gives the same weights whatever its number of cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(recipe.steps):
            problems = task.sample_problems(rng, recipe.batch_size)
            closed = [rng.random() < recipe.closed_fraction for _ in problems]
            batch = _batch(tokenizer, problems, closed)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_schedule.step()
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    model.eval()
    tail = losses[-10:] or [float("nan")]
    return WarmStartReport(
        steps=recipe.steps,
        skill=skill,
        first_loss=losses[0] if losses else float("nan"),
        final_loss=sum(tail) / len(tail),
        seconds=round(time.perf_counter() - start, 2),
        cpu_seconds=round(time.process_time() - cpu_start, 2),
    )


def sampled_reward(
    model: Any,
    tokenizer: Any,
    task: Task,
    n: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 12,
    batch_size: int = 64,
) -> float:
    """Mean reward of ``n`` seeded problems, one sampled completion each (greedy when
    ``temperature`` is 0). A plain ``generate`` loop: enough to check a warm-start."""
    import torch

    problems = task.sample_problems(random.Random(seed), n)
    torch.manual_seed(seed)
    total = 0.0
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues from the right end of each row
    try:
        for i in range(0, n, batch_size):
            chunk = problems[i : i + batch_size]
            enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            sampling = (
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                if temperature > 0
                else {"do_sample": False}
            )
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            total += sum(task.reward(p, t) for p, t in zip(chunk, texts))
    finally:
        tokenizer.padding_side = old_side
    return total / n
