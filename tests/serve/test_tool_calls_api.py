"""Tool calls in chat completions (accessory/text/tool_calls.py read by serve/responses.py `Chat`), on the built-in
model served in this process with Qwen2.5's chat template (ChatML with tools, so the format is found: hermes): a
reply held by guided_regex to text and hermes
calls comes back as `tool_calls` with finish_reason "tool_calls", whole and streamed alike (the streamed arguments'
pieces add up to the whole reply's), the markup never in the content; parallel_tool_calls false keeps the first
call; without tools, or with tool_choice "none", the same reply is plain content. A later turn carries the
assistant's calls (arguments as OpenAI's JSON string) back through the template as the model wrote them. Required,
named and strict calls are held to their schemas. With a template that opens a reasoning block, the reasoning goes
apart, is capped by max_reasoning_tokens, and comes before what a pattern or a required call holds."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from serving import app_client, running

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {
                                                "type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLY = "Let me check.\n" + CALL + "\n<tool_call>\n{\"name\": \"now\"}\n</tool_call>"


FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["C", "F"]}},
            "required": ["city", "days"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": FORECAST}}, TOOLS[1]]


@pytest.fixture(scope="module")
def service(smollm2_checkpoint):
    with running(smollm2_checkpoint, "qwen2.5-tools") as service:
        yield service


@pytest.fixture(scope="module")
def client(service):
    with app_client(service) as client:
        yield client


def ask(client, **fields) -> dict:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 80,
            "guided_regex": re.escape(REPLY), "tools": TOOLS, **fields}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def streamed(client, **fields) -> tuple[str, list[tuple[str, str, str]], str]:
    """A streamed reply put together: its content, each call's (id, name, arguments), its finish_reason."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 80,
            "guided_regex": re.escape(REPLY), "tools": TOOLS, "stream": True, **fields}
    content, calls, finish = "", {}, None
    with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls", []):
                if "id" in delta:
                    calls[delta["index"]] = [delta["id"], delta["function"]["name"], delta["function"]["arguments"]]
                else:
                    calls[delta["index"]][2] += delta["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_reply_with_calls_comes_back_as_tool_calls(client):
    choice = ask(client)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me check."
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("function", "get_weather", '{"city": "Paris"}'), ("function", "now", "{}")]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) for c in message["tool_calls"])


def test_a_streamed_reply_gives_the_same_calls_in_pieces(client):
    content, calls, finish = streamed(client)
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(name, arguments) for _, name, arguments in calls] == [("get_weather", '{"city": "Paris"}'),
                                                                    ("now", "{}")]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call_id) for call_id, _, _ in calls)


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    assert [c["function"]["name"] for c in ask(client, parallel_tool_calls=False)["message"]["tool_calls"]] == [
        "get_weather"]
    assert [name for _, name, _ in streamed(client, parallel_tool_calls=False)[1]] == ["get_weather"]


def test_without_tools_the_reply_is_content(client):
    choice = ask(client, tools=None)
    assert choice["message"] == {"role": "assistant", "content": REPLY} and choice["finish_reason"] == "stop"
    assert streamed(client, tool_choice="none") == (REPLY, [], "stop")


def test_a_later_turn_carries_the_calls_and_their_results(client):
    call = {"id": "call_" + "a" * 24, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}]
    answer = client.post("/v1/chat/completions", json={"model": "smol", "messages": messages, "max_tokens": 4,
                                                       "tools": TOOLS})
    assert answer.status_code == 200, answer.text
    tokens = client.post("/tokenize", json={"model": "smol", "messages": messages}).json()["tokens"]
    prompt = client.post("/detokenize", json={"model": "smol", "tokens": tokens}).json()["prompt"]
    assert "assistant\n" + CALL + "\nuser\n<tool_response>\n18 C, sunny\n</tool_response>" in prompt  # specials out


def forced(client, choice, **fields) -> dict:
    body = {"model": "smol", "messages": [{"role": "user", "content": "What will the weather be?"}],
            "max_tokens": 120, "tools": FORCED_TOOLS, "tool_choice": choice, **fields}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_required_calls_validate_against_the_tools_schema_on_every_seed(client):
    """The built-in model knows nothing of tools: the grammar writes the markup and holds the arguments."""
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(lambda seed: forced(client, "required", temperature=1.0, seed=seed,
                                                    parallel_tool_calls=False), range(8)))
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        (call,) = choice["message"]["tool_calls"]
        schema = FORECAST if call["function"]["name"] == "forecast" else {"type": "object", "properties": {}}
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_a_named_function_is_called_once_whole_and_streamed(client):
    choice = forced(client, {"type": "function", "function": {"name": "forecast"}})
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "forecast" and choice["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST)
    body = {"model": "smol", "messages": [{"role": "user", "content": "What will the weather be?"}],
            "max_tokens": 120, "tools": FORCED_TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}},
            "stream": True}
    calls = []
    with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                calls += json.loads(line[6:])["choices"][0]["delta"].get("tool_calls", [])
    assert calls[0]["function"]["name"] == "now" and "".join(c["function"]["arguments"] for c in calls) == "{}"


def test_a_function_named_like_a_mode_is_still_called(client):
    tools = [{"type": "function", "function": {"name": "auto", "parameters": {"type": "object", "properties": {}}}}]
    choice = forced(client, {"type": "function", "function": {"name": "auto"}}, tools=tools)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("auto", "{}")]


def test_a_model_whose_calls_are_python_is_held_to_a_json_list_instead(service):
    with app_client(service, tool_call_parser="pythonic") as client:
        choice = forced(client, {"type": "function", "function": {"name": "forecast"}})
        strict = [{"type": "function", "function": {"name": "forecast", "parameters": FORECAST, "strict": True}}]
        refused = client.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 4, "tools": strict,
                                                            "messages": [{"role": "user", "content": "Hi"}]})
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST)
    assert refused.status_code == 400 and "(pythonic) has none" in refused.json()["error"]["message"]  # no marker


def test_a_strict_tool_holds_the_call_the_model_opens_to_its_schema(client):
    """Asked to repeat a call with arguments its schema forbids, the model does, word for word; with `strict` on
    the tool, the text before the call is free, but once "<tool_call>" opens it the arguments are held (a forbidden
    key and 99 days are not written)."""
    ask = ('Repeat exactly, with nothing else: <tool_call>\n{"name": "forecast", "arguments": {"town": "Paris", '
           '"days": 99}}\n</tool_call>')
    calls = {}
    for strict in (False, True):
        tools = [{"type": "function", "function": {"name": "forecast", "parameters": FORECAST, "strict": strict}}]
        answer = client.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 60, "temperature": 0,
                                                           "tools": tools,
                                                           "messages": [{"role": "user", "content": ask}]}).json()
        (call,) = answer["choices"][0]["message"]["tool_calls"]
        calls[strict] = json.loads(call["function"]["arguments"])
    assert calls[False] == {"town": "Paris", "days": 99}
    jsonschema.validate(calls[True], FORECAST)


@pytest.mark.parametrize("fields, param", [
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "elsewhere"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required", "guided_regex": "x"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
      "tool_choice": "required"}, "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "strict": True}}], "guided_regex": "x"},
     "tools.1.function.strict"),
], ids=["required without tools", "unknown choice", "unknown name", "with guided_regex", "bad name", "bad schema",
        "schema not an object", "strict with guided_regex"])
def test_a_tool_choice_that_cannot_be_met_is_a_400_naming_the_field(client, fields, param):
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "tools": TOOLS,
            **fields}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


# ---- reasoning -----------------------------------------------------------------------------------------------------

THOUGHT = "The user asks for a city."


@pytest.fixture(scope="module")
def thinking(smollm2_checkpoint):
    """The built-in model with a template that opens a reasoning block (tests/data/chat_templates/thinking-tools)."""
    with running(smollm2_checkpoint, "thinking-tools") as service, app_client(service) as client, \
            app_client(service, reasoning_parser="none") as plain:
        yield client, plain


def think(client, reply: str, stream: bool = False, **fields):
    body = {"model": "smol", "messages": [{"role": "user", "content": "Which city?"}], "max_tokens": 80,
            "guided_regex": re.escape(reply), "stream": stream, "temperature": 0, **fields}
    if not stream:
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]
    deltas = {"reasoning_content": "", "content": ""}
    with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                for key in deltas:
                    deltas[key] += delta.get(key) or ""
    return deltas


def test_reasoning_goes_apart_from_the_answer_whole_and_streamed(thinking):
    """The reasoning is the model's (at most 6 tokens: max_reasoning_tokens closes the block), the answer held to
    the pattern after it; whole and streamed alike. Without a reasoning parser, the pattern holds the whole reply."""
    client, plain = thinking
    message = think(client, "Paris.", max_reasoning_tokens=6)["message"]
    assert message["reasoning_content"] and message["content"] == "Paris."
    assert think(client, "Paris.", stream=True, max_reasoning_tokens=6) == {
        "reasoning_content": message["reasoning_content"], "content": "Paris."}
    reply = THOUGHT + "\n</think>\n\nParis."
    assert think(plain, reply)["message"]["content"] == reply  # --reasoning-parser none


def test_max_reasoning_tokens_closes_the_block_and_the_answer_follows(thinking):
    """Left alone, the built-in model (no thinking model) never closes the block the prompt opened: the reply is
    all reasoning. With max_reasoning_tokens the block is closed after that many tokens and the answer follows."""
    client, _ = thinking
    body = {"model": "smol", "messages": [{"role": "user", "content": "Which city?"}], "max_tokens": 40,
            "temperature": 0}
    alone = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert alone["message"]["content"] == "" and alone["message"]["reasoning_content"]
    capped = client.post("/v1/chat/completions", json={**body, "max_reasoning_tokens": 5}).json()["choices"][0]
    thought, answer = capped["message"]["reasoning_content"], capped["message"]["content"]
    assert alone["message"]["reasoning_content"].startswith(thought) and answer
    tokens = client.post("/tokenize", json={"model": "smol", "prompt": thought, "add_special_tokens": False}).json()
    assert tokens["count"] <= 5


def test_chat_template_kwargs_reach_the_template(thinking):
    client, _ = thinking
    message = think(client, "Paris.", chat_template_kwargs={"enable_thinking": False})["message"]
    assert message["content"] == "Paris." and message["reasoning_content"] is None, message
    answer = client.post("/v1/chat/completions", json={"model": "smol", "messages": [{"role": "user", "content": "x"}],
                                                       "chat_template_kwargs": {"messages": []}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template_kwargs"


def test_calls_are_read_in_the_answer_after_the_reasoning(thinking):
    client, _ = thinking
    choice = think(client, CALL, tools=TOOLS, max_reasoning_tokens=6)
    assert choice["message"]["reasoning_content"] and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


def test_a_required_call_comes_after_the_reasoning(thinking):
    """The prompt opened a reasoning block: the grammar lets the reply reason (here at most 6 tokens), then holds
    it to the call."""
    client, _ = thinking
    body = {"model": "smol", "messages": [{"role": "user", "content": "Which city?"}], "max_tokens": 80,
            "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_reasoning_tokens": 6, "temperature": 0}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and message["content"] is None and message["reasoning_content"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])


def test_an_assistants_reasoning_content_goes_back_to_the_template(thinking):
    """As a client sends the server's reply back (the openai SDK's model_dump): taken, and its text checked."""
    client, _ = thinking
    turn = {"role": "assistant", "content": "Paris.", "reasoning_content": THOUGHT}
    messages = [{"role": "user", "content": "Which city?"}, turn, {"role": "user", "content": "Why?"}]
    counted = client.post("/tokenize", json={"model": "smol", "messages": messages})
    assert counted.status_code == 200, counted.text
    bad = [messages[0], {**turn, "reasoning_content": "\ud800"}, messages[2]]
    refused = client.post("/tokenize", headers={"content-type": "application/json"},
                          content=json.dumps({"model": "smol", "messages": bad}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.1.reasoning_content"


def test_max_reasoning_tokens_needs_a_model_that_reasons(client):
    answer = client.post("/v1/chat/completions", json={"model": "smol", "max_reasoning_tokens": 8,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_reasoning_tokens"
