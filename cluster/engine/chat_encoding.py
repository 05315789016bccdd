"""Prompts as token ids: plain text, or a conversation through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any


def encode_text(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids for `text` with `tokenizer`, as a user turn of its chat template when chat is True."""
    if chat and has_chat_template(tokenizer):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer.encode(text, add_special_tokens=False))


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a conversation ({"role", "content"} turns) in the tokenizer's chat template, with the
    assistant's turn opened for the answer; `tools` (OpenAI tool definitions) rendered as the template does."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
