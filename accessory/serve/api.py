"""The OpenAI-compatible HTTP API over a GenerationService: /v1/models, /v1/completions, /v1/chat/completions
(streamed as server-sent events or not; log-probs, n samples, structured output), /tokenize and /detokenize,
/metrics and /health. Every field either works or is refused by name.

Errors use OpenAI's body shape, {"error": {"message", "type", "param", "code"}}: 400 for bad input, 401 for a
missing or wrong API key, 404 for an unknown model, 429 when the queue is full, 503 while loading or shutting down.
"""
from __future__ import annotations

import asyncio
import codecs
import functools
import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Callable, Literal, Optional, Sequence, Union

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from accessory.data.images import ImageError, ImageLimits, image_from_url
from accessory.generation.chat import render_chat
from accessory.generation.constraints import Constraint, ConstraintError
from accessory.generation.sampling import LOGIT_BIAS_RANGE, MAX_LOGPROBS, PENALTY_RANGE, REPETITION_PENALTY_RANGE
from accessory.generation.requests import Event
from accessory.text.tokenizer import IMAGE_PLACEHOLDER
from accessory.serve.service import FieldError, GenerationService, Handle, QueueFull, ServiceClosed

DISCONNECT_POLL_S = 1.0  # how often a request with no new text checks whether its client is still there
SSE_KEEPALIVE_S = 10.0  # a stream with nothing to say for this long sends a comment (proxies cut idle streams)
RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers


class Strict(BaseModel):
    """A field of the wrong type is an error, not a guess; so is a field this server does not know."""
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class JSONSchemaFormat(Strict):
    name: str = "response"
    description: Optional[str] = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class SamplingFields(Strict):
    """What both endpoints take: OpenAI's fields, and vLLM's extensions top_k, min_p, repetition_penalty and
    guided_json / guided_regex / guided_choice (structured output without response_format)."""
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]]] = None
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # the caller's end user, written in the request's log line
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[dict] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str  # data:image/...;base64,... (or a local file, where the server allows them)
    detail: Optional[Literal["auto", "low", "high"]] = None  # taken, not used: LLaVA sees every image at one size


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class OtherPart(BaseModel):  # audio, files, and malformed text or image parts: named in the refusal
    model_config = ConfigDict(extra="allow")
    type: str


PART_MODELS = {"text": TextPart, "image_url": ImagePart}


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[None, str, list[Union[TextPart, ImagePart, OtherPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None


class Tool(Strict):
    type: Literal["function"]
    function: dict


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[None, str, dict] = None
    parallel_tool_calls: Optional[bool] = None


class TokenizeRequest(Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: Optional[str] = None
    tokens: list[int]


@dataclass(frozen=True)
class ImageOptions:
    """How chat messages' image parts are read: the limits on each image, whether `image_url` may name a file on
    this machine (the server's --allow-local-images), and the transform to the model's pixels."""
    limits: ImageLimits = ImageLimits()
    allow_local_files: bool = False
    transform: str = "padded_resize"


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
    app.add_middleware(BodyLimit, limit=lambda: body_limit(max_request_bytes, slot, images))  # outside: first
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
        return {"object": "list", "data": [model_card(model_name, slot.get())]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        check_model(name, model_name)
        return model_card(model_name, slot.get())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service = slot.get()
        options = check_common(body, model_name, service.rows)
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
                             head(model_name, service, handle, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        service = slot.get()
        options = check_common(body, model_name, service.rows)
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
                             head(model_name, service, handle, request))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        service = slot.get()
        tokenizer = service.model.tokenizer
        if body.model is not None:
            check_model(body.model, model_name)
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
            check_model(body.model, model_name)
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


def head(model_name: str, service: GenerationService, handle: Handle, request: Request) -> dict:
    """The fields every answer and chunk of a request starts with."""
    return {"id": handle.id, "created": int(time.time()), "model": model_name,
            "system_fingerprint": system_fingerprint(service, model_name)}


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


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def error_body(error: APIError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


def generation_failed(final: Event, constraint_field: Optional[str]) -> APIError:
    """A request that ended with finish_reason "error" (the others, and the server, went on): a 400 naming the
    field when the grammar engine refused its constraint while decoding, else a 500."""
    if final.error.startswith(REFUSED_CONSTRAINT):  # its message says after how many tokens
        return APIError(400, f"{constraint_field}: {final.error[len(REFUSED_CONSTRAINT):]}", param=constraint_field)
    return APIError(500, f"generation failed after {final.completion_tokens} token(s): {final.error}",
                    kind="server_error")


REFUSED_CONSTRAINT = f"{ConstraintError.__name__}: "  # how the scheduler words a row's ConstraintError


def model_card(name: str, service: GenerationService) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "accessory", "max_model_len": service.columns}


@functools.lru_cache(maxsize=8)
def system_fingerprint(service: GenerationService, model_name: str) -> str:
    """Names what produced an answer (this version, the model's configuration and its parallel layout), so a
    client can tell when outputs for the same seed may differ."""
    from accessory import __version__

    settings = (model_name, __version__, torch.__version__, repr(service.engine.model.args), service.ctx.world_size,
                str(service.engine.model.dtype), service.engine.settings)
    return "fp_" + hashlib.sha256(repr(settings).encode()).hexdigest()[:12]


def check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")


def check_common(body: SamplingFields, served: str, rows: int) -> dict:
    """Check what both endpoints share; the service's options for `n` and the constraint."""
    check_model(body.model, served)
    if body.n > rows:
        raise APIError(400, f"n: at most {rows} samples per request (the server's --max-batch-size), got {body.n}",
                       param="n")
    return {"n": body.n, "constraint": constraint_of(body)}


def constraint_fields(body: SamplingFields) -> list[str]:
    """The fields that ask for structured output."""
    given = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(body, name) is not None]
    fmt = body.response_format
    return given + ["response_format"] if fmt is not None and fmt.type != "text" else given


def constraint_field(body: SamplingFields) -> Optional[str]:
    return next(iter(constraint_fields(body)), None)


def constraint_of(body: SamplingFields) -> Optional[Constraint]:
    """The structured-output constraint the request asks for, at most one."""
    given = constraint_fields(body)
    fmt = body.response_format
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)}: ask for one kind of structured output at most",
                       param=given[1])
    try:
        if fmt is not None and fmt.type == "json_object":
            return Constraint("json_object")
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format.json_schema: required when type is json_schema",
                               param="response_format.json_schema")
            return Constraint.json_schema(fmt.json_schema.schema_)
        if body.guided_json is not None:
            return Constraint.json_schema(body.guided_json)
        if body.guided_regex is not None:
            return Constraint("regex", body.guided_regex)
        if body.guided_choice is not None:
            return Constraint.choice(body.guided_choice)
    except ValueError as e:
        raise APIError(400, f"{given[0]}: {e}", param=given[0])
    return None


def prompt_list(prompt) -> list[Union[str, list[int]]]:
    """The request's prompts, each text or token ids (OpenAI's `prompt` is one, or a list of either)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: an empty list", param="prompt")
    for i, text in enumerate(prompt):
        if isinstance(text, str):
            check_text(text, "prompt" if len(prompt) == 1 else f"prompt.{i}")
    return list(prompt)


def check_token_ids(tokens: list[int], vocab_size: int, field: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"{field}: {bad[0]} is not a token id of this model (0 to {vocab_size - 1})",
                       param=field)


@dataclass(frozen=True)
class ImageRef:
    """A request's image part: its URL, and where the part is (messages.i.content.j), named in errors."""
    url: str
    part: str

    @property
    def field(self) -> str:
        return f"{self.part}.image_url.url"


def chat_messages(messages: list[Message], reads_images: bool) -> tuple[list[dict], Optional[ImageRef]]:
    """The messages as the chat template reads them, and their image if a part holds one (one per request:
    LLaVA-1.5 takes one image)."""
    found: list[ImageRef] = []
    plain = [plain_message(m, f"messages.{i}", reads_images, found) for i, m in enumerate(messages)]
    if len(found) > 1:
        raise APIError(400, f"{found[1].part}: a second image ({found[0].part} is the first); this model takes one "
                            f"image per request", param=found[1].part)
    return plain, found[0] if found else None


def plain_message(message: Message, where: str, reads_images: bool, images: list) -> dict:
    """An OpenAI message as the chat template reads it: its parts joined into one string, each image part as the
    "<image>" placeholder at its place (its URL added to `images`)."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part_text(part, f"{where}.content.{i}", message.role, reads_images, images)
                            for i, part in enumerate(content))
    elif reads_images and content is not None:
        check_no_placeholder(content, f"{where}.content")
    if content is None and not message.tool_calls:
        raise APIError(400, f"{where}.content: required (it may be null only beside tool_calls)",
                       param=f"{where}.content")
    if content is not None:
        check_text(content, f"{where}.content")
    plain = {"role": message.role, "content": content}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(message, key) is not None:
            plain[key] = getattr(message, key)
    return plain


def part_text(part, where: str, role: str, reads_images: bool, images: list) -> str:
    """A content part's text; an image part's is the placeholder. Other kinds are refused by name."""
    if isinstance(part, OtherPart) and part.type in PART_MODELS:  # a text or image part with a wrong field
        check_part(part, PART_MODELS[part.type], where)
    if isinstance(part, TextPart):
        if reads_images:
            check_no_placeholder(part.text, f"{where}.text")
        return part.text
    if not isinstance(part, ImagePart):
        taken = "text and image_url parts" if reads_images else "text parts"
        raise APIError(400, f"{where}: {part.type!r} parts are not supported: this model takes {taken}",
                       param=where)
    if not reads_images:
        raise APIError(400, f"{where}: 'image_url' parts are not supported: this model reads text only",
                       param=where)
    if role != "user":
        raise APIError(400, f"{where}: an image in a {role!r} message; images go in user messages", param=where)
    images.append(ImageRef(part.image_url.url, where))
    return IMAGE_PLACEHOLDER


def check_no_placeholder(text: str, field: str) -> None:
    """The image placeholder in a message's text would be a second image, or one without pixels."""
    if IMAGE_PLACEHOLDER in text:
        raise APIError(400, f"{field}: holds the image placeholder {IMAGE_PLACEHOLDER!r} as text; send the image as "
                            f"an image_url part (its place among the parts says where it goes)", param=field)


def check_part(part: OtherPart, model: type[BaseModel], where: str) -> None:
    """Raise the 400 that names what is wrong in a part of a known kind (the union took it as an other part)."""
    try:
        model.model_validate(part.model_dump())
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join([where, *map(str, first["loc"])])
        message = "not a field this server takes" if first["type"] == "extra_forbidden" else first["msg"]
        raise APIError(400, f"{field}: {message}", param=field) from None


def image_pixels(model, image: ImageRef, options: ImageOptions) -> torch.Tensor:
    """The image's pixels for `model` (decoding is CPU work: call this in a worker thread); a bad image is a 400
    naming its field."""
    try:
        decoded = image_from_url(image.url, image.field, options.limits, options.allow_local_files)
        return model.image_transform(options.transform)(decoded)
    except ImageError as e:
        message = str(e) if str(e).startswith(image.field) else f"{image.field}: {e}"  # the transform's: unnamed
        raise APIError(400, message, param=image.field) from None


def chat_tools(body: ChatRequest) -> Optional[list[dict]]:
    """The tools to give the chat template: none when tool_choice is "none"; only "auto" lets the model choose."""
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if choice not in ("auto", "none"):
        raise APIError(400, f"tool_choice: only 'auto' and 'none' are supported, got {choice!r}",
                       param="tool_choice")
    if not body.tools or choice == "none":
        return None
    return [tool.model_dump() for tool in body.tools]


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


def sampling_of(body: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int]) -> dict:
    """The service's sampling dict; without max_tokens the reply may fill the rest of the window."""
    chosen = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
              "repetition_penalty": body.repetition_penalty, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty, "logit_bias": body.logit_bias or {},
              "logprobs": logprobs, "seed": body.seed}
    return chosen if max_tokens is None else {**chosen, "max_gen_len": max_tokens}


TEXT_REQUEST_BYTES = 8_000_000  # the body limit's room for text (beside one image, for a model that reads them)


def body_limit(given: Optional[int], slot: ServiceSlot, images: ImageOptions) -> tuple[int, str]:
    """The body limit that applies now, and its name for a 413: `given` (--max-request-bytes); else 8 MB, plus one
    image at the image limit as base64 (4 characters per 3 bytes) for a model that reads images (while the model
    loads, when it is not known yet, the text model's)."""
    if given is not None:
        return given, "the server's --max-request-bytes"
    service = slot.service
    if service is None or not service.model.llma.image_tokens:
        return TEXT_REQUEST_BYTES, "the server's --max-request-bytes, by default 8MB for a model that reads text"
    return (TEXT_REQUEST_BYTES + 4 * -(-images.limits.max_bytes // 3),
            "the server's --max-request-bytes, by default 8MB for text plus one --max-image-bytes image as base64 "
            "for a model that reads images")


class BodyLimit:
    """Refuse request bodies over `limit()[0]` bytes with 413 naming the limit (`limit()[1]`): by their
    Content-Length before reading, or, for a body sent without one, as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: Callable[[], tuple[int, str]]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, name = self.limit()
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        message = f"the request body is over {limit} bytes ({name})"
        if not declared.isdigit() or int(declared) > limit:
            response = error_response(APIError(413, message, code="request_too_large"))
            return await response(scope, receive, send)
        read = 0

        async def limited_receive():
            nonlocal read
            received = await receive()
            read += len(received.get("body", b""))
            if read > limit:  # FastAPI passes an HTTPException from reading the body on to the handlers
                raise HTTPException(413, message)
            return received

        await self.app(scope, limited_receive, send)


class Utf8Body:
    """Refuse a request body that is not UTF-8 with 400, as it is read. Python's json would read UTF-16 and UTF-32
    too (it guesses the encoding from the NUL bytes): JSON in UTF-8 holds no NUL byte."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        decoder, read = codecs.getincrementaldecoder("utf-8")(), 0

        async def checked_receive():
            nonlocal read
            received = await receive()
            chunk = received.get("body", b"")
            if b"\0" in chunk:
                raise HTTPException(400, f"the request body is not UTF-8: a NUL byte at byte {read + chunk.index(0)} "
                                         f"(UTF-16 or UTF-32?); send JSON as UTF-8")
            try:
                decoder.decode(chunk, final=not received.get("more_body", False))
            except UnicodeDecodeError as e:
                raise HTTPException(400, f"the request body is not UTF-8: {e.reason} at byte {read + e.start}")
            read += len(chunk)
            return received

        await self.app(scope, checked_receive, send)


# ---- responses ---------------------------------------------------------------------------------------------------

class Chat:
    """How /v1/chat/completions words its answers: whole choices, streamed chunks, and log-probs."""
    prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def echoed(self, index: int) -> str:
        return ""  # chat never repeats the prompt

    def prompt_entries(self, event: Event, index: int) -> list:
        return []

    def choice(self, index: int, text: str, finish: Optional[str], logprobs: Optional[list]) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(logprobs), "finish_reason": finish}

    def opening(self, index: int) -> Optional[dict]:
        """The first chunk of choice `index`, before any text: the role, as OpenAI streams it."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def chunk_choice(self, index: int, delta: str, finish: Optional[str], logprobs: Optional[list],
                     first: bool = False) -> dict:
        return {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish}

    def logprobs(self, entries: Optional[list]) -> Optional[dict]:
        if entries is None:
            return None
        return {"content": [{**self._token(e.token, e.logprob),
                             "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries]}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class Completion(Chat):
    """/v1/completions: text choices, and log-probs in the legacy shape (tokens, token_logprobs, top_logprobs,
    text_offset). With `echo`, each choice starts with the prompt (and, with logprobs, the prompt's tokens: their
    log-probs come with the first event)."""
    prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, tokenizer, echoes: Sequence[str] = (), n: int = 1):
        super().__init__(tokenizer)
        self.echoes, self.n = echoes, n

    def echoed(self, index: int) -> str:
        """What choice `index` repeats of its prompt (choice i * n + j is prompt i's sample j)."""
        return self.echoes[index // self.n] if self.echoes else ""

    def choice(self, index: int, text: str, finish: Optional[str], logprobs: Optional[list]) -> dict:
        return {"index": index, "text": self.echoed(index) + text, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish}

    def opening(self, index: int) -> Optional[dict]:
        return None  # the echoed prompt comes with the first event (with its log-probs, when asked for)

    def chunk_choice(self, index: int, delta: str, finish: Optional[str], logprobs: Optional[list],
                     first: bool = False) -> dict:
        return {"index": index, "text": self.echoed(index) + delta if first else delta,
                "logprobs": self.logprobs(logprobs), "finish_reason": finish}

    def prompt_entries(self, event: Event, index: int) -> list:
        """The prompt's tokens and log-probs to show before the completion's: without the BOS token the prompt's
        text does not hold (the first shown then has a log-prob, given BOS)."""
        entries, bos = list(event.prompt_logprobs or ()), self.tokenizer.bos_id
        if entries and entries[0].token == bos and not self.echoed(index).startswith(self.tokenizer.token_text(bos)):
            entries = entries[1:]
        return entries

    def logprobs(self, entries: Optional[list]) -> Optional[dict]:
        if entries is None:
            return None
        texts = [self.tokenizer.token_text(e.token) for e in entries]
        offsets = [sum(map(len, texts[:i])) for i in range(len(texts))]  # within the choice's text
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.tokenizer.token_text(t): lp for t, lp in e.top} if e.logprob is not None
                                 else None for e in entries],
                "text_offset": offsets}


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
        return error_response(generation_failed(failed[0], constraint_field(body)))
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
                yield f"data: {json.dumps(error_body(generation_failed(event, constraint_field(body))))}\n\n"
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


def usage(handle: Handle, finals) -> dict:
    completion = sum(final.completion_tokens for final in finals)
    return {"prompt_tokens": handle.prompt_tokens, "completion_tokens": completion,
            "total_tokens": handle.prompt_tokens + completion}
