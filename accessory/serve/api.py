"""The OpenAI-compatible HTTP API over a GenerationService: /v1/models, /v1/completions, /v1/chat/completions
(streamed as server-sent events or not), and /health.

Errors use OpenAI's body shape, {"error": {"message", "type", "param", "code"}}: 400 for bad input, 401 for a
missing or wrong API key, 404 for an unknown model, 429 when the queue is full, 503 while shutting down.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from accessory.generation.sampling import REPETITION_PENALTY_RANGE
from accessory.generation.scheduler import Event
from accessory.serve.engine import GenerationService, Handle, QueueFull, ServiceClosed

DISCONNECT_POLL_S = 1.0  # how often a request with no new text checks whether its client is still there
RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints take. Strict: a string where a number belongs is an error, not a guess."""
    model_config = ConfigDict(strict=True, extra="ignore")  # OpenAI clients send fields we need not read

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # extensions, as in vLLM
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Union[None, bool, int] = None
    logit_bias: Optional[dict] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    best_of: Optional[int] = None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


def create_app(service: GenerationService, model_name: str, api_key: Optional[str] = None,
               template: Optional[str] = None, max_request_bytes: int = 8_000_000,
               special_tokens_in_prompt: bool = False) -> FastAPI:
    """The app for `service`. `template`: a LLaMA2-Accessory conversation template for chat (default: the
    model's own chat template). A body over `max_request_bytes` is refused with 413 before it is read whole.
    Special tokens' text in messages is always plain text; in a completion's prompt too, unless
    `special_tokens_in_prompt`."""
    app = FastAPI(title="accessory", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_request_bytes)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                               code="invalid_api_key"))
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return error_response(APIError(400, f"{where or 'body'}: {first['msg']}", param=where or None))

    @app.exception_handler(HTTPException)
    async def on_http_error(request, error: HTTPException):
        code = "request_too_large" if error.status_code == 413 else None
        return error_response(APIError(error.status_code, str(error.detail), code=code))

    @app.get("/health")
    async def health():
        healthy, report = service.health()
        return report if healthy else JSONResponse(report, status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_name)]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        check_model(name, model_name)
        return model_card(model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body, model_name)
        if body.echo or (body.best_of or 1) > 1:
            raise APIError(400, "echo and best_of > 1 are not supported", param="echo" if body.echo else "best_of")
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request is supported, got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        check_text(prompt, "prompt")
        handle = await submit(lambda loop: service.submit(prompt, sampling(body, body.max_tokens), stops(body),
                                                          loop, special=special_tokens_in_prompt))
        return await respond(COMPLETION, body, handle, request, model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_common(body, model_name)
        messages = [m.model_dump() for m in body.messages]
        for i, message in enumerate(messages):
            check_text(message["content"], f"messages.{i}.content")
        limit = body.max_completion_tokens or body.max_tokens
        handle = await submit(lambda loop: service.submit_chat(messages, sampling(body, limit), template,
                                                               stops(body), loop))
        return await respond(CHAT, body, handle, request, model_name)

    async def submit(make) -> Handle:
        """`make(loop)` queues the request, in a worker thread (templates and tokenizing take time: the event loop
        keeps answering meanwhile); the service's refusals become API errors."""
        loop = asyncio.get_running_loop()
        try:
            return await run_in_threadpool(make, loop)
        except QueueFull as e:
            raise APIError(429, str(e), code="rate_limit_exceeded", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        except ServiceClosed as e:
            raise APIError(503, str(e), kind="server_error")
        except ValueError as e:
            raise APIError(400, str(e), code="context_length_exceeded" if "max_seq_len" in str(e) else None)

    return app


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def error_body(error: APIError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


def generation_failed(final: Event) -> APIError:
    """A request that ended with finish_reason "error" (the others, and the server, went on)."""
    return APIError(500, f"generation failed after {final.completion_tokens} token(s): {final.error}",
                    kind="server_error")


def model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "accessory"}


def check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")


def check_common(body: SamplingFields, served: str) -> None:
    check_model(body.model, served)
    if body.n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
    unsupported = [name for name in ("presence_penalty", "frequency_penalty") if getattr(body, name)]
    unsupported += [name for name in ("logprobs", "logit_bias") if getattr(body, name)]
    if unsupported:
        raise APIError(400, f"{unsupported[0]} is not supported (use repetition_penalty for repetition)",
                       param=unsupported[0])


def stops(body: SamplingFields) -> list[str]:
    found = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for i, stop in enumerate(found):
        check_text(stop, "stop" if isinstance(body.stop, str) else f"stop.{i}")
    return found


def check_text(text: str, field: str) -> None:
    """Text must be encodable as UTF-8 (JSON lets a lone surrogate such as "\\ud800" through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{field}: not valid Unicode text ({e.reason} at character {e.start})", param=field)

def sampling(body: SamplingFields, max_tokens: Optional[int]) -> dict:
    """The service's sampling dict; without max_tokens the reply may fill the rest of the window."""
    chosen = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "repetition_penalty": body.repetition_penalty, "seed": body.seed}
    return chosen if max_tokens is None else {**chosen, "max_gen_len": max_tokens}


class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413: by their Content-Length before reading, or, for a body
    sent without one, as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        message = f"the request body is over {self.limit} bytes (the server's --max-request-bytes)"
        if not declared.isdigit() or int(declared) > self.limit:
            response = error_response(APIError(413, message, code="request_too_large"))
            return await response(scope, receive, send)
        read = 0

        async def limited_receive():
            nonlocal read
            received = await receive()
            read += len(received.get("body", b""))
            if read > self.limit:  # FastAPI passes an HTTPException from reading the body on to the handlers
                raise HTTPException(413, message)
            return received

        await self.app(scope, limited_receive, send)


# ---- responses ---------------------------------------------------------------------------------------------------

class Shape:
    """How one endpoint words its answers: the whole one, and the streamed chunks."""

    def __init__(self, prefix: str, obj: str, chunk_obj: str, chat: bool):
        self.prefix, self.object, self.chunk_object, self.chat = prefix, obj, chunk_obj, chat

    def choice(self, text: str, finish: Optional[str]) -> dict:
        if self.chat:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, delta: str, finish: Optional[str], first: bool) -> dict:
        if not self.chat:
            return self.choice(delta, finish)
        content = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
        return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}


COMPLETION = Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


async def respond(shape: Shape, body: SamplingFields, handle: Handle, request: Request, model_name: str):
    head = {"id": shape.prefix + handle.id, "created": int(time.time()), "model": model_name}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream(shape, head, handle, request, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    final = None
    try:
        async for event in watched(handle, request):
            final = event
    finally:
        handle.cancel()  # a no-op once finished; frees the row if the client left or the task was cancelled
    if final is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    if final.finish_reason == "error":
        return error_response(generation_failed(final))
    return {**head, "object": shape.object, "choices": [shape.choice(final.text, final.finish_reason)],
            "usage": usage(handle, final)}


async def stream(shape: Shape, head: dict, handle: Handle, request: Request, include_usage: bool):
    def sse(choices: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'object': shape.chunk_object, 'choices': choices, **extra})}\n\n"

    try:
        first = True
        async for event in watched(handle, request):
            if event.delta or first:
                yield sse([shape.chunk_choice(event.delta, None, first)])
                first = False
            if event.finish_reason == "error":  # as OpenAI streams an error: an error object, then the end
                error = generation_failed(event)
                yield f"data: {json.dumps(error_body(error))}\n\n"
            elif event.end_of_content:
                yield sse([shape.chunk_choice("", event.finish_reason, False)])
                if include_usage:
                    yield sse([], usage=usage(handle, event))
            if event.end_of_content:
                yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # the client disconnected (or the stream ended: then a no-op)


async def watched(handle: Handle, request: Request):
    """The handle's events, ending early if the client disconnects while no text is coming."""
    while not handle.finished:
        try:
            event = await asyncio.wait_for(handle.next_event(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return
            continue
        yield event


def usage(handle: Handle, final: Event) -> dict:
    return {"prompt_tokens": handle.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": handle.prompt_tokens + final.completion_tokens}
