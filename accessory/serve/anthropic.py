"""Anthropic's Messages API on the same engine as the OpenAI routes: POST /v1/messages (streamed with Anthropic's
event types or not) and POST /v1/messages/count_tokens.

A request's `system`, its messages' text, image, tool_use, tool_result and thinking blocks, and its `tools` are
read into the OpenAI-style messages and function definitions the chat template takes (a user turn's tool results
become `tool` messages before its text, an assistant turn's tool_use blocks its `tool_calls`); `tool_choice` and
`thinking` map onto what the OpenAI route does with them. Errors take Anthropic's shape (api_errors.py) and the API
key may come as `x-api-key` (api.py). The request bodies are in anthropic_schemas.py, the reply's blocks and events
in anthropic_replies.py.
"""
from __future__ import annotations

from typing import Optional, Union

from fastapi import APIRouter, Request

from accessory.generation.chat import render_chat
from accessory.generation.constraints import Constraint
from accessory.serve.anthropic_replies import Reading, respond
from accessory.serve.anthropic_schemas import (BLOCKS, TAKEN, AnthropicTool, AnthropicToolChoice, CountTokensRequest,
                                               ImageBlock, MessagesRequest, TextBlock, ThinkingBlock, ToolResultBlock,
                                               ToolUseBlock)
from accessory.serve.api_errors import APIError
from accessory.serve.images import ImageRef, image_pixels
from accessory.serve.routes import AppServed, submit, submit_free, tool_reading
from accessory.serve.schemas import ImagePart, ImageURL, TextPart
from accessory.serve.validation import (ToolUse, check_chosen, check_function, check_model, check_text, one_image,
                                        part_text, validated)
from accessory.text.reasoning import opens_reasoning, reasoning_format

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, served: AppServed):
    service = served.slot.get()
    adapter = check_model(body.model, served.model_name, service.model.adapter_names)
    plain, image = anthropic_messages(body, service.model.llma.image_tokens > 0)
    use = anthropic_tools(body)
    context = thinking_context(body)
    stops = body.stop_sequences or []
    for i, stop in enumerate(stops):
        check_text(stop, f"stop_sequences.{i}")
    sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                "max_gen_len": body.max_tokens}
    options = {"n": 1, "constraint": output_format(body), "adapter": adapter}
    reading = tool_reading(use, service, served, options)
    user = (body.metadata or {}).get("user_id")
    thinking = reasoning_format(served.reasoning_parser, service.model.tokenizer.chat_template_text)
    budget = body.thinking.budget_tokens if body.thinking and body.thinking.type == "enabled" else None
    held_by = constraint_field(body)

    def make(loop):  # in a worker thread, as the OpenAI route's
        pixels = image and image_pixels(service.model, image, served.images)
        return service.submit_chat(plain, sampling, served.template, stops, loop, tools=use and use.tools,
                                   context=context, reasoning=thinking, reasoning_budget=budget, image=pixels,
                                   label=request.state.id, user=user if isinstance(user, str) else None, **options)

    handle = await submit(make, held_by, "messages")
    how = Reading(reading, thinking and (thinking, opens_reasoning(handle.prompt, thinking)), tuple(stops), held_by,
                  body.thinking is None or body.thinking.display == "summarized")
    return await respond(how, body, handle, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, served: AppServed):
    """The prompt's tokens, as a request with these fields would be given them."""
    service = served.slot.get()
    check_model(body.model, served.model_name, service.model.adapter_names)
    plain, image = anthropic_messages(body, service.model.llma.image_tokens > 0)
    use = anthropic_tools(body)

    def count():
        pixels = image and image_pixels(service.model, image, served.images)
        prompt, _ = render_chat(service.model.tokenizer, plain, served.template, use and use.tools,
                                thinking_context(body))
        return len(service.encode(prompt, True, pixels is not None))

    return {"input_tokens": await submit_free(count, prompt_field="messages")}


# ---- the request read into what the chat template takes ---------------------------------------------------------

def anthropic_messages(body: CountTokensRequest, reads_images: bool) -> tuple[list[dict], Optional[ImageRef]]:
    """The system prompt and messages as OpenAI-style messages, and their image if a block holds one."""
    images: list = []
    names: dict[str, str] = {}  # a tool_use block's id -> its tool's name, for the results that answer it
    plain = []
    system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system or ())
    if system:
        check_text(system, "system")
        plain.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        raw = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        blocks = [(read_block(block, f"{where}.{j}", message.role), f"{where}.{j}") for j, block in enumerate(raw)]
        turn = user_turn if message.role == "user" else assistant_turn
        plain += turn(blocks, reads_images, images, names)
    return plain, one_image(images)


def read_block(block, where: str, holder: str):
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in TAKEN[holder]:
        raise APIError(400, f"{where}.type: {kind!r}, where this server takes {', '.join(TAKEN[holder])} blocks",
                       param=f"{where}.type")
    given = {key: value for key, value in block.items() if value is not None}  # a client's model dump has Nones
    return validated(BLOCKS[kind], given, where)


def user_turn(blocks: list, reads_images: bool, images: list, names: dict) -> list[dict]:
    """A user message's tool results as `tool` messages, then its text and image as one user message."""
    results = [tool_message(block, where, names) for block, where in blocks if isinstance(block, ToolResultBlock)]
    parts = [part_text(openai_part(block), where, "user", reads_images, images) for block, where in blocks
             if not isinstance(block, ToolResultBlock)]
    return results + ([{"role": "user", "content": "\n".join(parts)}] if parts or not results else [])


def openai_part(block: Union[TextBlock, ImageBlock]) -> Union[TextPart, ImagePart]:
    if isinstance(block, TextBlock):
        return TextPart(type="text", text=block.text)
    source = block.source
    url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
    return ImagePart(type="image_url", image_url=ImageURL(url=url or ""))


def tool_message(block: ToolResultBlock, where: str, names: dict) -> dict:
    """A tool's result as the `tool` message that chat templates read."""
    content = block.content
    if isinstance(content, list):
        content = "\n".join(read_block(part, f"{where}.content.{i}", "tool_result").text
                            for i, part in enumerate(content))
    content = content or ""
    check_text(content, f"{where}.content")
    message = {"role": "tool", "tool_call_id": block.tool_use_id, "content": f"Error: {content}" if block.is_error
               else content}
    return {**message, "name": names[block.tool_use_id]} if block.tool_use_id in names else message


def assistant_turn(blocks: list, reads_images: bool, images: list, names: dict) -> list[dict]:
    """An assistant message: its text, its tool_use blocks as `tool_calls` (arguments as a mapping, as templates
    read them) and its thinking as `reasoning_content` (which some templates show in a turn of tool calls)."""
    for block, where in blocks:
        if isinstance(block, (TextBlock, ThinkingBlock)):
            check_text(block.text if isinstance(block, TextBlock) else block.thinking, where)
    text = "".join(block.text for block, _ in blocks if isinstance(block, TextBlock))
    calls = [block for block, _ in blocks if isinstance(block, ToolUseBlock)]
    names.update((call.id, call.name) for call in calls)
    message = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.input}} for call in calls]
    thinking = "".join(block.thinking for block, _ in blocks if isinstance(block, ThinkingBlock))
    return [{**message, "reasoning_content": thinking} if thinking else message]


def anthropic_tools(body: CountTokensRequest) -> Optional[ToolUse]:
    """The request's custom tools as function definitions, and how tool_choice lets the reply call them."""
    tools = []
    for i, raw in enumerate(body.tools or ()):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in (None, "custom"):
            raise APIError(400, f"tools.{i}.type: {kind!r} is one of Anthropic's own tools; this server runs the "
                           f"client's tools only (name, description, input_schema)", param=f"tools.{i}.type")
        tool = validated(AnthropicTool, raw, f"tools.{i}")
        check_function(tool.name, tool.input_schema, f"tools.{i}", "input_schema")
        function = {"name": tool.name, "parameters": tool.input_schema, **({"strict": True} if tool.strict else {})}
        tools.append({"type": "function", "function": {**function, "description": tool.description}
                      if tool.description is not None else function})
    choice = body.tool_choice or AnthropicToolChoice(type="auto")
    names = [tool["function"]["name"] for tool in tools]
    if choice.type in ("any", "tool") and not tools:
        raise APIError(400, f"tool_choice.type: {choice.type!r} needs tools", param="tool_choice.type")
    if choice.type == "tool" and choice.name is None:
        raise APIError(400, 'tool_choice.name: required when type is "tool"', param="tool_choice.name")
    if not tools or choice.type == "none":
        return None
    mode = {"auto": "auto", "any": "required", "tool": "function"}[choice.type]
    name = check_chosen(choice.name, names, "tool_choice.name") if choice.type == "tool" else None
    return ToolUse(tools, mode, name, not choice.disable_parallel_tool_use, "tools.{}.input_schema")


def output_format(body: MessagesRequest) -> Optional[Constraint]:
    """output_config.format: the reply held to a JSON schema (not beside a required tool call)."""
    fmt = body.output_config and body.output_config.format
    if fmt is None:
        return None
    if body.tool_choice is not None and body.tool_choice.type in ("any", "tool"):
        raise APIError(400, f"output_config.format: a reply held to a schema cannot also be a required tool call "
                       f"(tool_choice {body.tool_choice.type!r})", param="output_config.format")
    try:
        return Constraint.json_schema(fmt.schema_)
    except ValueError as e:
        raise APIError(400, f"output_config.format.schema: {e}", param="output_config.format.schema")


def constraint_field(body: MessagesRequest) -> str:
    """The field a constraint's refusal names (the grammar engine's, while decoding)."""
    if body.output_config and body.output_config.format:
        return "output_config.format"
    if body.tool_choice is not None and body.tool_choice.type in ("any", "tool"):
        return "tool_choice"
    return "thinking.budget_tokens" if body.thinking and body.thinking.budget_tokens else "tools"


def thinking_context(body: CountTokensRequest) -> Optional[dict]:
    """`thinking` as the chat template variable that Qwen3-style templates read ("enabled" and "adaptive" think);
    without it, the template's default."""
    if body.thinking is None:
        return None
    if isinstance(body, MessagesRequest) and (body.thinking.budget_tokens or 0) >= body.max_tokens:
        raise APIError(400, f"thinking.budget_tokens: must be less than max_tokens ({body.max_tokens}), got "
                       f"{body.thinking.budget_tokens}", param="thinking.budget_tokens")
    return {"enable_thinking": body.thinking.type != "disabled"}
