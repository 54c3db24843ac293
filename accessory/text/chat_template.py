"""A model's chat template: read from chat_template.jinja or tokenizer_config.json (or a file the user names),
compiled in the bounded sandbox of template_sandbox.py, and rendered with its output bounded too. `ChatPrompt` is a
rendered conversation that remembers where the messages' text is, so that only the template writes control tokens.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional, Union

import jinja2

from accessory.errors import TokenizerError
from accessory.text.template_sandbox import template_environment


def load_chat_template(folder: Path, config: dict) -> tuple[Optional[jinja2.Template], str, str]:
    """(the template, where it was read, its text): chat_template.jinja if present (newer HF saves; it takes
    priority, as in transformers), else the tokenizer_config.json `chat_template`: a string, or HF's [{"name",
    "template"}] list whose "default" is used."""
    jinja_path, source = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    template = config.get("chat_template")
    if jinja_path.is_file():
        template, source = jinja_path.read_text(encoding="utf-8"), jinja_path
    elif isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(f"{source}: chat_template lists templates {sorted(map(str, named))} but none is "
                                 f"named 'default'")
        template = named["default"]
    if template is None:
        return None, f"{source}: no chat_template", ""
    if not isinstance(template, str):
        raise TokenizerError(f"{source}: chat_template must be a string or a list of {{name, template}}, got "
                             f"{type(template).__name__}")
    name = f"the chat template {jinja_path}" if source == jinja_path else f"the chat_template of {source}"
    return _compile_template(template, source), name, template


def read_chat_template(path: Union[str, Path]) -> tuple[jinja2.Template, str]:
    """The Jinja chat template file at `path` (Hugging Face's format: `messages`, `add_generation_prompt`,
    `bos_token`, `eos_token`), compiled, and its text; a TokenizerError naming the file if it cannot be read or
    compiled."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"chat template {path}: cannot be read ({e})") from e
    return _compile_template(text, path), text


def _compile_template(text: str, source) -> jinja2.Template:
    try:
        return template_environment().from_string(text)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{source}: chat template is not a valid Jinja template: {e}") from e


def render_chat_template(template: jinja2.Template, name: str, variables: dict, limit: int) -> str:
    """`template` rendered with `variables`, no value it builds and not its output passing `limit` characters;
    any failure of the template a TokenizerError naming it (`name`: where it was read)."""
    pieces, size = [], 0
    try:
        with template.environment.rendering(limit):
            for piece in template.generate(**variables):
                size += len(piece)
                if size > limit:
                    raise jinja2.TemplateError(f"its output passed {limit} characters")
                pieces.append(piece)
        return "".join(pieces)
    except Exception as e:  # the template's own failure, whatever it is (a TypeError, a macro that recurses)
        reason = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
        raise TokenizerError(f"{name} rejected the messages: {_clip(reason)}") from e


def _clip(text: str, limit: int = 500) -> str:
    """A template's error message, which it may make as long as it likes (raise_exception)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ChatPrompt(str):
    """A rendered conversation whose `contents`, (start, end) spans of the messages' text, `Tokenizer.encode`
    reads as plain text: only the template writes control tokens. Slicing or adding gives a plain str."""
    contents: tuple[tuple[int, int], ...] = ()

    def __new__(cls, text: str, contents: tuple[tuple[int, int], ...]):
        prompt = super().__new__(cls, text)
        prompt.contents = contents
        return prompt

    def __reduce__(self):  # sent between ranks as it is
        return ChatPrompt, (str(self), self.contents)


def render_with_literal_contents(render: Callable[[list[dict]], str], messages: list[dict],
                                 specials: frozenset[str], template_name: str) -> str:
    """`render(messages)`, as a ChatPrompt when a message holds one of `specials` (the text of a special token), so
    that it is encoded as text; `template_name`, in the error when the contents cannot be found in the text."""
    text = render(messages)
    if not any(t in str(m.get("content", "")) for m in messages for t in specials):
        return text
    # Render again with a marker for each message's content, to find where the contents are in the text.
    marked = render([{**m, "content": f"\x00ACCESSORY-CONTENT-{i}\x00"} for i, m in enumerate(messages)])
    parts = re.split("\x00ACCESSORY-CONTENT-([0-9]+)\x00", marked)  # text, message index, text, ...
    for transform in (lambda c: c, str.strip):  # verbatim, or trimmed as Llama-3's template does
        pieces, spans, at = [], [], 0
        for k, part in enumerate(parts):
            piece = transform(str(messages[int(part)]["content"])) if k % 2 else part
            if k % 2:
                spans.append((at, at + len(piece)))
            pieces.append(piece)
            at += len(piece)
        if "".join(pieces) == text:
            return ChatPrompt(text, tuple(spans))
    raise TokenizerError(f"a message holds the text of a special token ({sorted(specials)}), and "
                         f"{template_name} changes the messages it writes, so that text cannot "
                         f"be kept apart from the template's")
