"""Tool calls in a model's reply, read back as OpenAI's `tool_calls`: what a model trained for tools writes when it
calls one, in the format its chat template taught it.

Each format is a small declarative entry (`CallFormat`): the text that opens the calls, how a call is written (a
JSON object holding the name and the arguments, a JSON list of such objects, or Python calls), what closes a call,
and whether calls may only be the whole reply. FORMATS holds them under vLLM's parser names:
- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call;
- llama3_json (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or
  not, several joined by ";";
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` a call;
- pythonic (Llama 4 and others): the whole reply is `[f(a=1), g()]`.

A call's arguments are the JSON text the model wrote, as it wrote it (a JSON string holding JSON is unwrapped), so
the pieces a stream sends add up to the whole reply's arguments byte for byte; a call without arguments has "{}";
Python calls' arguments are written as JSON when the call closes. `parse` reads a whole reply and `CallStream` one
in pieces, through the same scan (`scan`), which on a reply's prefix holds back whatever may still turn out to be
markup (the start of "<tool_call>", a reply that begins as a call may), so a stream never takes back what it sent.
A block that opens as a call but is not one (no name where the name goes) stays in the content, markup and all.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Collection, Optional

OBJECT, LIST, PYTHON = "object", "list", "python"


@dataclass(frozen=True)
class CallFormat:
    """How a family writes tool calls. `start`: the text that opens them (optional before a whole reply's calls);
    `end`: the text that closes each call; `body`: OBJECT (one JSON object a call, `separator` between several), LIST
    (a JSON list of call objects) or PYTHON (a list of Python calls); `whole`: calls only as the whole reply;
    `argument_keys`: the call object's keys that may hold the arguments; `named`: a call may also be written as its
    name, this text, then the arguments (Mistral's "[ARGS]"), with between them, after `named_id`, the call's id
    (Mistral Small 3.2's "[CALL_ID]"); `bare`: a reply that is nothing but a call object
    naming one of the request's tools, bare or in a ```json block, is a call too (Qwen2.5-Coder writes its calls
    so, though its template asks for `start`)."""
    name: str
    start: str = ""
    end: str = ""
    body: str = OBJECT
    separator: str = ""
    whole: bool = False
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    named: str = ""
    named_id: str = ""
    bare: bool = False


FORMATS = {fmt.name: fmt for fmt in (
    CallFormat("hermes", start="<tool_call>", end="</tool_call>", bare=True),
    CallFormat("llama3_json", start="<|python_tag|>", separator=";", whole=True,
               argument_keys=("parameters", "arguments")),
    CallFormat("mistral", start="[TOOL_CALLS]", body=LIST, named="[ARGS]", named_id="[CALL_ID]"),
    CallFormat("pythonic", body=PYTHON, whole=True),
)}


# The markup each format's chat templates write (llama.cpp tells formats apart the same way), in the order tried
DETECTED_BY = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
               ('"parameters": ', "llama3_json"), ("[func_name1(", "pythonic"))


def detect_format(template: str) -> Optional[CallFormat]:
    """The tool-call format a chat template's text teaches, or None if it names none of FORMATS'."""
    return next((FORMATS[name] for marker, name in DETECTED_BY if marker in template), None)


def call_format(parser: str, template: str) -> Optional[CallFormat]:
    """--tool-call-parser's format: one of FORMATS by name, or for "auto" the chat template's (`detect_format`)."""
    return detect_format(template) if parser == "auto" else FORMATS[parser]


JSON_CALLS = CallFormat("json", body=LIST, whole=True)  # required calls where a model's own format has no grammar


def forced_format(fmt: Optional[CallFormat]) -> CallFormat:
    """The format a required or named call is written in: the model's own, or where that is Python calls or
    unknown, a JSON list of call objects (JSON_CALLS)."""
    return fmt if fmt is not None and fmt.body != PYTHON else JSON_CALLS


def call_grammar(fmt: CallFormat, tools: list[dict], parallel: bool, json_options: dict) -> str:
    """A Lark grammar (llguidance's) for a reply that is nothing but calls of `tools` (OpenAI's definitions) in
    `fmt`: one call, or with `parallel` one or more, each call's arguments valid against its tool's parameters
    schema (JSON written as `json_options` say). `fmt` must not be PYTHON (`forced_format`)."""
    rules = _call_rules(fmt, tools, json_options)
    if fmt.body == LIST:
        calls = f'{json.dumps(fmt.start + "[")} call' + (' (", " call)*' if parallel else "") + ' "]"'
    elif fmt.end:  # a block a call, each on a line of its own
        calls = "block" + (f' ({json.dumps(chr(10))} block)*' if parallel else "")
        rules.append(f'block: {json.dumps(fmt.start)} {_BLOCK_BODY.format(json.dumps(chr(10) + fmt.end))}')
    else:
        calls = "call" + _more_calls(fmt, parallel)
    return "\n".join([f"start: {calls}", *rules])


def held_calls_grammar(fmt: CallFormat, tools: list[dict], parallel: bool, json_options: dict) -> str:
    """A Lark grammar for a reply of free text whose calls, once one opens (`fmt.start`, written lazily: the text
    ends at its first occurrence), are held to `fmt`'s markup: the arguments of the tools marked `strict` to their
    schema, the others' to any object. `fmt` must have an opening marker."""
    lax = {"type": "object", "additionalProperties": True}
    held = [tool if tool["function"].get("strict") is True else
            {**tool, "function": {**tool["function"], "parameters": lax}} for tool in tools]
    rules = [*_call_rules(fmt, held, json_options), f"opening[lazy]: TEXT {json.dumps(fmt.start)}",
             r"TEXT: /(.|\n)*/"]
    if fmt.end:
        rules.append(f"block: opening {_BLOCK_BODY.format(json.dumps(chr(10) + fmt.end))}")
        calls = ("block*" if parallel else "block?") + " TEXT"
    elif fmt.body == LIST:
        calls = 'TEXT | opening "[" call' + (' (", " call)*' if parallel else "") + ' "]"'
    else:
        calls = "TEXT | opening call" + _more_calls(fmt, parallel)
    return "\n".join([f"start: {calls}", *rules])


_BLOCK_BODY = '"\\n" call {}'  # a block's call on a line of its own, then the closing marker


def _call_rules(fmt: CallFormat, tools: list[dict], json_options: dict) -> list[str]:
    key = fmt.argument_keys[0]
    return ["call: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
            *(f"tool_{i}: %json {json.dumps({**call_schema(tool, key), 'x-guidance': json_options})}"
              for i, tool in enumerate(tools))]


def _more_calls(fmt: CallFormat, parallel: bool) -> str:
    return f' ({json.dumps(fmt.separator + " ")} call)*' if parallel and fmt.separator else ""


def call_schema(tool: dict, key: str) -> dict:
    """The JSON schema of one call of `tool`: its name, then its arguments under `key`, which hold only the
    parameters it declares unless its schema says otherwise (`additionalProperties`)."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        parameters = {**parameters, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
            "required": ["name", key], "additionalProperties": False}


@dataclass(frozen=True)
class ToolReading:
    """How a chat reply is read for tool calls: their format, the request's tools' names, and whether a reply may
    make several calls (parallel_tool_calls; if not, only its first is kept)."""
    format: CallFormat
    tools: frozenset
    parallel: bool = True


@dataclass
class Call:
    """One call as scanned so far: its name (None until the whole name is read), and its arguments' text so far."""
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class Scanned:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    """An id in OpenAI's form: "call_" and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


def parse(text: str, fmt: CallFormat, tools: Optional[Collection[str]] = None) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls. `tools`: the names of the request's tools; a reply that is only calls
    (`fmt.whole`) is read as calls only if its first call names one of them."""
    scanned = scan(text, fmt, final=True, tools=tools)
    return scanned.content, [ToolCall(call_id(), call.name, call.arguments) for call in scanned.calls]


class CallStream:
    """A reply read in pieces: `feed` each piece of text, then `finish`; each returns the content to send now and
    OpenAI's tool-call deltas (a call's index, id and name first, then its arguments in pieces)."""

    def __init__(self, fmt: CallFormat, tools: Optional[Collection[str]] = None):
        self.fmt, self.tools, self.text, self.memo = fmt, tools, "", {}
        self.content_sent = 0
        self.sent: list[tuple[str, int]] = []  # each call begun: its id, and how much of its arguments went out

    @property
    def call_count(self) -> int:
        return len(self.sent)  # calls begun

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        return self._news(scan(self.text, self.fmt, final=False, tools=self.tools, memo=self.memo))

    def finish(self) -> tuple[str, list[dict]]:
        return self._news(scan(self.text, self.fmt, final=True, tools=self.tools, memo=self.memo))

    def _news(self, scanned: Scanned) -> tuple[str, list[dict]]:
        content = scanned.content[self.content_sent:]
        self.content_sent = len(scanned.content)
        deltas = []
        for index, call in enumerate(scanned.calls):
            if call.name is None:
                break
            if index == len(self.sent):
                self.sent.append((call_id(), 0))
                deltas.append({"index": index, "id": self.sent[index][0], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            done = self.sent[index][1]
            if len(call.arguments) > done:
                deltas.append({"index": index, "function": {"arguments": call.arguments[done:]}})
                self.sent[index] = (self.sent[index][0], len(call.arguments))
        return content, deltas


# ---- the scan --------------------------------------------------------------------------------------------------

@dataclass
class _Scan:
    """One scan's settings and findings: the format, whether the text is the whole reply, the calls found, and a
    stream's memo of how far each JSON value was read (its start -> where the reading stopped, its depth, whether
    inside a string), so that a stream reads each character of a long value once."""
    fmt: CallFormat
    final: bool
    calls: list = field(default_factory=list)
    memo: Optional[dict] = None


class _Incomplete(Exception):
    """The text ends before the scan could decide."""


class _NotACall(Exception):
    """The text is not a call where a call was to be."""


def scan(text: str, fmt: CallFormat, final: bool, tools: Optional[Collection[str]] = None,
         memo: Optional[dict] = None) -> Scanned:
    """The content and calls of `text`, a whole reply (`final`) or its prefix so far; on a prefix, the content
    leaves out what may still become markup (and blank space a call may follow), and a call's arguments are what is
    certain of them. A reply cut short inside a call keeps the call as far as it goes. `memo`: a stream's, kept
    between the scans of its growing text."""
    if fmt.whole:
        return _scan_whole(text, _Scan(fmt, final, memo=memo), tools)
    bare = _scan_bare(text, final, tools, None if memo is None else memo.setdefault("bare", {})) if fmt.bare else None
    if bare is not None:
        return bare
    out, pos = Scanned(), 0
    while True:
        found = text.find(fmt.start, pos)
        if found < 0:
            rest = text[pos:] if final else text[pos:len(text) - held_marker(text[pos:], fmt.start)]
            _add(out, rest if final and not out.calls else rest.rstrip())
            return out
        _add(out, text[pos:found].rstrip())
        before = len(out.calls)
        try:
            pos = _block(text, found + len(fmt.start), _Scan(fmt, final, out.calls, memo))
            continue
        except _Incomplete:
            if not final or _named_first(out.calls, before):
                _drop_unnamed(out.calls)
                return out
            end = -1  # a reply cut short before a call's name: the block is text
        except _NotACall:
            if _named_first(out.calls, before):  # what follows the block's good calls is dropped
                _drop_unnamed(out.calls)
                end = text.find(fmt.end, found) if fmt.end else -1
                if end < 0:
                    return out
                pos = end + len(fmt.end)
                continue
            end = text.find(fmt.end, found) if fmt.end else -1
            if end < 0 and not final:
                return out  # not a call: the block goes out as text once it has ended
        del out.calls[before:]
        out.content += text[found:] if end < 0 else text[found:end + len(fmt.end)]
        if end < 0:
            return out
        pos = end + len(fmt.end)


def _add(out: Scanned, text: str) -> None:
    """Content outside calls: after a call without the blank space next to it, a new line between it and what
    came before."""
    if out.calls:
        text = text.lstrip()
        if text and out.content:
            text = "\n" + text
    out.content += text


def _named_first(calls: list, before: int) -> bool:
    return len(calls) > before and calls[before].name is not None


def _drop_unnamed(calls: list) -> None:
    while calls and calls[-1].name is None:
        calls.pop()


def held_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker` (held back: they may be its start)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _block(text: str, i: int, s: _Scan) -> int:
    """Scan the calls after one `start` marker at i into `s.calls`; where the text after them goes on."""
    if s.fmt.body == LIST:
        i = _skip(text, i)
        return _named(text, i, s) if text[i] != "[" and s.fmt.named else _list(text, i, s)
    i = _objects(text, i, s)
    if s.fmt.end:
        end = text.find(s.fmt.end, i)
        if end < 0:
            raise _Incomplete
        return end + len(s.fmt.end)
    return i


BARE_CALLS = CallFormat("bare", whole=True)  # a `bare` format's reply that is one call object
_FENCE = re.compile(r"```(?:json)?[ \t]*\n")  # a Markdown code block's opening line


def _scan_bare(text: str, final: bool, tools: Optional[Collection[str]], memo: Optional[dict]) -> Optional[Scanned]:
    """A reply that is a call object and nothing else, bare or in a ```json block, read as BARE_CALLS; None where
    it is not (or is blank so far: the markup scan holds blank space back); on an undecided prefix, nothing yet."""
    body = text.lstrip()
    if not body:
        return None
    if body.startswith("`"):
        fence = _FENCE.match(body)
        if fence is None:
            undecided = not final and "\n" not in body and re.fullmatch(r"`{1,3}(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*", body)
            return Scanned() if undecided else None
        body = body[fence.end():]  # the closing fence follows the call: dropped with what follows it
    scanned = _scan_whole(body, _Scan(BARE_CALLS, final, memo=memo), tools)
    return scanned if scanned.calls or not (scanned.content or final) else None


def _scan_whole(text: str, s: _Scan, tools: Optional[Collection[str]]) -> Scanned:
    """A reply that is either calls and nothing else (what follows them is dropped), or content."""
    fmt, final, calls = s.fmt, s.final, s.calls
    i = len(text) - len(text.lstrip())
    if fmt.start and text.startswith(fmt.start, i):
        i += len(fmt.start)
    elif not final and fmt.start.startswith(text[i:]):
        return Scanned()  # blank, or the start of the marker: undecided
    try:
        i = _skip(text, i)
        if text[i] != ("{" if fmt.body == OBJECT else "["):
            raise _NotACall
        if fmt.body == PYTHON:
            _list(text, i, s, _python_call)
        elif fmt.body == LIST:
            _list(text, i, s)
        else:
            _objects(text, i, s)
    except _Incomplete:
        if not calls or calls[0].name is None:
            return Scanned(text if final else "")
    except _NotACall:
        if not calls or calls[0].name is None:
            return Scanned(text)
    if tools is not None and calls[0].name not in tools:
        return Scanned(text)  # a JSON reply, not a call of a tool the request has
    _drop_unnamed(calls)
    return Scanned("", calls)


# ---- JSON call objects -----------------------------------------------------------------------------------------

_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*', re.S)  # a string's characters up to its closing quote
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r'[\s,}\]]')


def _skip(text: str, i: int) -> int:
    """The first non-blank position from i; _Incomplete if the text ends first."""
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text):
        raise _Incomplete
    return i


def _value_end(text: str, i: int, s: _Scan) -> Optional[int]:
    """Where the JSON value at i ends (strings and brackets matched, nothing else checked), or None if the text
    ends first (a stream's scan then notes in `s.memo` how far it read, and the next one goes on from there)."""
    if text[i] not in '"{[':
        match = _SCALAR_END.search(text, i)
        return match.start() if match else (len(text) if s.final else None)
    j, depth, in_string = s.memo.get(i, (i, 0, False)) if s.memo is not None else (i, 0, False)
    while True:
        if in_string:
            j = _STRING_REST.match(text, j).end()
            if j == len(text) or text[j] != '"':  # the text ends inside the string (or inside an escape)
                break
            j, in_string = j + 1, False
        else:
            match = _STRUCTURE.search(text, j)
            if match is None:
                j = len(text)
                break
            j = match.end()
            if match.group() == '"':
                in_string = True
                continue
            depth += 1 if match.group() in "{[" else -1
        if depth == 0:
            return j
    if s.memo is not None:
        s.memo[i] = (j, depth, in_string)
    return None


def _object(text: str, i: int, s: _Scan) -> int:
    """Scan one call object at i (after blank space) into `s.calls`; where it ends."""
    i = _skip(text, i)
    if text[i] != "{":
        raise _NotACall
    call = Call()
    s.calls.append(call)
    arguments = None  # (start, end) of the arguments' value
    i += 1
    while True:
        i = _skip(text, i)
        if text[i] == "}":
            break
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            raise _NotACall
        key_end = _value_end(text, i, s)
        if key_end is None:
            raise _Incomplete
        key = _json(text[i:key_end])
        i = _skip(text, key_end)
        if text[i] != ":":
            raise _NotACall
        i = _skip(text, i + 1)
        end = _value_end(text, i, s)
        if key == "name":
            if end is None:
                raise _Incomplete
            name = _json(text[i:end]) if text[i] == '"' else None
            if not isinstance(name, str) or not name:
                raise _NotACall
            call.name = name
        elif key in s.fmt.argument_keys:
            arguments = (i, end)
        if call.name is not None and arguments is not None:
            call.arguments = _arguments(text, *arguments)
        if end is None:
            raise _Incomplete
        i = end
    if call.name is None:
        raise _NotACall
    if arguments is None:
        call.arguments = "{}"
    return i + 1


def _arguments(text: str, start: int, end: Optional[int]) -> str:
    """The arguments' JSON text: the value as written (what of it there is so far), a JSON string's content once
    whole, "{}" for null."""
    value = text[start:end] if end is not None else text[start:]
    if value[:1] in "{[":
        return value
    if end is None:
        return ""
    if value == "null":
        return "{}"
    if value[:1] == '"':
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise _NotACall from None


def _objects(text: str, i: int, s: _Scan) -> int:
    """Call objects at i, `s.fmt.separator` between them; where the last ends."""
    while True:
        i = _object(text, i, s)
        j = i
        while j < len(text) and text[j].isspace():
            j += 1
        if not s.fmt.separator or not text.startswith(s.fmt.separator, j):
            return i
        i = j + len(s.fmt.separator)


def _list(text: str, i: int, s: _Scan, item=None) -> int:
    """A list of calls at i, each read by `item` (default: a JSON call object); where the list ends."""
    if text[i] != "[":
        raise _NotACall
    i += 1
    while True:
        i = _skip(text, i)
        if text[i] == "]":
            return i + 1
        if text[i] == "," and s.calls:
            i += 1
            continue
        i = (item or _object)(text, i, s)


_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


_CALL_ID = re.compile(r"[A-Za-z0-9_-]*")


def _named(text: str, i: int, s: _Scan) -> int:
    """`name` + s.fmt.named + arguments at i (Mistral's newer form); where the arguments end."""
    match = _NAME.match(text, i)
    if match is None:
        raise _NotACall
    after = match.end()
    if s.fmt.named_id and text.startswith(s.fmt.named_id, after):  # the call's id, which the reply does not need
        after = _CALL_ID.match(text, after + len(s.fmt.named_id)).end()
    if not text.startswith(s.fmt.named, after):
        if s.fmt.named.startswith(text[after:]) or s.fmt.named_id.startswith(text[after:]):
            raise _Incomplete
        raise _NotACall
    call = Call(match.group())
    s.calls.append(call)
    start = _skip(text, after + len(s.fmt.named))
    end = _value_end(text, start, s)
    call.arguments = _arguments(text, start, end)
    if end is None:
        raise _Incomplete
    return end


# ---- Python calls ----------------------------------------------------------------------------------------------

_PY_TOKEN = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[()\[\]{}]|['"]""", re.S)


def _python_call(text: str, i: int, s: _Scan) -> int:
    """One Python call `f(a=1)` at i, whole, its keyword arguments literals written as JSON; where it ends."""
    match = _NAME.match(text, i)
    if match is None:
        raise _NotACall
    j = _skip(text, match.end())
    if text[j] != "(":
        raise _NotACall
    end = _python_close(text, j)
    if end is None:
        raise _Incomplete
    s.calls.append(Call(match.group(), _python_arguments(text[i:end])))
    return end


def _python_close(text: str, i: int) -> Optional[int]:
    """Where the bracket at i closes (quotes and nesting followed), or None if the text ends first."""
    depth = 0
    for match in _PY_TOKEN.finditer(text, i):
        token = match.group()
        if token in ("'", '"'):
            return None  # a string the text has not closed yet
        if token in "([{":
            depth += 1
        elif token in ")]}":
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def _python_arguments(call: str) -> str:
    try:
        node = ast.parse(call, mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise _NotACall
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in node.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        raise _NotACall from None
