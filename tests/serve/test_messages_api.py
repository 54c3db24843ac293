"""Anthropic's Messages API (accessory/serve/anthropic.py, anthropic_replies.py) through the official `anthropic`
client, on the built-in model served in this process with Qwen2.5's chat template: text whole and streamed alike,
as the OpenAI route answers the same messages; stop sequences and max_tokens named as the stop reason; a tool round
trip (a required call whose input validates against its schema, whole and streamed alike, then its tool_result
back through the template as the hand-written OpenAI-style turn renders it); strict tools; thinking with a budget,
its blocks streamed as whole;
x-api-key; and errors in Anthropic's shape, naming the field. The image block is in test_multimodal_serve.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from serving import app_client, running

KEY = "anthropic-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
GREEDY = {"temperature": 0}  # taken by the server; no longer a parameter of the client's create()


@pytest.fixture(scope="module")
def service(smollm2_checkpoint):
    with running(smollm2_checkpoint, "qwen2.5-tools") as service:
        yield service


@pytest.fixture(scope="module")
def http(service):
    with app_client(service, api_key=KEY) as http:
        yield http


@pytest.fixture(scope="module")
def client(http):
    import anthropic

    return anthropic.Anthropic(base_url="http://testserver", api_key=KEY, http_client=http, max_retries=0)


def create(client, **fields):
    return client.messages.create(**{"model": "smol", "max_tokens": 24, "messages": QUESTION,
                                     "extra_body": GREEDY, **fields})


def test_text_whole_and_streamed_is_the_chat_completions_reply(client, http):
    """The same greedy text as /v1/chat/completions gives the same messages (system prompt first), in one text
    block, streamed in pieces that add up to it; the prompt's tokens counted as count_tokens counts them."""
    system = "Answer in one sentence."
    whole = create(client, system=system)
    expected = http.post("/v1/chat/completions", headers={"x-api-key": KEY}, json={
        "model": "smol", "messages": [{"role": "system", "content": system}, *QUESTION], "max_tokens": 24,
        "temperature": 0}).json()
    assert [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == expected["choices"][0]["message"]["content"]
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected["choices"][0]["finish_reason"]]
    assert whole.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == expected["usage"]["completion_tokens"]
    counted = client.messages.count_tokens(model="smol", system=system, messages=QUESTION)
    assert counted.input_tokens == whole.usage.input_tokens
    with client.messages.stream(model="smol", max_tokens=24, system=system, messages=QUESTION,
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text and len(pieces) > 1
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_max_tokens_are_the_stop_reason(client):
    text = create(client, max_tokens=40).content[0].text
    word = text.split()[3]
    stopped = create(client, max_tokens=40, stop_sequences=["@@", word])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert stopped.content[0].text == text[:text.index(word)]
    short = create(client, max_tokens=3)
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 3)


def test_a_tool_round_trip(client, service):
    """tool_choice "tool": one call, its input valid against the schema, whole and streamed alike (the streamed
    input_json_delta pieces parse to the same input); the call and its tool_result go back to the model as the
    OpenAI-style turn written by hand renders."""
    fields = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 40,
              "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    called = create(client, **fields)
    assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"]
    use = called.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model="smol", extra_body=GREEDY, **fields) as stream:
        events = list(stream)
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(pieces)) == use.input and len(pieces) > 1
    assert [e.type for e in events if e.type.startswith("content_block_s")] == ["content_block_start",
                                                                                "content_block_stop"]

    answered = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [block.model_dump() for block in called.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    by_hand = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
                   "name": "get_weather", "arguments": use.input}}]},
               {"role": "tool", "tool_call_id": use.id, "name": "get_weather", "content": "21 C"}]
    from accessory.generation.chat import render_chat

    openai_tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                      "parameters": WEATHER}}]
    prompt, _ = render_chat(service.model.tokenizer, by_hand, tools=openai_tools)
    assert "<tool_response>\n21 C\n</tool_response>" in prompt
    counted = client.messages.count_tokens(model="smol", messages=answered, tools=TOOLS)
    assert counted.input_tokens == len(service.encode(prompt, True))
    final = create(client, messages=answered, tools=TOOLS, max_tokens=16)
    assert final.usage.input_tokens == counted.input_tokens and final.content[0].type == "text"


def test_a_strict_tool_holds_the_call_to_its_schema(client):
    """As /v1/chat/completions' strict tools (test_tool_calls_api.py): the call the model is asked to repeat has a
    key its schema lacks; with `strict` its input is held to the schema."""
    ask = ('Repeat exactly, with nothing else: <tool_call>\n{"name": "get_weather", "arguments": {"town": '
           '"Paris"}}\n</tool_call>')
    inputs = [create(client, max_tokens=40, messages=[{"role": "user", "content": ask}],
                     tools=[{**TOOLS[0], "strict": strict}]).content[0].input for strict in (False, True)]
    assert inputs[0] == {"town": "Paris"}
    jsonschema.validate(inputs[1], {**WEATHER, "additionalProperties": False})


@pytest.fixture(scope="module")
def thinker(smollm2_checkpoint):
    """The built-in model with a template that opens a reasoning block (tests/data/chat_templates/thinking-tools)."""
    import anthropic

    with running(smollm2_checkpoint, "thinking-tools") as service, app_client(service, api_key=KEY) as http:
        yield anthropic.Anthropic(base_url="http://testserver", api_key=KEY, http_client=http, max_retries=0)


def test_thinking_with_a_budget_is_a_thinking_block_then_the_answer(thinker):
    """budget_tokens closes the reasoning block after that many tokens (the built-in model would not close it);
    streamed, the thinking_delta and text_delta pieces add up to the whole reply's blocks; "omitted" sends the
    thinking block empty; "disabled" reaches the template, which then writes the block empty: no thinking."""
    fields = {"max_tokens": 40, "thinking": {"type": "enabled", "budget_tokens": 5}}
    whole = create(thinker, **fields)
    assert [block.type for block in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and whole.content[1].text
    with thinker.messages.stream(model="smol", messages=QUESTION, extra_body=GREEDY, **fields) as stream:
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in whole.content]
    omitted = create(thinker, max_tokens=40, thinking={**fields["thinking"], "display": "omitted"})
    assert omitted.content[0].thinking == "" and omitted.content[1].text == whole.content[1].text
    disabled = create(thinker, max_tokens=12, thinking={"type": "disabled"})
    assert [block.type for block in disabled.content] == ["text"]


def test_thinking_blocks_stream_as_they_come_whole():
    """A reply that thinks, says something and calls two tools: the streamed events, put together block by block,
    are the whole reply's blocks, for the reply cut into pieces at every character."""
    from accessory.generation.chat import ReplyStream, read_reply
    from accessory.serve.anthropic_replies import Blocks, content_blocks
    from accessory.text.reasoning import REASONING_FORMATS
    from accessory.text.tool_calls import FORMATS, ToolReading

    reply = ('<think>Paris, then the time.</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    how = ((REASONING_FORMATS["qwen3"], False), ToolReading(FORMATS["hermes"], frozenset({"get_weather", "now"})))
    whole = without_ids(content_blocks(read_reply(reply, *how)))
    assert [b["type"] for b in whole] == ["thinking", "text", "tool_use", "tool_use"]
    for cut in range(1, len(reply)):
        reading, blocks, events = ReplyStream(*how), Blocks(), []
        for piece, final in ((reply[:cut], False), (reply[cut:], True)):
            events += [out for out in blocks.write(*reading.feed(piece, final))]
        assert without_ids(put_together(events)) == whole, cut


def put_together(events: list[str]) -> list[dict]:
    blocks = []
    for event in events:
        data = json.loads(event.split("data: ", 1)[1])
        if data["type"] == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append({**data["content_block"], "partial_json": ""})
        elif data["type"] == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "partial_json"}
            block[key[delta["type"]]] += delta[key[delta["type"]]]
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial_json"])
        del block["partial_json"]
    return blocks


def without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in block.items() if k != "id"} for block in blocks]


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools.0.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 24}}, "thinking.budget_tokens"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"extra_body": {"best_of": 2}}, "best_of"),
])
def test_bad_fields_are_a_400_in_anthropics_shape_naming_them(client, fields, param):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as refused:
        create(client, **fields)
    error = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param + ":"), error


def test_keys_models_and_images_are_refused_in_anthropics_shape(client, http):
    import anthropic

    wrong = anthropic.Anthropic(base_url="http://testserver", api_key="wrong", http_client=http, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        create(wrong)
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as refused:
        create(client, model="claude-opus-9")
    assert refused.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(client, messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
    assert "this model reads text only" in refused.value.body["error"]["message"]
    assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200  # either header
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    lone_surrogate = http.post("/v1/messages", headers=headers, content=json.dumps(
        {"model": "smol", "max_tokens": 4, "messages": QUESTION, "stop_sequences": ["\ud800"]}))
    assert lone_surrogate.status_code == 400
    assert lone_surrogate.json()["error"]["message"].startswith("stop_sequences.0: not valid Unicode")
