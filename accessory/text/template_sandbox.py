"""The environment chat templates render in: transformers' (jinja2's immutable sandbox, HF's whitespace rules,
{% break %}, a tojson that keeps non-ASCII, raise_exception, strftime_now), bounded in size.

A chat template comes with a checkpoint: it is untrusted code. Jinja's sandbox keeps it from Python's internals,
but not from building a gigabyte string in one step (`'x'.center(10**9)`, `'%0999999999d' % 1`) or a few
(`{% set ns.s = ns.s ~ ns.s %}` in a loop), and a bound on the output comes too late for that. Here every operation
that can make a value larger than its operands checks the size of its result before building it, against the limit
of the rendering (`rendering(limit)`, which apply_chat_template sets to what it may write: the messages' text plus
TEMPLATE_CHARS a message): `~`, `+`, `*`, `%` and `**`; the str and bytes methods that pad, repeat, join or format
(`center`, `ljust`, `rjust`, `zfill`, `expandtabs`, `replace`, `translate`, `join`, `format`, `format_map`) and
int.to_bytes; the filters that do the same (`center`, `indent`, `format`, `join`, `replace`, `wordwrap`, `batch`,
`slice`, `string`, `tojson`); a value written out (`{{ list }}` is its repr); and the text a block, macro or
`{% set %}` collects. Ranges hold TEMPLATE_CHARS items in all per rendering. `lipsum`, `pprint` and `urlize`,
which no chat template uses, are left out rather than bounded. Other operations make values at most a few times
larger than their operands, so they are bounded through them.
"""
from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from contextlib import contextmanager
from datetime import datetime
from functools import update_wrapper

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.sandbox
from jinja2.utils import Namespace
from markupsafe import Markup

TEMPLATE_CHARS = 100_000  # what a chat template may write per message beyond its content (real ones: < 1,000)
INT_BITS = 4096  # the largest integer `*` and `**` may make (a number a template needs has a few digits)
SCALAR_CHARS = 24  # the longest text of a float, a bool or None: -1.2345678901234567e-308
CONTAINER_CHARS = 16  # a container's text beside its items': "dict_values([])", "<Namespace {}>"
OBJECT_CHARS = 100  # the text of any other object: a default repr, `<generator object ... at 0x...>`
LEFT_OUT = ("lipsum", "pprint", "urlize")


class _TooLarge(Exception):
    pass


def text_size(value, limit: int, quoted: bool = False, indent: int = 0, separator: int = 2) -> int:
    """An upper bound of the length of `value`'s text, counted up to `limit` + 1: str(value), or its repr when
    `quoted` (how a list writes the strings in it), with `separator` characters beside each item of a container
    and, with `indent`, a new line and `indent` characters a level before each (JSON's layout). A container seen
    twice (a list made of one list many times) is measured once."""
    total, measured, open_containers = 0, {}, set()

    def add(n: int) -> None:
        nonlocal total
        total += n
        if total > limit:
            raise _TooLarge

    def visit(v, quoted: bool, depth: int) -> None:
        if isinstance(v, str):
            return add(_string_size(v) if quoted else len(v))
        if isinstance(v, bytes):
            return add(4 * len(v) + 3)  # b'\x00...'
        if isinstance(v, int) and not isinstance(v, bool):
            return add(v.bit_length() // 3 + 2)
        if isinstance(v, (bool, float, type(None))):
            return add(SCALAR_CHARS)
        if isinstance(v, jinja2.Undefined):
            return None
        items = _items(v)
        if items is None:
            return add(OBJECT_CHARS)
        if id(v) in measured:
            return add(measured[id(v)])
        if id(v) in open_containers:  # a namespace that holds itself: repr writes "{...}"
            return add(5)
        start = total
        open_containers.add(id(v))
        add(CONTAINER_CHARS + (1 + indent * depth if indent else 0))
        for item in items:
            add(separator + (1 + indent * (depth + 1) if indent else 0))
            visit(item, True, depth + 1)
        open_containers.discard(id(v))
        if not indent:  # with an indent, a container's text depends on its depth
            measured[id(v)] = total - start

    try:
        visit(value, quoted, 0)
    except _TooLarge:
        return limit + 1
    return total


def _items(value):
    """What a container's text is made of (a mapping's keys and values), or None for any other object."""
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # its repr is the dict of its attributes
    if isinstance(value, (Mapping, ItemsView)):
        return (x for pair in (value.items() if isinstance(value, Mapping) else value) for x in pair)
    if isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView)):
        return value
    return None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _string_size(s: str) -> int:
    """An upper bound of the length of repr(s) and of json.dumps(s, ensure_ascii=False)."""
    size = len(s) + 2 + s.count("\\") + s.count("'") + s.count('"')
    if s.isprintable():
        return size
    rest = _CONTROL.sub("", s)
    if rest.isprintable():  # each control character: \n (2 characters), \x00 (4) or \u0000 (6)
        common = s.count("\n") + s.count("\t") + s.count("\r")
        return size + common + 5 * (len(s) - len(rest) - common)
    return 10 * len(s) + 2  # \U000e0001: the longest escape of one character


def _within(env: "BoundedSandbox", *values) -> bool:
    """Whether every one of `values` has a text within the limit, so that building it is safe."""
    return all(env.size(v) <= env.limit for v in values)


def _printf_size(env: "BoundedSandbox", fmt, values) -> int:
    """An upper bound of the length of `fmt % values`: every width and precision, and every value's text."""
    if not _within(env, fmt):
        return env.limit + 1
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else str(fmt)
    specs = re.findall(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])", text)
    # a mapping may be written whole by every conversion (or one of its values by each)
    parts, each = (values, 1) if isinstance(values, tuple) else ([values], len(specs))
    widths = [int(n) for spec in specs for n in spec[:2] if n.isdigit()]
    if any("*" in spec[:2] for spec in specs):  # a width or precision taken from the values
        widths += [v for v in parts if isinstance(v, int)]
    widest, quoted = max(widths, default=0), any(spec[2] in "ra" for spec in specs)
    return len(text) + each * sum(max(widest, env.size(v, quoted=quoted)) for v in parts)


def _replaced_size(s, old, new, count=-1) -> int:
    found = (s.count(old) if old else len(s) + 1) if isinstance(s, (str, bytes)) and type(s) is type(old) else 0
    if count is not None and count >= 0:
        found = min(found, count)
    return len(s) + found * max(0, len(new) - len(old))


def _replace_filter_size(env: "BoundedSandbox", s, old, new, count=None) -> int:
    return _replaced_size(str(s), str(old), str(new), count) if _within(env, s, old, new) else env.limit + 1


def _indent_filter_size(env: "BoundedSandbox", s, width=4, first=False, blank=False) -> int:
    if not _within(env, s, width):
        return env.limit + 1
    return len(str(s)) + (str(s).count("\n") + 2) * (len(width) if isinstance(width, str) else width)


def _table_values(table):
    return table.values() if isinstance(table, Mapping) else table if isinstance(table, (list, tuple)) else ()


# What the result of each size-making method or filter may hold, from its arguments (a method's owner first).
METHOD_SIZES = {
    "center": lambda env, s, width, fill=" ": max(len(s), width),
    "ljust": lambda env, s, width, fill=" ": max(len(s), width),
    "rjust": lambda env, s, width, fill=" ": max(len(s), width),
    "zfill": lambda env, s, width: max(len(s), width),
    "expandtabs": lambda env, s, tabsize=8: len(s) + s.count("\t" if isinstance(s, str) else b"\t") * tabsize,
    "replace": lambda env, s, old, new, count=-1: _replaced_size(s, old, new, count),
    "translate": lambda env, s, table: len(s) * max([1, *(env.size(v) for v in _table_values(table))]),
    "join": lambda env, s, items: sum(env.size(i) for i in items) + len(s) * max(len(items) - 1, 0),
    "to_bytes": lambda env, i, length=1, byteorder="big", signed=False: length,
}
FILTER_SIZES = {
    "center": lambda env, value, width=80: max(env.size(value), width),
    "indent": _indent_filter_size,
    "format": lambda env, value, *args, **kwargs: _printf_size(env, value, kwargs or args),
    "join": lambda env, items, d="", attribute=None: (sum(env.size(i) for i in items)
                                                      + env.size(d) * max(len(items) - 1, 0)),
    "replace": _replace_filter_size,
    "wordwrap": lambda env, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: (
        env.size(s) + (env.size(s) + 1) * env.size(wrapstring or "\n")),
    "batch": lambda env, items, linecount, fill_with=None: (
        env.size(items) + 4 * len(items) + (linecount * (env.size(fill_with, quoted=True) + 2)
                                            if fill_with is not None else 0)),
    "slice": lambda env, items, slices, fill_with=None: (
        env.size(items) + 4 * len(items) + slices * (4 + env.size(fill_with, quoted=True))),
    "string": lambda env, value: env.size(value),
}
ITERATING = {"join", "batch", "slice"}  # filters that read their input through: an iterator is read into a list


class _BoundedFormatter(jinja2.sandbox.SandboxedFormatter):
    """str.format's formatter, bounding each field (its value's text and its width or precision) and the fields
    in all before they are built."""

    def __init__(self, env: "BoundedSandbox", **kwargs):
        super().__init__(env, **kwargs)
        self.written = 0

    def format_field(self, value, format_spec: str):
        self.written += max([self._env.size(value), *map(int, re.findall(r"\d+", format_spec))])
        self._env.check(self.written, "a str.format result")
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, jinja2.sandbox.SandboxedEscapeFormatter):
    pass


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    @jinja2.compiler.optimizeconst
    def visit_Concat(self, node, frame) -> None:
        # jinja2's, with the operands of `a ~ b ~ ...` measured before they are joined
        join = ("(markup_join if context.eval_ctx.volatile else str_join)" if frame.eval_ctx.volatile
                else "markup_join" if frame.eval_ctx.autoescape else "str_join")
        self.write(f"{join}(environment.measured_operands((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """HF's sandbox, where no value a rendering builds may hold more than its limit (see the module's docstring)."""
    intercepted_binops = frozenset(["+", "*", "%", "**"])
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **options):
        super().__init__(finalize=self._written, **options)
        self._render = threading.local()  # the server renders in several threads at once
        self.globals["range"] = self._range
        for name in LEFT_OUT:
            self.globals.pop(name, None)
            self.filters.pop(name, None)
        for name in FILTER_SIZES:
            self.filters[name] = self._bounded_filter(name, self.filters[name])

    @property
    def limit(self) -> int:
        """The most characters any value may hold: the rendering's limit, or TEMPLATE_CHARS outside one (when a
        template is compiled, jinja2 computes its constant expressions)."""
        return getattr(self._render, "limit", TEMPLATE_CHARS)

    @contextmanager
    def rendering(self, limit: int):
        """Render in this thread with values of at most `limit` characters and TEMPLATE_CHARS range items."""
        self._render.limit, self._render.range_items = max(limit, TEMPLATE_CHARS), 0
        try:
            yield
        finally:
            del self._render.limit, self._render.range_items

    def size(self, value, **layout) -> int:
        if isinstance(value, str) and not layout:  # most operands: what text_size would say, at less cost
            return len(value)
        return text_size(value, self.limit, **layout)

    def check(self, size: int, what: str) -> None:
        if size > self.limit:
            raise jinja2.sandbox.SecurityError(f"{what} would pass {self.limit} characters, the most a value of "
                                               f"this rendering may hold")

    def _range(self, *args):
        items = range(*args)
        self._render.range_items = getattr(self._render, "range_items", 0) + len(items)
        if self._render.range_items > TEMPLATE_CHARS:
            raise jinja2.sandbox.SecurityError(f"the template's ranges hold over {TEMPLATE_CHARS} items in all")
        return items

    # ---- operators, `~`, output and blocks ------------------------------------------------------------------------

    def call_binop(self, context, operator, left, right):
        sequences = (str, bytes, list, tuple)
        if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
            self.check(self.size(left) + self.size(right), f"a {type(left).__name__} + {type(right).__name__}")
        elif operator == "*":
            self._check_product(left, right)
        elif operator == "%" and isinstance(left, (str, bytes)):
            self.check(_printf_size(self, left, right), "a % formatting")
        elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)) and right > 0:
            if abs(left) > 1 and math.log2(abs(left)) * right > INT_BITS:
                raise jinja2.sandbox.SecurityError(f"the power {left!r} ** {right!r} is too large for a template")
        return super().call_binop(context, operator, left, right)

    def _check_product(self, left, right) -> None:
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                self.check(self.size(seq) * max(times, 0), f"a repetition of a {type(seq).__name__}")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > INT_BITS:
            raise jinja2.sandbox.SecurityError(f"a product of over {INT_BITS} bits is too large for a template")

    def measured_operands(self, operands: tuple) -> tuple:
        self.check(sum(self.size(x) for x in operands), "a ~ concatenation")
        return operands

    def _written(self, value):
        """The finalize step of `{{ value }}`, before str(value) is built."""
        self.check(self.size(value), "a value written out")
        return value

    def concat(self, pieces) -> str:
        """The text of a block, a macro or a `{% set %}` block: `pieces` joined, once their size is known."""
        pieces = list(pieces)
        self.check(sum(map(len, pieces)), "the text of a block or macro")
        return "".join(pieces)

    # ---- methods and filters --------------------------------------------------------------------------------------

    def wrap_str_format(self, value):
        """Every str, bytes and int method that makes a larger value, bounded (jinja2 calls this on every attribute
        a template reads, so a method is bounded however it is reached)."""
        owner, name = getattr(value, "__self__", None), getattr(value, "__name__", None)
        if isinstance(owner, str) and name in ("format", "format_map"):
            return self._bounded_format(owner, name == "format_map")
        if isinstance(owner, (str, bytes, int)) and name in METHOD_SIZES:
            return self._bounded_call(METHOD_SIZES[name], value, owner, f"{type(owner).__name__}.{name}")
        return super().wrap_str_format(value)

    def _bounded_call(self, size_of, method, owner, what: str):
        def bounded(*args, **kwargs):
            args = [list(a) if isinstance(a, Iterator) else a for a in args]  # str.join(generator)
            self.check(size_of(self, owner, *args, **kwargs), what)
            return method(*args, **kwargs)
        return update_wrapper(bounded, method)

    def _bounded_format(self, text: str, as_map: bool):
        def format(*args, **kwargs):
            if as_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            formatter = (_BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup)
                         else _BoundedFormatter(self))
            return type(text)(formatter.vformat(text, args, kwargs))
        return format

    def _bounded_filter(self, name: str, apply):
        # a filter that takes the environment or context first (jinja2.pass_*) keeps that marker (update_wrapper)
        skip = 1 if getattr(apply, "jinja_pass_arg", None) is not None else 0

        def bounded(*args, **kwargs):
            args = list(args)
            if name in ITERATING and isinstance(args[skip], Iterator):
                args[skip] = list(args[skip])
            self.check(FILTER_SIZES[name](self, *args[skip:], **kwargs), f"the {name} filter's result")
            return apply(*args, **kwargs)
        return update_wrapper(bounded, apply)


def template_environment() -> BoundedSandbox:
    """A fresh environment for one chat template."""
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        width = len(indent) if isinstance(indent, str) else indent or 0
        env.check(env.size(x, quoted=True, indent=width, separator=sum(map(len, separators or ())) or 4),
                  "the tojson filter's result")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env
