"""Prompts for instruct models: the task's prompt as a chat, after one worked format example.

Every task asks for the final answer between ``<answer>`` tags, and only a tagged answer
earns reward. Small instruct models ignore that sentence when it stands alone: measured on
SmolLM2-135M-Instruct (1-digit sums, 64 samples at T = 0.7), not one completion was tagged
with the plain chat template, nor with a system prompt demanding the tags; with one worked
example as a prior turn, 31 % were. The example is a fixed exchange, the same on every
node, so a prompt rebuilt from a task id gives the same ids everywhere.
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
    {"role": "assistant", "content": "<answer>5</answer>"},
)


def chat_messages(prompt: str) -> list[dict[str, str]]:
    return [*FORMAT_EXAMPLE, {"role": "user", "content": prompt}]


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The text an instruct model continues: the chat template applied, ready for the reply."""
    return tokenizer.apply_chat_template(chat_messages(prompt), tokenize=False, add_generation_prompt=True)
