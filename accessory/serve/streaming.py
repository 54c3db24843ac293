"""A queued request's events, from its handle to the client: server-sent events as they come when it streams (with
keep-alives while nothing comes), else one JSON answer once every choice has finished. A client that leaves cancels
its request."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from accessory.generation.requests import Event
from accessory.serve.api_errors import error_body, error_response, generation_failed
from accessory.serve.responses import Chat, usage
from accessory.serve.schemas import SamplingFields
from accessory.serve.service import Handle
from accessory.serve.validation import constraint_field

DISCONNECT_POLL_S = 1.0  # how often a request with no new text checks whether its client is still there
SSE_KEEPALIVE_S = 10.0  # a stream with nothing to say for this long sends a comment (proxies cut idle streams)


async def respond(shape: Chat, body: SamplingFields, handle: Handle, request: Request, head: dict):
    keepalive_s = request.app.state.keepalive_s
    head = {**head, "id": shape.prefix + head["id"]}
    wants_logprobs = body.logprobs is not None and body.logprobs is not False  # completions' 0 asks for them
    if body.stream:
        return StreamingResponse(stream(shape, head, handle, request, body, wants_logprobs, keepalive_s),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals: dict[int, Event] = {}
    logprobs: dict[int, list] = {i: [] for i in range(len(handle.ids))}
    try:
        async for event in watched(handle, request, keepalive_s):
            if event is None:
                continue
            if event.prompt_logprobs is not None:
                logprobs[handle.index(event)][:0] = shape.prompt_entries(event, handle.index(event))
            logprobs[handle.index(event)] += event.logprobs
            if event.end_of_content:
                finals[handle.index(event)] = event
    finally:
        handle.cancel()  # a no-op once finished; frees the rows if the client left or the task was cancelled
    if len(finals) < len(handle.ids):
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    failed = [final for final in finals.values() if final.finish_reason == "error"]
    if failed:
        return error_response(generation_failed(failed[0], constraint_field(body)), request.url.path)
    choices = [shape.choice(i, finals[i].text, finals[i].finish_reason,
                            logprobs[i] if wants_logprobs else None) for i in sorted(finals)]
    return {**head, "object": shape.object, "choices": choices, "usage": usage(handle, finals.values())}


async def stream(shape: Chat, head: dict, handle: Handle, request: Request, body: SamplingFields,
                 wants_logprobs: bool, keepalive_s: float):
    def sse(choices: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'object': shape.chunk_object, 'choices': choices, **extra})}\n\n"

    finals: list[Event] = []
    started: set[int] = set()  # choices that have had an event
    try:
        for opening in filter(None, map(shape.opening, range(len(handle.ids)))):
            yield sse([opening])
        async for event in watched(handle, request, keepalive_s):
            if event is None:
                yield ": keep-alive\n\n"  # an SSE comment: clients skip it
                continue
            index = handle.index(event)
            first = index not in started
            started.add(index)
            if event.delta or event.logprobs or (first and shape.echoed(index)):
                entries = [*(shape.prompt_entries(event, index) if first else ()), *event.logprobs]
                yield sse([shape.chunk_choice(index, event.delta, None, entries if wants_logprobs else None,
                                              first)])
            if event.finish_reason == "error":  # as OpenAI streams an error: an error object, then the end
                failed = generation_failed(event, constraint_field(body))
                yield f"data: {json.dumps(error_body(failed, request.url.path))}\n\n"
                yield "data: [DONE]\n\n"
                return
            if event.end_of_content:
                finals.append(event)
                yield sse([shape.chunk_choice(index, "", event.finish_reason, None)])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse([], usage=usage(handle, finals))
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # the client disconnected (or the stream ended: then a no-op)


async def watched(handle: Handle, request: Request, keepalive_s: float):
    """The handle's events, ending early if the client disconnects while no text is coming; None after each
    `keepalive_s` without one (a queued request, a long prefill)."""
    quiet_since = time.monotonic()
    while not handle.finished:
        try:
            event = await asyncio.wait_for(handle.next_event(), min(DISCONNECT_POLL_S, keepalive_s))
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return
            if time.monotonic() - quiet_since >= keepalive_s:
                quiet_since = time.monotonic()
                yield None
            continue
        quiet_since = time.monotonic()
        yield event
