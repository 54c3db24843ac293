"""A request's fields checked and turned into what the service takes (sampling, stops, the structured-output
constraint, prompts, chat messages and their image, tools); whatever it cannot take is an APIError naming the field."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from pydantic import BaseModel, ValidationError

from accessory.generation.constraints import JSON_OPTIONS, Constraint
from accessory.text.tokenizer import IMAGE_PLACEHOLDER
from accessory.serve.api_errors import APIError
from accessory.serve.images import ImageRef
from accessory.text.reasoning import ReasoningFormat
from accessory.text.tool_calls import CallFormat, call_grammar, held_calls_grammar
from accessory.serve.schemas import PART_MODELS, ChatRequest, ImagePart, Message, OtherPart, SamplingFields, TextPart


def check_model(name: str, served: str, adapters: Sequence[str] = ()) -> int:
    """The PEFT adapter a request's `model` names: 0 for the served model itself, i for the i-th of its
    --lora-modules; else OpenAI's 404 model_not_found."""
    if name == served:
        return 0
    if name in adapters:
        return list(adapters).index(name) + 1
    serves = repr(served) if not adapters else f"{served!r} and its LoRA adapters {list(adapters)}"
    raise APIError(404, f"the model {name!r} does not exist; this server serves {serves}", param="model",
                   code="model_not_found")


def check_common(body: SamplingFields, served: str, rows: int, adapters: Sequence[str] = ()) -> dict:
    """Check what both endpoints share; the service's options for `n`, the constraint and the adapter."""
    adapter = check_model(body.model, served, adapters)
    if body.n > rows:
        raise APIError(400, f"n: at most {rows} samples per request (the server's --max-batch-size), got {body.n}",
                       param="n")
    return {"n": body.n, "constraint": constraint_of(body), "adapter": adapter}


def constraint_fields(body: SamplingFields) -> list[str]:
    """The fields that ask for structured output."""
    given = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(body, name) is not None]
    fmt = body.response_format
    return given + ["response_format"] if fmt is not None and fmt.type != "text" else given


def constraint_field(body: SamplingFields) -> Optional[str]:
    """The field a constraint's refusal names: a structured-output field, else a tool_choice that forces calls,
    else a cap on the reasoning."""
    forced = getattr(body, "tool_choice", None) not in (None, "auto", "none")
    budget = "max_reasoning_tokens" if getattr(body, "max_reasoning_tokens", None) is not None else None
    return next(iter(constraint_fields(body)), "tool_choice" if forced else budget)


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


def chat_messages(messages: list[Message], reads_images: bool) -> tuple[list[dict], Optional[ImageRef]]:
    """The messages as the chat template reads them, and their image if a part holds one (one per request:
    LLaVA-1.5 takes one image)."""
    found: list[ImageRef] = []
    plain = [plain_message(m, f"messages.{i}", reads_images, found) for i, m in enumerate(messages)]
    return plain, one_image(found)


def one_image(found: list[ImageRef]) -> Optional[ImageRef]:
    """The request's image, if it has one (LLaVA-1.5 takes one a request)."""
    if len(found) > 1:
        raise APIError(400, f"{found[1].part}: a second image ({found[0].part} is the first); this model takes one "
                            f"image per request", param=found[1].part)
    return found[0] if found else None


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
    if message.reasoning_content is not None:
        check_text(message.reasoning_content, f"{where}.reasoning_content")
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            plain[key] = getattr(message, key)
    if message.tool_calls:
        plain["tool_calls"] = [template_call(call) for call in message.tool_calls]
    return plain


def template_call(call: dict) -> dict:
    """An earlier turn's tool call as chat templates read it (transformers' convention): its arguments a mapping,
    where OpenAI sends them as a JSON string."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


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
    validated(model, part.model_dump(), where)


def validated(model: type[BaseModel], data, where: str):
    """`data` read as `model`, or the 400 naming its first wrong field under `where`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join([where, *map(str, first["loc"])])
        message = "not a field this server takes" if first["type"] == "extra_forbidden" else first["msg"]
        raise APIError(400, f"{field}: {message}", param=field) from None


TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")  # the server's to set


def template_kwargs(body: ChatRequest) -> Optional[dict]:
    """chat_template_kwargs: more variables for the chat template ({"enable_thinking": false}), named as Jinja
    names, none of those the server sets."""
    for key in body.chat_template_kwargs or {}:
        if not key.isidentifier() or key in TEMPLATE_NAMES:
            raise APIError(400, f"chat_template_kwargs: {key[:100]!r} is not a name a request may set (a Python "
                           f"identifier, none of {', '.join(TEMPLATE_NAMES)})", param="chat_template_kwargs")
    return body.chat_template_kwargs or None


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name (and Anthropic's)


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, as chat templates read them (OpenAI's function definitions), and how its reply may
    call them: `mode` "auto", "required", or "function" (a call of the function `name`); `parallel`: several calls
    in one reply; `schema_field`: where the request holds tool i's parameters schema, as a format string."""
    tools: list[dict]
    mode: str
    name: Optional[str]
    parallel: bool
    schema_field: str


def chat_tools(body: ChatRequest) -> Optional[ToolUse]:
    """The request's tools and tool_choice; None when there are none or tool_choice is "none"."""
    tools = [tool.model_dump() for tool in body.tools or ()]
    for i, tool in enumerate(tools):
        check_function(tool["function"].get("name"), tool["function"].get("parameters", {}), f"tools.{i}.function",
                       "parameters")
    mode, name = tool_choice(body, [tool["function"]["name"] for tool in tools])
    if not tools or mode == "none":
        return None
    if mode != "auto" and constraint_fields(body):
        raise APIError(400, f"tool_choice: a required call cannot also be held to {constraint_fields(body)[0]}",
                       param="tool_choice")
    return ToolUse(tools, mode, name, body.parallel_tool_calls is not False, "tools.{}.function.parameters")


def check_function(name, parameters, where: str, schema_key: str) -> None:
    """A tool's name (OpenAI's rule) and parameters schema (an object) at `where` in the request."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise APIError(400, f"{where}.name: 1 to 64 letters, digits, _ or -, got {name!r}", param=f"{where}.name")
    if not isinstance(parameters, dict):
        raise APIError(400, f"{where}.{schema_key}: a JSON schema object, got {type(parameters).__name__}",
                       param=f"{where}.{schema_key}")


def tool_choice(body: ChatRequest, names: list[str]) -> tuple[str, Optional[str]]:
    """(mode, name): "auto" (the default), "none" or "required", or "function" and the name of the function the
    reply must call."""
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, 'tool_choice: "auto", "none", "required" or {"type": "function", "function": '
                           f'{{"name": ...}}}}, got {json.dumps(choice)[:200]}', param="tool_choice")
        return "function", check_chosen(name, names, "tool_choice.function.name")
    if choice not in ("auto", "none", "required"):
        raise APIError(400, f'tool_choice: "auto", "none", "required" or a function, got {choice!r}',
                       param="tool_choice")
    if choice == "required" and not names:
        raise APIError(400, 'tool_choice: "required" needs tools', param="tool_choice")
    return choice, None


def check_chosen(name: str, names: list[str], field: str) -> str:
    if name not in names:
        raise APIError(400, f"{field}: {name!r} is not one of the request's tools {names}", param=field)
    return name


def forced_calls(use: ToolUse, fmt: CallFormat) -> Optional[Constraint]:
    """A reply that must be calls (mode "required": of any tool; "function": of that one): the constraint that
    holds it to `fmt`'s markup and each tool's parameters schema; None if the reply may be anything."""
    if use.mode == "auto":
        return None
    called = use.tools if use.mode == "required" else [t for t in use.tools if t["function"]["name"] == use.name]
    for i, tool in enumerate(use.tools):
        if tool in called:
            check_tool_schema(tool, use.schema_field.format(i), fmt)
    several = use.mode == "required" and use.parallel  # a named function: one call of it
    return Constraint("tool_calls", call_grammar(fmt, called, several, JSON_OPTIONS))


def held_calls(use: ToolUse, fmt: Optional[CallFormat], constraint: Optional[Constraint]) -> Optional[Constraint]:
    """Under tool_choice "auto", where a tool is `strict`: the constraint that lets the reply be any text until it
    opens a call, then holds the call to `fmt`'s markup and a strict tool's arguments to its schema. None where no
    tool is strict."""
    strict = [i for i, tool in enumerate(use.tools) if tool["function"].get("strict") is True]
    if use.mode != "auto" or not strict:
        return None
    field = use.schema_field.format(strict[0]).rsplit(".", 1)[0] + ".strict"
    if fmt is None or not fmt.start:
        raise APIError(400, f"{field}: a strict tool's calls are held from the marker that opens one, and this "
                       f"model's tool-call format ({fmt.name if fmt else 'none in its chat template'}) has none",
                       param=field)
    if constraint is not None:
        raise APIError(400, f"{field}: calls cannot be held while the reply is held to structured output",
                       param=field)
    for i in strict:
        check_tool_schema(use.tools[i], use.schema_field.format(i), fmt)
    return Constraint("tool_calls", held_calls_grammar(fmt, use.tools, use.parallel, JSON_OPTIONS))


def check_tool_schema(tool: dict, field: str, fmt: CallFormat) -> None:
    """A tool's parameters the grammar engine cannot hold a call to is a 400 naming them."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(fmt, [tool], False, JSON_OPTIONS))
    except RecursionError:
        raise APIError(400, f"{field}: nested too deeply", param=field) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise APIError(400, f"{field}: the grammar engine cannot hold a call to this schema: "
                       f"{messages[0].splitlines()[0][:300] if messages else 'refused'}", param=field)


def reasoning_budget(budget: Optional[int], thinking: Optional[ReasoningFormat], field: str) -> Optional[int]:
    """A cap on the reply's reasoning tokens: for a model whose reasoning the server reads."""
    if budget is not None and thinking is None:
        raise APIError(400, f"{field}: this model's chat template writes no reasoning markers (the server's "
                       f"--reasoning-parser reads none)", param=field)
    return budget


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
