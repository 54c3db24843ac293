"""The request bodies of Anthropic's Messages API, as pydantic models (strict, as schemas.py's): a field of the wrong
type, or one the server does not take, is a 400 naming it. A message's content blocks are read one by one
(anthropic.py `read_block`), so that a bad block is named by its place."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from accessory.serve.schemas import Strict


class Cached(Strict):
    cache_control: Optional[dict] = None  # taken, not needed: the prefix cache keeps every prompt's prefix


class TextBlock(Cached):
    type: Literal["text"]
    text: str
    citations: Optional[list] = None


class ImageSource(Strict):
    type: Literal["base64", "url"]
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None


class ImageBlock(Cached):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(Cached):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Cached):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[None, str, list[dict]] = None
    is_error: bool = False


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


BLOCKS = {"text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
          "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock}
TAKEN = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
         "tool_result": ("text",)}  # the blocks each holds


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict]]


class AnthropicTool(Cached):
    name: str
    input_schema: dict
    description: Optional[str] = None
    type: Optional[Literal["custom"]] = None
    strict: bool = False


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False


class Thinking(Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Optional[int] = Field(None, ge=1)
    display: Literal["summarized", "omitted"] = "summarized"


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Strict):
    format: Optional[OutputFormat] = None
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None  # taken, not used: a hint to Claude


class CountTokensRequest(Strict):
    """What makes the prompt."""
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[None, str, list[TextBlock]] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[Thinking] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    metadata: Optional[dict] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[dict] = None  # taken, not needed (as a block's)
    service_tier: Optional[str] = None  # taken, not used: one tier here
