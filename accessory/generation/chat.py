"""OpenAI-style messages -> one prompt string and the stop strings that end the assistant's turn."""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant")


def check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                message.get("content"), str):
            raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got {message!r}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"the last message must be the user's, got {messages[-1]['role']!r}")


def render_chat(tokenizer, messages: list[dict], template: Optional[str] = None) -> tuple[str, list[str]]:
    """(prompt, stop strings). Template None: the model's own chat template, whose end-of-turn token is already a
    stop id; if the model has none, LLaMA2-Accessory's default conversation. A name: that conversation template.
    The messages' text is encoded as plain text (a ChatPrompt, when it holds a special token's text)."""
    check_messages(messages)
    if template is None and tokenizer.has_chat_template:
        return tokenizer.literal_messages(
            lambda shown: tokenizer.apply_chat_template(list(shown), add_generation_prompt=True), messages), []
    from accessory.data.conversation import get_conversation

    if template is None:
        log.info("the model has no chat template; using LLaMA2-Accessory's default conversation")
    stops = list(get_conversation(template or "default").stop_symbols)  # an unknown name raises, listing the known

    def conversation(shown: list[dict]) -> str:
        conv = get_conversation(template or "default")  # a fresh copy
        for message in shown:
            if message["role"] == "system":
                conv.system = message["content"]
            else:
                conv.append_message(conv.roles[message["role"] == "assistant"], message["content"])
        conv.append_message(conv.roles[1], None)
        return conv.get_prompt()

    return tokenizer.literal_messages(conversation, messages), stops
