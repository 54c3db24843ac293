"""Tool calls read back from a model's reply (accessory/text/tool_calls.py): a corpus of replies per format (no
call, one, several; nested JSON, unicode, escaped quotes, the closing marker inside a string; no arguments; text
before and after; a reply cut short; markup that is not a call) gives exactly the expected content and calls, and a
stream of the same reply, split anywhere, adds up to the same content and the same arguments byte for byte."""
from __future__ import annotations

import json

import pytest

from accessory.text.tool_calls import FORMATS, CallStream, detect_format, parse
from conftest import REPO

NOTE = '{"text": "say \\"hi\\" </tool_call> ünïcødé ☃", "tags": [{"k": [1, 2]}], "n": -1.5e3, "ok": null}'

CORPUS = {
    "hermes": [
        ("Hello there.", "Hello there.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
         [("get_weather", '{"city": "Paris"}')]),
        ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
         '{"name": "b", "arguments": {}}\n</tool_call>\n', "Let me check.", [("a", '{"x": 1}'), ("b", "{}")]),
        (f'<tool_call>{{"name": "note", "arguments": {NOTE}}}</tool_call>', "", [("note", NOTE)]),
        ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
        ('<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>', "", [("search", '{"q": "x"}')]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
        ('<tool_call>{"name": "f", "arguments": { }}</tool_call>', "", [("f", "{ }")]),
        ('Before.<tool_call>{"name": "f", "arguments": {}}</tool_call>\nAfter.', "Before.\nAfter.", [("f", "{}")]),
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),
        ('<tool_call>{"nam', '<tool_call>{"nam', []),
        ("a < b and <tool", "a < b and <tool", []),
        # Qwen2.5-Coder's calls: a bare call object, or one in a Markdown block
        (' {"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
        ('```json\n{"name": "now", "arguments": {}}\n```', "", [("now", "{}")]),
        ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
        ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
         [("a", '{"x": 1}'), ("b", "{}")]),
        (f' {{"name": "note", "parameters": {NOTE}}}', "", [("note", NOTE)]),
        ('{"name": "now"}', "", [("now", "{}")]),
        ("The weather is nice.", "The weather is nice.", []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "a", "arguments": {"x": "y"}}, {"name": "b", "arguments": {}}]', "",
         [("a", '{"x": "y"}'), ("b", "{}")]),
        ('Sure. [TOOL_CALLS][{"name": "note", "arguments": ' + NOTE + "}]", "Sure.", [("note", NOTE)]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", '{"city": "Paris"}')]),
        ('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', "", [("a", '{"x": 1}'), ("b", "{}")]),
        ('[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"city": "Paris"}', "", [("get_weather",
                                                                                 '{"city": "Paris"}')]),
        ("No tools needed [here].", "No tools needed [here].", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3)]', "", [("get_weather", '{"city": "Paris", "days": 3}')]),
        ('[a(x=[1, {"k": "v)"}]), b()]', "", [("a", '{"x": [1, {"k": "v)"}]}'), ("b", "{}")]),
        ('[say(text="h\\u00e9llo \\"q\\" ☃")]', "", [("say", json.dumps({"text": 'héllo "q" ☃'},
                                                                         ensure_ascii=False))]),
        ("The answer is [1, 2].", "The answer is [1, 2].", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ('[f("positional")]', '[f("positional")]', []),
    ],
}
CASES = [(name, *case) for name, cases in CORPUS.items() for case in cases]


@pytest.mark.parametrize("fmt, reply, content, calls", CASES)
def test_a_whole_reply_gives_exactly_its_calls(fmt, reply, content, calls):
    found_content, found = parse(reply, FORMATS[fmt])
    assert found_content == content
    assert [(call.name, call.arguments) for call in found] == calls
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in found)


def streamed(reply: str, fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """What a stream of `pieces` sends, put together: the content, each call's name and arguments, and the pieces
    of content it sent."""
    stream, content, names, arguments = CallStream(FORMATS[fmt]), [], {}, {}
    for news in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
        content.append(news[0])
        for delta in news[1]:
            index = delta["index"]
            if "id" in delta:
                assert index == len(names) and delta["function"]["arguments"] == ""
                names[index] = delta["function"]["name"]
                arguments[index] = ""
            else:
                arguments[index] += delta["function"]["arguments"]
    return "".join(content), [(names[i], arguments[i]) for i in sorted(names)], content


@pytest.mark.parametrize("fmt, reply, content, calls", CASES)
def test_a_stream_split_anywhere_adds_up_to_the_whole_reply(fmt, reply, content, calls):
    for cut in range(len(reply) + 1):
        assert streamed(reply, fmt, [reply[:cut], reply[cut:]])[:2] == (content, calls), cut
    assert streamed(reply, fmt, list(reply))[:2] == (content, calls)


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_no_markup_goes_out_as_content_before_a_call(fmt):
    reply = {"hermes": 'Checking.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>',
             "mistral": 'Checking. [TOOL_CALLS][{"name": "f", "arguments": {}}]'}[fmt]
    sent = streamed(reply, fmt, list(reply))[2]
    assert "".join(sent) == "Checking." and not any("<" in piece or "[" in piece for piece in sent)


@pytest.mark.parametrize("fmt", ["llama3_json", "hermes"])
def test_a_reply_that_only_looks_like_a_call_is_content_unless_it_names_a_tool(fmt):
    reply = '{"name": "John", "parameters": {"age": 3}}'
    assert parse(reply, FORMATS[fmt], tools={"get_weather"}) == (reply, [])
    content, calls = parse(reply, FORMATS[fmt], tools={"John"})
    assert content == "" and [call.name for call in calls] == ["John"]


# Real templates, as llama.cpp's repository keeps them for its own tests (models/templates, vendored in
# llama-cpp-python 0.3.36's sdist), each from its model's Hugging Face repository
REAL_TEMPLATES = [("Qwen-Qwen2.5-7B-Instruct", "hermes", None), ("Qwen-Qwen3-0.6B", "hermes", "qwen3"),
                  ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes", None),
                  ("meta-llama-Llama-3.1-8B-Instruct", "llama3_json", None),
                  ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", None),
                  ("Mistral-Small-3.2-24B-Instruct-2506", "mistral", None),
                  ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", None, "qwen3")]


@pytest.mark.parametrize("template, fmt", [("qwen2.5-tools", "hermes"), ("llama3.1-tools", "llama3_json"),
                                           ("chatml", None), ("llama2", None),
                                           *((name, fmt) for name, fmt, _ in REAL_TEMPLATES)])
def test_the_format_is_found_in_the_chat_template(template, fmt):
    text = (REPO / f"tests/data/chat_templates/{template}.jinja").read_text()
    assert detect_format(text) is (FORMATS[fmt] if fmt else None)


@pytest.mark.parametrize("template, fmt, thinking", REAL_TEMPLATES, ids=[t[0] for t in REAL_TEMPLATES])
def test_a_real_templates_own_calls_read_back_as_the_calls(smollm2_checkpoint, template, fmt, thinking):
    """An assistant turn of calls (OpenAI's shape, content null), rendered by the family's real template with its
    tool's result after it, is read back by the format found in that template as the same call; the reasoning
    markers are found where the template writes them."""
    from accessory.generation.chat import render_chat
    from accessory.text.reasoning import REASONING_FORMATS, reasoning_format
    from accessory.text.tokenizer import Tokenizer

    path = REPO / f"tests/data/chat_templates/{template}.jinja"
    assert reasoning_format("auto", path.read_text()) is (REASONING_FORMATS[thinking] if thinking else None)
    if fmt is None:
        return
    tokenizer = Tokenizer(smollm2_checkpoint / "tokenizer.json")
    tokenizer.set_chat_template(path)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "abc123def", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    answered = [*asked, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abc123def", "name": "get_weather", "content": "21 C"}]
    before, _ = render_chat(tokenizer, asked, tools=tools)
    after, _ = render_chat(tokenizer, answered, tools=tools)
    assert after.startswith(before) and "21 C" in after
    _, calls = parse(after[len(before):], FORMATS[fmt], tools={"get_weather"})
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_markers_that_are_special_tokens_are_decoded(smollm2_checkpoint, tmp_path):
    """Mistral's "[TOOL_CALLS]" is a special token, which decoding drops like EOS; the reply's reader needs it, so
    decode keeps the markers of FORMATS and REASONING_FORMATS (here added to the built-in model's tokenizer as
    special tokens) and drops the others."""
    import tokenizers

    from accessory.text.tokenizer import Tokenizer

    tk = tokenizers.Tokenizer.from_file(str(smollm2_checkpoint / "tokenizer.json"))
    tk.add_special_tokens(["[TOOL_CALLS]", "<|python_tag|>", "[NOT_A_MARKER]"])
    tk.save(str(tmp_path / "tokenizer.json"))
    for side in ("tokenizer_config.json", "generation_config.json"):  # its EOS
        (tmp_path / side).write_bytes((smollm2_checkpoint / side).read_bytes())
    tokenizer = Tokenizer(tmp_path / "tokenizer.json")
    reply = '[TOOL_CALLS][{"name": "f", "arguments": {}}]'
    ids = tokenizer.encode(reply + "[NOT_A_MARKER]<|im_end|>", bos=False, eos=False)
    assert ids[0] == tk.token_to_id("[TOOL_CALLS]")
    assert tokenizer.decode(ids) == reply
    assert tokenizer.decode(tokenizer.encode("<|python_tag|>x", bos=False, eos=False)) == "<|python_tag|>x"
    content, calls = parse(tokenizer.decode(ids), FORMATS["mistral"])
    assert content == "" and [(call.name, call.arguments) for call in calls] == [("f", "{}")]
