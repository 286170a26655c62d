"""Prompts for instruct models: the task's prompt as a chat, after one worked format example.

Every task asks for the final answer between ``<answer>`` tags, and only a tagged answer
earns reward. Small instruct models ignore that sentence when it stands alone, so the chat
holds one worked example as a prior turn. Its reply works the sum out, then tags it: a bare
``<answer>5</answer>`` reply gets the tags copied but the sums guessed. Measured on
SmolLM2-135M-Instruct (1-digit sums, 16 prompts x 8 samples, T = 0.7, 64 tokens):

    reply in the example                               tagged  reward  groups with signal
    <answer>5</answer>                                   84 %   0.016    12 %
    2 + 3 = 5 <answer>5</answer>                         98 %   0.172    56 %
    2 + 3 = 5, so the answer is <answer>5</answer>.      83 %   0.219    69 %   (this one)

The example is a fixed exchange, the same on every node, so a prompt rebuilt from a task
id gives the same ids everywhere.
"""

from __future__ import annotations

from typing import Any

from node.tasks.answer import format_instruction

__all__ = ["FORMAT_EXAMPLE", "chat_messages", "chat_prompt"]

FORMAT_EXAMPLE: tuple[dict[str, str], ...] = (
    {
        "role": "user",
        "content": f"State the final answer to the following arithmetic problem: 2 + 3 =\n{format_instruction()}",
    },
    {"role": "assistant", "content": "2 + 3 = 5, so the answer is <answer>5</answer>."},
)


def chat_messages(prompt: str) -> list[dict[str, str]]:
    return [*FORMAT_EXAMPLE, {"role": "user", "content": prompt}]


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The text an instruct model continues: the chat template applied, ready for the reply."""
    return tokenizer.apply_chat_template(chat_messages(prompt), tokenize=False, add_generation_prompt=True)
