"""Chat templates are untrusted code from checkpoints: accessory/text/template_sandbox.py bounds every value a
rendering builds, not only its output, and must still render real templates exactly as transformers does.

Oracles: transformers' own chat-template environment rendering the same template and conversation; for the
hostile templates, the refusal itself, observed in a process with 1 GiB of address space (a template that built
its gigabyte string would fail there with a MemoryError instead of filling the machine).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TESTS
from accessory.errors import TokenizerError
from accessory.text.template_sandbox import TEMPLATE_CHARS, template_environment
from accessory.text.tokenizer import Tokenizer

TEMPLATES = sorted((TESTS / "data" / "chat_templates").glob("*.jinja"))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.\nCall it once per city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": 'e.g. "Paris"'}},
                   "required": ["city"]}}}]
CHATS = {
    "one turn": [{"role": "user", "content": "What's the capital of France?"}],
    "system and turns": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
                         {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Bye"}],
    "tool call": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": '{"temp": 21}'}],
}


def render(text: str, limit: int = TEMPLATE_CHARS, **context) -> str:
    env = template_environment()
    with env.rendering(limit):
        return "".join(env.from_string(text).generate(**context))


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_templates_render_as_transformers_renders_them(path, chat):
    """ChatML, Llama-2, Gemma, Qwen2.5 and Llama-3.1 with tools, and a template using every bounded operation
    (`~`, `+`, `%`, format, the padding, joining and replacing methods and filters, tojson with an indent, blocks
    and macros): the bounds change no text."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    text = path.read_text()
    for add_generation_prompt in (True, False):
        context = dict(messages=CHATS[chat], add_generation_prompt=add_generation_prompt, bos_token="<s>",
                       eos_token="</s>", tools=TOOLS if chat == "tool call" else None)
        try:
            expected = _compile_jinja_template(text).render(**context)
        except Exception as e:  # raise_exception: Llama-2 and Gemma refuse a tool message
            with pytest.raises(type(e), match=str(e)):
                render(text, **context)
        else:
            assert render(text, **context) == expected


# the probe's three (issue 20), then every other way to build a large value in one step or a few
HOSTILE = {
    "~ doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "str.center": "{{ 'x'.center(10**9) }}",
    "% width": "{{ '%0999999999d' % 1 }}",
    "+ doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list + doubling": "{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}",
    "* repetition": "{{ 'x' * 10**10 }}",
    "list repetition": "{% set s = 'x' * 50000 %}{{ [s] * 50000 }}",
    "** power": "{{ 2 ** 1000000 }}",
    "int squaring": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "% precision": "{{ '%.999999999f' % 1.0 }}",
    "% width from *": "{{ '%*d' % (10**9, 1) }}",
    "% mapping": "{{ '%(a)999999999s' % {'a': 1} }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "str.format precision": "{{ '{:.999999999f}'.format(1.0) }}",
    "str.format nested width": "{{ '{:>{}}'.format(1, 10**9) }}",
    "str.format_map": "{{ '{a:>999999999}'.format_map({'a': 1}) }}",
    "str.ljust": "{{ 'x'.ljust(10**9) }}",
    "str.rjust": "{{ 'x'.rjust(10**9) }}",
    "str.zfill": "{{ 'x'.zfill(10**9) }}",
    "str.expandtabs": "{{ ('\t' * 1000).expandtabs(10**7) }}",
    "str.replace": "{% set s = 'x' * 50000 %}{{ s.replace('x', s) }}",
    "str.translate": "{% set s = 'x' * 50000 %}{{ s.translate({120: s}) }}",
    "str.join": "{% set s = 'x' * 50000 %}{{ s.join(range(50000)|map('string')) }}",
    "bytes.center": "{{ 'x'.encode().center(10**9) }}",
    "int.to_bytes": "{{ (1).to_bytes(10**9, 'big') }}",
    "center filter": "{{ 'x'|center(1000000000) }}",
    "format filter": "{{ '%0999999999d'|format(1) }}",
    "indent filter": "{{ 'a\nb'|indent(10**9) }}",
    "replace filter": "{% set s = 'x' * 50000 %}{{ s|replace('x', s) }}",
    "join filter": "{% set s = 'x' * 50000 %}{{ range(50000)|map('string')|join(s) }}",
    "wordwrap filter": "{% set s = 'x ' * 40000 %}{{ s|wordwrap(1, wrapstring=s) }}",
    "batch filter": "{{ [1]|batch(10**9, 'x')|list }}",
    "slice filter": "{{ [1]|slice(10**9)|list }}",
    "tojson indent": "{{ [[[[1]]]]|tojson(indent=10**9) }}",
    # a list of itself twice, forty times: 2**40 items as text, from a few bytes of references
    "nested list written": "{% set ns = namespace(l=1) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                           "{% endfor %}{{ ns.l }}",
    "nested list string": "{% set ns = namespace(l=1) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                          "{% endfor %}{{ ns.l|string|length }}",
    "nested list tojson": "{% set ns = namespace(l=1) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                          "{% endfor %}{{ ns.l|tojson|length }}",
    "nested list ~": "{% set ns = namespace(l=1) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                     "{% endfor %}{{ (ns.l ~ '')|length }}",
    "macro output": "{% set s = 'x' * 50000 %}{% macro m() %}{% for i in range(50000) %}{{ s }}{% endfor %}"
                    "{% endmacro %}{{ m()|length }}",
    "set block": "{% set s = 'x' * 50000 %}{% set t %}{% for i in range(50000) %}{{ s }}{% endfor %}{% endset %}",
    "filter block": "{% set s = 'x' * 50000 %}{% filter length %}{% for i in range(50000) %}{{ s }}{% endfor %}"
                    "{% endfilter %}",
}
CONFINED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from accessory.text.template_sandbox import template_environment
outcomes = {}
for name, text in json.load(sys.stdin).items():
    env = template_environment()
    try:
        with env.rendering(1000):
            "".join(env.from_string(text).generate())
        outcomes[name] = "rendered"
    except Exception as e:
        outcomes[name] = f"{type(e).__name__}: {e}"
print(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def hostile_outcomes() -> dict:
    result = subprocess.run([sys.executable, "-c", CONFINED], input=json.dumps(HOSTILE), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", HOSTILE)
def test_a_template_cannot_build_a_large_value_even_briefly(name, hostile_outcomes):
    """The probe's templates built gigabyte strings in-process (a MemoryError at 5 GB) before the bound on the
    output applied: each operation is now refused, before it builds anything, once its result would pass the
    rendering's limit (here 100,000 characters)."""
    assert hostile_outcomes[name].startswith("SecurityError: "), hostile_outcomes[name]
    assert "would pass 100000 characters" in hostile_outcomes[name] or "too large" in hostile_outcomes[name]


def test_helpers_that_no_template_uses_are_left_out():
    for text in ("{{ lipsum(10**6) }}", "{{ [1]|pprint }}", "{{ 'a.com'|urlize }}"):
        with pytest.raises(Exception, match="lipsum|pprint|urlize"):
            render(text)


def test_the_limit_is_the_renderings_so_long_messages_still_render():
    """A value may be as large as what the rendering may write: a 300,000-character message is three times
    TEMPLATE_CHARS, and every operation on it renders."""
    content = "word " * 60_000
    messages = [{"role": "user", "content": content}]
    text = ("{% set m = messages[0].content %}{{ (m ~ '!')|length }} {{ (m + '!')|length }} "
            "{{ ('%s!' % m)|length }} {{ '{}!'.format(m)|length }} {{ m.replace(' ', '_')|length }} "
            "{{ m|center(300010)|length }} {{ messages|tojson|length }}")
    limit = len(content) + TEMPLATE_CHARS
    assert render(text, limit, messages=messages).split() == [
        "300001", "300001", "300001", "300001", "300000", "300010", str(len(json.dumps(messages)))]
    with pytest.raises(Exception, match="would pass"):
        render("{{ messages[0].content * 2 }}", limit, messages=messages)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_refused_template_is_named_by_file_and_key(where, tmp_path, llama_tokenizer):
    """At the tokenizer (and so as a 400 at the server): the refusal names the template's file, and for
    tokenizer_config.json its key."""
    template = "{{ messages[0].content.center(10**7) }}"  # 10 MB if the bound were gone: the test fails, no more
    (tmp_path / "tokenizer.model").write_bytes(llama_tokenizer.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    if where == "chat_template.jinja":
        (tmp_path / where).write_text(template)
    with pytest.raises(TokenizerError) as refused:
        Tokenizer.from_path(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    named = "the chat_template of " if where == "tokenizer_config.json" else "the chat template "
    assert f"{named}{tmp_path / where} rejected the messages: str.center would pass" in str(refused.value)


def test_a_template_failing_in_any_way_is_a_refusal(tmp_path, llama_tokenizer):
    """A TypeError or ZeroDivisionError inside a template is the template rejecting the messages (a 400 at the
    server), never an exception from deep inside jinja2; a message it raises is quoted clipped."""
    (tmp_path / "tokenizer.model").write_bytes(llama_tokenizer.read_bytes())
    for template, reason in [("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ '%d' % 'x' }}", "TypeError"),
                             ("{{ raise_exception('no' * 50000) }}", r"nono\.\.\. \(100000 characters\)$")]:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        with pytest.raises(TokenizerError, match=reason):
            Tokenizer.from_path(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
