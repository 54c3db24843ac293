"""The request bodies the API takes, as pydantic models: strict (a field of the wrong type or one the server does not
know is a 400 naming it), with OpenAI's ranges and defaults."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from accessory.generation.sampling import LOGIT_BIAS_RANGE, MAX_LOGPROBS, PENALTY_RANGE, REPETITION_PENALTY_RANGE


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
    reasoning_content: Optional[str] = None  # an assistant turn's, as the server sent it: for templates that show it


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
    chat_template_kwargs: Optional[dict] = None
    max_reasoning_tokens: Optional[int] = Field(None, ge=1)


class TokenizeRequest(Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: Optional[str] = None
    tokens: list[int]
