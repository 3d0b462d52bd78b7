"""A prompt's token ids: the chat template applied once, with the assistant-turn header.

Rollouts, replay, the teacher and SFT all build prompts this way, so it lives below them.
"""

from __future__ import annotations

from mrtpo.tasks.base import Example


def chat_ids(tokenizer, messages) -> list[int]:
    """Token ids of chat ``messages`` followed by the assistant-turn header."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def prompt_ids(tokenizer, example: Example) -> list[int]:
    return chat_ids(tokenizer, example.messages)
