"""The OpenAI-compatible HTTP API over a GenerationService: /v1/models, /v1/completions, /v1/chat/completions
(streamed as server-sent events or not; log-probs, n samples, structured output), /tokenize and /detokenize,
/metrics and /health; and Anthropic's /v1/messages (anthropic.py). Every field either works or is refused by name.

Errors use OpenAI's body shape, {"error": {"message", "type", "param", "code"}} (Anthropic's under /v1/messages):
400 for bad input, 401 for a missing or wrong API key, 404 for an unknown model, 429 when the queue is full, 503
while loading or shutting down.

Here: the app, its middleware and its error handlers; the routes are in routes.py, each a short call into the
modules beside it (schemas, validation, images, limits, responses, streaming, api_errors).
"""
from __future__ import annotations

import hmac
import re
import secrets
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from accessory.serve import anthropic
from accessory.serve.api_errors import APIError, error_response
from accessory.serve.images import ImageOptions
from accessory.serve.limits import BodyLimit, Utf8Body, body_limit
from accessory.serve.routes import Served, ServiceSlot, router
from accessory.serve.service import GenerationService
from accessory.serve.streaming import SSE_KEEPALIVE_S


def create_app(service: Union[GenerationService, ServiceSlot, None], model_name: str, api_key: Optional[str] = None,
               template: Optional[str] = None, max_request_bytes: Optional[int] = None,
               special_tokens_in_prompt: bool = False, keepalive_s: float = SSE_KEEPALIVE_S,
               images: ImageOptions = ImageOptions(), tool_call_parser: str = "auto",
               reasoning_parser: str = "auto") -> FastAPI:
    """The app for `service` (or the ServiceSlot it will be put in once loaded). `template`: a LLaMA2-Accessory
    conversation template for chat (default: the model's own chat template). A body over `max_request_bytes` (default:
    8 MB, plus one image at `images`' limit for a model that reads them) is refused with 413 before it is read whole;
    one that is not UTF-8 with 400. Special tokens' text in messages is always plain text; in a
    completion's prompt too, unless `special_tokens_in_prompt`. A stream silent for `keepalive_s` seconds sends an
    SSE comment. A vision-language model takes one image per chat request, read as `images` says. A chat reply to
    a request with tools is read for calls in `tool_call_parser`'s format (tool_calls.py: a name, or "auto": the
    one the chat template writes), and its reasoning kept apart by `reasoning_parser`'s markers (reasoning.py: a
    name, "none", or "auto": <think> if the chat template writes it). /health and /metrics need no API key."""
    slot = service if isinstance(service, ServiceSlot) else ServiceSlot(service)
    app = FastAPI(title="accessory", docs_url=None, redoc_url=None, exception_handlers=ERROR_HANDLERS)
    app.state.served = Served(slot, model_name, template, special_tokens_in_prompt, images,  # for the routes
                              tool_call_parser, reasoning_parser)
    app.state.keepalive_s = keepalive_s  # for streaming.respond
    app.state.api_key = api_key  # for authenticate
    # each middleware added wraps those before it: a request passes request_id, authenticate, BodyLimit, Utf8Body
    app.add_middleware(Utf8Body)
    app.add_middleware(BodyLimit, limit=lambda: body_limit(max_request_bytes, slot.service, images))
    app.middleware("http")(authenticate)
    app.middleware("http")(request_id)
    app.include_router(router)
    app.include_router(anthropic.router)
    return app


OPEN_PATHS = ("/health", "/metrics")  # no API key needed: probes and scrapers
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # a client's X-Request-Id: printable ASCII, bounded


async def authenticate(request: Request, call_next):
    api_key = request.app.state.api_key
    if api_key and request.url.path not in OPEN_PATHS:
        bearer = request.headers.get("authorization", "")
        given = request.headers.get("x-api-key", "")  # Anthropic's clients send this
        if not (hmac.compare_digest(bearer.encode(), f"Bearer {api_key}".encode())
                or hmac.compare_digest(given.encode(), api_key.encode())):
            return error_response(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or "
                                           "'x-api-key: <key>'", code="invalid_api_key"), request.url.path)
    return await call_next(request)


async def request_id(request: Request, call_next):
    """The client's X-Request-Id (else one made here) names the request in the log and comes back."""
    given = request.headers.get("x-request-id", "")
    request.state.id = given if REQUEST_ID.fullmatch(given) else secrets.token_hex(8)
    response = await call_next(request)
    response.headers["X-Request-Id"] = request.state.id
    return response


async def on_api_error(request, error: APIError):
    return error_response(error, request.url.path)


async def on_validation_error(request, error: RequestValidationError):
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part != "body")
    message = "not a field this server takes" if first["type"] == "extra_forbidden" else first["msg"]
    return error_response(APIError(400, f"{where or 'body'}: {message}", param=where or None), request.url.path)


async def on_http_error(request, error: HTTPException):
    code = "request_too_large" if error.status_code == 413 else None
    return error_response(APIError(error.status_code, str(error.detail), code=code), request.url.path)


ERROR_HANDLERS = {APIError: on_api_error, RequestValidationError: on_validation_error, HTTPException: on_http_error}
