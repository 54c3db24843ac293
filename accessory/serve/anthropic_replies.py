"""A /v1/messages reply in Anthropic's shape: one message whose content is blocks (thinking, text, tool_use), or,
streamed, its events: message_start; for each block content_block_start, its deltas (thinking_delta, text_delta,
input_json_delta) and content_block_stop; message_delta with the stop reason and the usage; message_stop. A
stream silent for the keep-alive period sends a ping; a request that fails while decoding ends with an error
event."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from accessory.generation.chat import ChatReply, ReplyStream, read_reply
from accessory.generation.requests import Event
from accessory.serve.api_errors import error_body, error_response, generation_failed
from accessory.serve.service import Handle
from accessory.serve.streaming import watched
from accessory.text.reasoning import ReasoningFormat
from accessory.text.tool_calls import ToolReading

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    """How the reply is read: for tool calls, for reasoning (its markers, and whether the prompt opened the
    block), which stop strings are the request's stop_sequences, the field a constraint the grammar engine refuses
    is named by, and whether the thinking is shown (or its blocks left empty: thinking.display "omitted")."""
    calls: Optional[ToolReading]
    reasoning: Optional[tuple[ReasoningFormat, bool]]
    stop_sequences: tuple[str, ...]
    held_by: str
    shows_thinking: bool


async def respond(how: Reading, body, handle: Handle, request: Request):
    head = {"id": "msg_" + handle.id, "type": "message", "role": "assistant", "model": body.model}
    if body.stream:
        return StreamingResponse(events(how, head, handle, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    final: Optional[Event] = None
    try:
        async for event in watched(handle, request, request.app.state.keepalive_s):
            if event is not None and event.end_of_content:
                final = event
    finally:
        handle.cancel()  # a no-op once finished; frees the row if the client left
    if final is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    if final.finish_reason == "error":
        return error_response(generation_failed(final, how.held_by), request.url.path)
    reply = read_reply(final.text, how.reasoning, how.calls)
    return {**head, "content": content_blocks(reply, how.shows_thinking),
            **stop_fields(final, bool(reply.tool_calls), how),
            "usage": {"input_tokens": handle.prompt_tokens, "output_tokens": final.completion_tokens}}


def content_blocks(reply: ChatReply, shows_thinking: bool = True) -> list[dict]:
    """A whole reply's blocks: its thinking, its text, its calls."""
    thinking = reply.reasoning if shows_thinking else ""
    content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if reply.reasoning else []
    content += [{"type": "text", "text": reply.content}] if reply.content else []
    return content + [{"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                       "input": call_input(call.arguments)} for call in reply.tool_calls]


def stop_fields(final: Event, called: bool, how: Reading) -> dict:
    """Why the reply ended: a call ("tool_use"), its length ("max_tokens"), one of the request's stop sequences
    (named), or the end of the model's turn."""
    if final.finish_reason == "length":
        reason = "max_tokens"
    elif called:
        reason = "tool_use"
    elif final.stop_string is not None and final.stop_string in how.stop_sequences:
        return {"stop_reason": "stop_sequence", "stop_sequence": final.stop_string}
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": None}


def tool_use_id(call_id: str) -> str:
    """A call's id in Anthropic's form ("toolu_" and letters and digits)."""
    return "toolu_" + call_id.removeprefix("call_")


def call_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is."""
    try:
        value = json.loads(arguments)
    except ValueError:
        log.warning("a tool call's arguments are not JSON; sent as {}: %.200s", arguments)
        return {}
    return value if isinstance(value, dict) else {"value": value}


def sse(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def events(how: Reading, head: dict, handle: Handle, request: Request):
    reading, blocks = ReplyStream(how.reasoning, how.calls), Blocks(how.shows_thinking)
    yield sse("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                        "usage": {"input_tokens": handle.prompt_tokens, "output_tokens": 0}})
    try:
        async for event in watched(handle, request, request.app.state.keepalive_s):
            if event is None:
                yield sse("ping")
                continue
            if event.finish_reason == "error":
                failed = error_body(generation_failed(event, how.held_by), request.url.path)
                yield sse("error", error=failed["error"])
                return
            thought, text, calls = reading.feed(event.delta, event.end_of_content)
            for out in blocks.write(thought, text, calls):
                yield out
            if event.end_of_content:
                if blocks.open is not None:
                    yield blocks.close()
                yield sse("message_delta", delta=stop_fields(event, reading.call_count > 0, how),
                          usage={"output_tokens": event.completion_tokens})
                yield sse("message_stop")
    finally:
        handle.cancel()  # the client disconnected (or the stream ended: then a no-op)


class Blocks:
    """The content blocks of a streamed reply, opened and closed as its pieces change kind."""

    def __init__(self, shows_thinking: bool = True):
        self.index, self.open = -1, None  # the open block's index and kind ("thinking", "text", or a call's index)
        self.shows_thinking = shows_thinking

    def write(self, thought: str, text: str, calls: list[dict]):
        if thought:
            yield from self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.shows_thinking:
                yield self.delta({"type": "thinking_delta", "thinking": thought})
        if text:
            yield from self.start("text", {"type": "text", "text": ""})
            yield self.delta({"type": "text_delta", "text": text})
        for call in calls:
            if "id" in call:  # a call begins: its id and name
                yield from self.start(call["index"], {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                      "name": call["function"]["name"], "input": {}})
            elif call["function"]["arguments"]:
                yield self.delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})

    def start(self, kind, block: dict):
        if self.open != kind:
            if self.open is not None:
                yield self.close()
            self.index, self.open = self.index + 1, kind
            yield sse("content_block_start", index=self.index, content_block=block)

    def delta(self, delta: dict) -> str:
        return sse("content_block_delta", index=self.index, delta=delta)

    def close(self) -> str:
        self.open = None
        return sse("content_block_stop", index=self.index)
