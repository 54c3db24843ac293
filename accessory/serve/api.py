"""The OpenAI-compatible HTTP API over a GenerationService: /v1/models, /v1/completions, /v1/chat/completions
(streamed as server-sent events or not; log-probs, n samples, structured output), /tokenize and /detokenize,
/metrics and /health. Every field either works or is refused by name.

Errors use OpenAI's body shape, {"error": {"message", "type", "param", "code"}}: 400 for bad input, 401 for a
missing or wrong API key, 404 for an unknown model, 429 when the queue is full, 503 while loading or shutting down.

Here: the app, its middleware and its routes, each a short call into the modules beside it (schemas, validation,
images, limits, responses, streaming, api_errors).
"""
from __future__ import annotations

import asyncio
import hmac
import re
import secrets
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from accessory.generation.chat import render_chat
from accessory.generation.constraints import ConstraintError
from accessory.serve.api_errors import APIError, error_response
from accessory.serve.images import ImageOptions, image_pixels
from accessory.serve.limits import BodyLimit, Utf8Body, body_limit
from accessory.serve.responses import Chat, Completion, head, model_card
from accessory.serve.schemas import ChatRequest, CompletionRequest, DetokenizeRequest, SamplingFields, TokenizeRequest
from accessory.serve.service import FieldError, GenerationService, Handle, QueueFull, ServiceClosed
from accessory.serve.streaming import SSE_KEEPALIVE_S, respond
from accessory.serve.validation import (chat_messages, chat_tools, check_common, check_model, check_text,
                                        check_token_ids, constraint_field, prompt_list, sampling_of, stops)

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class ServiceSlot:
    """Where the app finds its service: empty while the model loads (every endpoint but /health then says 503)."""

    def __init__(self, service: Optional[GenerationService] = None):
        self.service = service
        self.phase = "loading weights"  # what /health says while there is no service yet

    def get(self) -> GenerationService:
        if self.service is None:
            raise APIError(503, "the model is still loading; try again shortly", kind="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        return self.service


def create_app(service: Union[GenerationService, ServiceSlot, None], model_name: str, api_key: Optional[str] = None,
               template: Optional[str] = None, max_request_bytes: Optional[int] = None,
               special_tokens_in_prompt: bool = False, keepalive_s: float = SSE_KEEPALIVE_S,
               images: ImageOptions = ImageOptions()) -> FastAPI:
    """The app for `service` (or the ServiceSlot it will be put in once loaded). `template`: a LLaMA2-Accessory
    conversation template for chat (default: the model's own chat template). A body over `max_request_bytes` (default:
    8 MB, plus one image at `images`' limit for a model that reads them) is refused with 413 before it is read whole;
    one that is not UTF-8 with 400. Special tokens' text in messages is always plain text; in a
    completion's prompt too, unless `special_tokens_in_prompt`. A stream silent for `keepalive_s` seconds sends an
    SSE comment. A vision-language model takes one image per chat request, read as `images` says. /health and
    /metrics need no API key."""
    app = FastAPI(title="accessory", docs_url=None, redoc_url=None)
    slot = service if isinstance(service, ServiceSlot) else ServiceSlot(service)
    app.add_middleware(Utf8Body)
    app.add_middleware(BodyLimit, limit=lambda: body_limit(max_request_bytes, slot.service, images))  # outside: first
    app.state.keepalive_s = keepalive_s

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                               code="invalid_api_key"))
        return await call_next(request)

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        """The client's X-Request-Id (else one made here) names the request in the log and comes back."""
        given = request.headers.get("x-request-id", "")
        request.state.id = given if REQUEST_ID.fullmatch(given) else secrets.token_hex(8)
        response = await call_next(request)
        response.headers["X-Request-Id"] = request.state.id
        return response

    @app.exception_handler(APIError)
    async def on_api_error(request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        message = "not a field this server takes" if first["type"] == "extra_forbidden" else first["msg"]
        return error_response(APIError(400, f"{where or 'body'}: {message}", param=where or None))

    @app.exception_handler(HTTPException)
    async def on_http_error(request, error: HTTPException):
        code = "request_too_large" if error.status_code == 413 else None
        return error_response(APIError(error.status_code, str(error.detail), code=code))

    @app.get("/health")
    async def health():
        if slot.service is None:
            return JSONResponse({"status": "loading", "phase": slot.phase}, status_code=503)
        healthy, report = slot.service.health()
        return report if healthy else JSONResponse(report, status_code=503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        found = slot.get().metrics
        if found is None:
            raise APIError(404, "this server keeps no metrics", kind="not_found_error")
        return Response(generate_latest(found.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        service = slot.get()
        return {"object": "list", "data": [model_card(name, service, model_name)
                                           for name in (model_name, *service.model.adapter_names)]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        service = slot.get()
        check_model(name, model_name, service.model.adapter_names)
        return model_card(name, service, model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service = slot.get()
        options = check_common(body, model_name, service.rows, service.model.adapter_names)
        if body.suffix:
            raise APIError(400, "suffix: inserting text (fill-in-the-middle) is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, f"best_of: only best_of equal to n ({body.n}) is supported, got {body.best_of}",
                           param="best_of")
        prompts = prompt_list(body.prompt)
        sampling = sampling_of(body, body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's too: its tokens are scored as it joins
            sampling["prompt_logprobs"] = body.logprobs

        def make(loop):
            token_lists = [service.encode(p, special_tokens_in_prompt) if isinstance(p, str) else p for p in prompts]
            for i, tokens in enumerate(token_lists):
                check_token_ids(tokens, service.vocab_size, "prompt" if len(prompts) == 1 else f"prompt.{i}")
            return service.submit_prompts(token_lists, sampling, stops(body), loop, **options,
                                          **labels(request, body))

        handle = await submit(make, body)
        tokenizer = service.model.tokenizer
        echoes = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else []
        return await respond(Completion(tokenizer, echoes, body.n), body, handle, request,
                             head(body.model, service, handle, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        service = slot.get()
        options = check_common(body, model_name, service.rows, service.model.adapter_names)
        messages, image = chat_messages(body.messages, service.model.llma.image_tokens > 0)
        tools = chat_tools(body)
        limit = body.max_completion_tokens or body.max_tokens
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        sampling = sampling_of(body, limit, (top or 0) if body.logprobs else None)

        def make(loop):  # in a worker thread: decoding an image takes time too
            pixels = image and image_pixels(service.model, image, images)
            return service.submit_chat(messages, sampling, template, stops(body), loop, tools=tools, image=pixels,
                                       **options, **labels(request, body))

        handle = await submit(make, body)
        return await respond(Chat(service.model.tokenizer), body, handle, request,
                             head(body.model, service, handle, request))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        service = slot.get()
        tokenizer = service.model.tokenizer
        if body.model is not None:
            check_model(body.model, model_name, service.model.adapter_names)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.prompt is not None:
            check_text(body.prompt, "prompt")
            tokens = await submit_free(lambda: service.tokenize(body.prompt, body.add_special_tokens,
                                                                special_tokens_in_prompt), prompt_field="prompt")
        else:
            messages, image = chat_messages(body.messages, service.model.llma.image_tokens > 0)

            def count():  # the image is read as a chat request reads it: a bad one is refused here too
                pixels = image and image_pixels(service.model, image, images)
                return service.encode(render_chat(tokenizer, messages, template)[0], True, pixels is not None)

            tokens = await submit_free(count, prompt_field="messages")
        # a JSONResponse, not a dict: FastAPI's encoder would walk the tokens in Python on the event loop (a second
        # for a million)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": service.columns})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        service = slot.get()
        if body.model is not None:
            check_model(body.model, model_name, service.model.adapter_names)
        check_token_ids(body.tokens, service.vocab_size, "tokens")
        return {"prompt": service.model.tokenizer.decode(body.tokens)}

    async def submit(make, body: SamplingFields) -> Handle:
        """`make(loop)` queues the request, in a worker thread (templates and tokenizing take time: the event loop
        keeps answering meanwhile); the service's refusals become API errors."""
        loop = asyncio.get_running_loop()
        prompt_field = "prompt" if isinstance(body, CompletionRequest) else "messages"
        return await submit_free(lambda: make(loop), constraint_field(body), prompt_field)

    return app


OPEN_PATHS = ("/health", "/metrics")  # no API key needed: probes and scrapers
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # a client's X-Request-Id: printable ASCII, bounded


def labels(request: Request, body: SamplingFields) -> dict:
    """How the request is named in its log line."""
    return {"label": request.state.id, "user": body.user}


async def submit_free(work, constraint_field: Optional[str] = None, prompt_field: Optional[str] = None):
    """`work()` in a worker thread, its refusals as API errors: a constraint's naming `constraint_field`, a prompt
    too long for the window `prompt_field`, a FieldError its field."""
    try:
        return await run_in_threadpool(work)
    except ConstraintError as e:
        raise APIError(400, f"{constraint_field}: {e}", param=constraint_field)
    except FieldError as e:
        raise APIError(400, str(e), param=e.field)
    except QueueFull as e:
        raise APIError(429, str(e), code="rate_limit_exceeded", kind="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    except ServiceClosed as e:
        raise APIError(503, str(e), kind="server_error")
    except ValueError as e:  # TokenizerError is one
        too_long = "max_seq_len" in str(e)
        raise APIError(400, str(e), param=prompt_field if too_long else None,
                       code="context_length_exceeded" if too_long else None)
