"""The API's routes, on `router` (api.create_app includes it). Each reads what its app serves from
`app.state.served` (a `Served`) through the `AppServed` dependency, so apps in one process never share it, and is a
short call into the modules beside it (validation, images, responses, streaming, api_errors)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from accessory.generation.chat import render_chat
from accessory.generation.constraints import ConstraintError
from accessory.serve.api_errors import APIError
from accessory.serve.images import ImageOptions, image_pixels
from accessory.serve.responses import Chat, Completion, head, model_card
from accessory.serve.schemas import ChatRequest, CompletionRequest, DetokenizeRequest, SamplingFields, TokenizeRequest
from accessory.serve.service import FieldError, GenerationService, Handle, QueueFull, ServiceClosed
from accessory.serve.streaming import respond
from accessory.serve.validation import (ToolUse, chat_messages, chat_tools, check_common, check_model, check_text,
                                        check_token_ids, constraint_field, forced_calls, held_calls, prompt_list,
                                        reasoning_budget, sampling_of, stops, template_kwargs)
from accessory.text.reasoning import opens_reasoning, reasoning_format
from accessory.text.tool_calls import ToolReading, call_format, forced_format

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


@dataclass(frozen=True)
class Served:
    """What one app serves, and how (create_app's arguments, described there)."""
    slot: ServiceSlot
    model_name: str
    template: Optional[str]
    special_tokens_in_prompt: bool
    images: ImageOptions
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"


async def app_served(request: Request) -> Served:
    # async: FastAPI would run a plain `def` dependency in a worker thread. It never raises, so a bad body is still
    # refused (400) before a loading model is (503): the routes call slot.get() after FastAPI has read the body.
    return request.app.state.served


AppServed = Annotated[Served, Depends(app_served)]

# No return annotations on the routes: FastAPI would take them as response models and re-encode every answer.
router = APIRouter()


@router.get("/health")
async def health(served: AppServed):
    slot = served.slot
    if slot.service is None:
        return JSONResponse({"status": "loading", "phase": slot.phase}, status_code=503)
    healthy, report = slot.service.health()
    return report if healthy else JSONResponse(report, status_code=503)


@router.get("/metrics")
async def metrics(served: AppServed):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    found = served.slot.get().metrics
    if found is None:
        raise APIError(404, "this server keeps no metrics", kind="not_found_error")
    return Response(generate_latest(found.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(served: AppServed):
    service = served.slot.get()
    return {"object": "list", "data": [model_card(name, service, served.model_name)
                                       for name in (served.model_name, *service.model.adapter_names)]}


@router.get("/v1/models/{name}")
async def model(name: str, served: AppServed):
    service = served.slot.get()
    check_model(name, served.model_name, service.model.adapter_names)
    return model_card(name, service, served.model_name)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, served: AppServed):
    service = served.slot.get()
    options = check_common(body, served.model_name, service.rows, service.model.adapter_names)
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
        token_lists = [service.encode(p, served.special_tokens_in_prompt) if isinstance(p, str) else p
                       for p in prompts]
        for i, tokens in enumerate(token_lists):
            check_token_ids(tokens, service.vocab_size, "prompt" if len(prompts) == 1 else f"prompt.{i}")
        return service.submit_prompts(token_lists, sampling, stops(body), loop, **options, **labels(request, body))

    handle = await submit(make, constraint_field(body), "prompt")
    tokenizer = service.model.tokenizer
    echoes = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else []
    return await respond(Completion(tokenizer, echoes, body.n), body, handle, request,
                         head(body.model, service, handle, request))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, served: AppServed):
    service = served.slot.get()
    options = check_common(body, served.model_name, service.rows, service.model.adapter_names)
    messages, image = chat_messages(body.messages, service.model.llma.image_tokens > 0)
    use = chat_tools(body)
    limit = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    sampling = sampling_of(body, limit, (top or 0) if body.logprobs else None)

    context = template_kwargs(body)

    thinking = reasoning_format(served.reasoning_parser, service.model.tokenizer.chat_template_text)
    budget = reasoning_budget(body.max_reasoning_tokens, thinking, "max_reasoning_tokens")

    def make(loop):  # in a worker thread: decoding an image takes time too
        pixels = image and image_pixels(service.model, image, served.images)
        return service.submit_chat(messages, sampling, served.template, stops(body), loop, tools=use and use.tools,
                                   context=context, reasoning=thinking, reasoning_budget=budget, image=pixels,
                                   **options, **labels(request, body))

    reading = tool_reading(use, service, served, options)
    handle = await submit(make, constraint_field(body), "messages")
    shape = Chat(service.model.tokenizer, reading, thinking and (thinking, opens_reasoning(handle.prompt, thinking)))
    return await respond(shape, body, handle, request, head(body.model, service, handle, request))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, served: AppServed):
    service = served.slot.get()
    tokenizer = service.model.tokenizer
    if body.model is not None:
        check_model(body.model, served.model_name, service.model.adapter_names)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.prompt is not None:
        check_text(body.prompt, "prompt")
        tokens = await submit_free(lambda: service.tokenize(body.prompt, body.add_special_tokens,
                                                            served.special_tokens_in_prompt), prompt_field="prompt")
    else:
        messages, image = chat_messages(body.messages, service.model.llma.image_tokens > 0)

        def count():  # the image is read as a chat request reads it: a bad one is refused here too
            pixels = image and image_pixels(service.model, image, served.images)
            return service.encode(render_chat(tokenizer, messages, served.template)[0], True, pixels is not None)

        tokens = await submit_free(count, prompt_field="messages")
    # a JSONResponse, not a dict: FastAPI's encoder would walk the tokens in Python on the event loop (a second
    # for a million)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": service.columns})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, served: AppServed):
    service = served.slot.get()
    if body.model is not None:
        check_model(body.model, served.model_name, service.model.adapter_names)
    check_token_ids(body.tokens, service.vocab_size, "tokens")
    return {"prompt": service.model.tokenizer.decode(body.tokens)}


def tool_reading(use: Optional[ToolUse], service, served: Served, options: dict) -> Optional[ToolReading]:
    """How a reply to a request with tools is read for calls (None: it is plain content); a reply that must be
    calls is held to them in the model's format (its own, or a JSON list where that is Python calls or unknown),
    through `options`' constraint."""
    if use is None:
        return None
    fmt = call_format(served.tool_call_parser, service.model.tokenizer.chat_template_text)
    forced = forced_calls(use, forced_format(fmt))
    if forced is not None:
        options["constraint"], fmt = forced, forced_format(fmt)
    else:  # strict tools' calls held once one opens
        options["constraint"] = held_calls(use, fmt, options["constraint"]) or options["constraint"]
    if fmt is None:
        return None
    names = frozenset(tool["function"]["name"] for tool in use.tools)
    return ToolReading(fmt, names, use.parallel)


def labels(request: Request, body: SamplingFields) -> dict:
    """How the request is named in its log line."""
    return {"label": request.state.id, "user": body.user}


async def submit(make, constraint_field: Optional[str], prompt_field: str) -> Handle:
    """`make(loop)` queues the request, in a worker thread (templates and tokenizing take time: the event loop
    keeps answering meanwhile); the service's refusals become API errors (as `submit_free`'s)."""
    loop = asyncio.get_running_loop()
    return await submit_free(lambda: make(loop), constraint_field, prompt_field)


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
