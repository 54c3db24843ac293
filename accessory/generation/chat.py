"""OpenAI-style messages -> one prompt string and the stop strings that end the assistant's turn; and a reply read
back: its reasoning, its content and its tool calls."""
from __future__ import annotations

import logging
from typing import Optional

from accessory.text.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from accessory.text.tool_calls import CallStream, ToolReading, parse

log = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_ROLES = ("tool",)  # only a chat template that writes tool turns takes these


def check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        calls = isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls")
        content_ok = isinstance(message, dict) and (isinstance(message.get("content"), str)
                                                    or (calls and message.get("content") is None))
        if not isinstance(message, dict) or message.get("role") not in ROLES or not content_ok:
            raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got {message!r}")
    if messages[-1]["role"] == "system" or messages[-1]["role"] == "developer":
        raise ValueError(f"the last message must be the user's, a tool's, or an assistant's to continue; got "
                         f"{messages[-1]['role']!r}")


class ChatReply(str):
    """A chat reply: the text the model wrote (this string), and read from it its `reasoning` (None without),
    `content` (None when the reply is only calls) and `tool_calls` (text/tool_calls.py ToolCall)."""
    reasoning: Optional[str] = None
    content: Optional[str] = None
    tool_calls: tuple = ()


def read_reply(text: str, reasoning: Optional[tuple[ReasoningFormat, bool]] = None,
               calls: Optional[ToolReading] = None) -> ChatReply:
    """`text` read for its reasoning (`reasoning`: the markers, and whether the prompt opened the block) and, in the
    answer after it, its tool calls (`calls`); None of either: not read for it."""
    reply, answer = ChatReply(text), text
    if reasoning is not None:
        thought, answer = split_reasoning(text, *reasoning, final=True)
        reply.reasoning = thought or None
    reply.content = answer
    if calls is not None:
        content, found = parse(answer, calls.format, calls.tools)
        if found:
            reply.content, reply.tool_calls = content or None, tuple(found if calls.parallel else found[:1])
    return reply


class ReplyStream:
    """A chat reply read in pieces as `read_reply` reads it whole: `feed` each piece (`final` with the last) for
    the reasoning, the content and the tool calls' OpenAI deltas to send now."""

    def __init__(self, reasoning: Optional[tuple[ReasoningFormat, bool]] = None,
                 calls: Optional[ToolReading] = None):
        self.thinking = reasoning and ReasoningStream(*reasoning)
        self.calls, self.reading = calls, calls and CallStream(calls.format, calls.tools)

    @property
    def call_count(self) -> int:
        """Calls begun (of those kept: the first only, where parallel calls are not)."""
        begun = self.reading.call_count if self.reading else 0
        return begun if self.calls is None or self.calls.parallel else min(begun, 1)

    def feed(self, piece: str, final: bool) -> tuple[str, str, list[dict]]:
        thought, calls = "", []
        if self.thinking is not None:  # the reasoning, and the answer after it
            thought, piece = _read(self.thinking, piece, final)
        if self.reading is not None:  # the content that cannot be a call's markup, and the calls' pieces
            piece, calls = _read(self.reading, piece, final)
            calls = calls if self.calls.parallel else [call for call in calls if call["index"] == 0]
        return thought, piece, calls


def _read(stream, piece: str, final: bool) -> tuple:
    """What a stream reader has to send after `piece`; once the reply has finished, everything it held back."""
    news = stream.feed(piece)
    if not final:
        return news
    rest = stream.finish()
    return news[0] + rest[0], news[1] + rest[1]


def with_image_placeholder(messages: list[dict]) -> list[dict]:
    """The messages with the image placeholder opening the first user message, where LLaVA puts the image, unless
    a message already says where it goes."""
    from accessory.text.tokenizer import IMAGE_PLACEHOLDER

    if any(IMAGE_PLACEHOLDER in str(m.get("content") or "") for m in messages):
        return messages
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None:
        raise ValueError("an image goes in a user message, and the messages have none")
    placed = {**messages[first], "content": f"{IMAGE_PLACEHOLDER}\n{messages[first]['content']}"}
    return [*messages[:first], placed, *messages[first + 1:]]


def render_chat(tokenizer, messages: list[dict], template: Optional[str] = None,
                tools: Optional[list] = None, context: Optional[dict] = None) -> tuple[str, list[str]]:
    """(prompt, stop strings). Template None: the model's own chat template, whose end-of-turn token is already a
    stop id; if the model has none, LLaMA2-Accessory's default conversation. A name: that conversation template.

    A "developer" message is a system message (as OpenAI treats it for models without that role). When the last
    message is the assistant's, the prompt ends inside it, so the reply continues that text. `tools` (OpenAI's
    function definitions) are given to the chat template; a template that does not write them is an error, as is a
    "tool" message for a conversation template. `context`: more variables for the chat template
    (`chat_template_kwargs`: {"enable_thinking": False}). The messages' text is encoded as plain text (a ChatPrompt,
    when it holds a special token's text)."""
    check_messages(messages)
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    # an assistant's turn of calls only: its content as the text templates can add to (Qwen3's, "" + content)
    messages = [{**m, "content": ""} if m["content"] is None else m for m in messages]
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages = messages[:-1]  # nothing to continue: a new reply
        if not messages:
            raise ValueError("messages: an empty assistant message alone leaves nothing to reply to")
    continuing = messages[-1]["role"] == "assistant"
    if template is None and tokenizer.has_chat_template:
        def rendered(shown: list[dict], with_tools: bool = True) -> str:
            text = tokenizer.apply_chat_template(list(shown), add_generation_prompt=not continuing, **(context or {}),
                                                 **({"tools": tools} if tools and with_tools else {}))
            return _ending_in(text, shown[-1]["content"]) if continuing else text

        if tools and rendered(messages) == rendered(messages, with_tools=False):
            raise ValueError("tools: this model's chat template does not write tool definitions (pass one that "
                             "does with --chat-template)")
        return tokenizer.literal_messages(rendered, messages), []
    if context:
        raise ValueError("chat_template_kwargs: a LLaMA2-Accessory conversation template takes no variables")
    return _conversation_prompt(tokenizer, messages, template, tools)


def _conversation_prompt(tokenizer, messages: list[dict], template: Optional[str],
                         tools: Optional[list]) -> tuple[str, list[str]]:
    """The prompt in a LLaMA2-Accessory conversation template (which has no tool turns)."""
    from accessory.data.conversation import get_conversation

    name = template or "default"
    if tools or any(m["role"] in TOOL_ROLES or m.get("tool_calls") for m in messages):
        raise ValueError(f"tools: the conversation template {name!r} has no tool turns (a model chat template with "
                         f"tool support is needed)")
    if template is None:
        log.info("the model has no chat template; using LLaMA2-Accessory's default conversation")
    stops = list(get_conversation(name).stop_symbols)  # an unknown name raises, listing the known
    continuing = messages[-1]["role"] == "assistant"

    def conversation(shown: list[dict]) -> str:
        conv = get_conversation(name)  # a fresh copy
        for message in shown:
            if message["role"] == "system":
                conv.system = message["content"]
            else:
                conv.append_message(conv.roles[message["role"] == "assistant"], message["content"])
        if not continuing:
            conv.append_message(conv.roles[1], None)
            return conv.get_prompt()
        return _ending_in(conv.get_prompt(), shown[-1]["content"])

    return tokenizer.literal_messages(conversation, messages), stops


def _ending_in(text: str, content: str) -> str:
    """`text` cut right after the last message's `content` (what the template wrote after it closes the turn)."""
    at = text.rfind(content.strip()) if content.strip() else -1
    if at < 0:
        raise ValueError("the last (assistant) message cannot be continued: the template does not write its text")
    return text[:at + len(content.strip())]
