"""`--config FILE.yaml`: a parser's flags from a YAML mapping, for any argparse parser (the verbs, the demos).

Keys are flag names in either spelling, with or without leading dashes (`max_batch_size: 8`, `--max-batch-size: 8`).
Each value is checked as the same flag on the command line is (its type, its choices; `true` / `false` for a flag
without a value, a list for a flag of several values). The file's values become the parser's defaults, so flags on
the command line override them. A bad file, key or value is a usage error (exit 2) that names the file, the key and
what was expected. YAML aliases (`*name`) are refused: each repeats a whole node without copying it, so a few nested
ones make a value of billions of items that converting or quoting would build. Values quoted in errors are clipped.
"""
from __future__ import annotations

import argparse
import functools
import reprlib
import sys
from pathlib import Path
from typing import Any, Optional

from accessory.errors import ConfigError
from accessory.presets import FLAG_SUFFIXES, resolve

FLAG = "--config"
MAX_BYTES = 1 << 20  # a config sets a few flags; more is a mistake (or /dev/zero), refused before it is parsed
_QUOTE = reprlib.Repr()  # how errors quote a value: at most this much of it, whatever its size or depth
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxstring, _QUOTE.maxother = 3, 8, 8, 80, 80


def add_config_arg(parser) -> None:
    parser.add_argument(FLAG, metavar="FILE.yaml", help="set flags from a YAML mapping of flag names to values "
                        "(e.g. 'max_batch_size: 8'), or from a preset named as serve/throughput; flags given on "
                        "the command line override it (default: none)")


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, the chosen verb's `--config` file (if given) setting its defaults first."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verb, rest = _chosen_parser(parser, argv)
    config = _config_value(verb, rest)
    if config is not None:
        try:
            path = resolve(config, FLAG_SUFFIXES, FLAG)
        except ConfigError as e:
            verb.error(str(e))
        apply_config(verb, path, parsers(parser))
    return parser.parse_args(argv)


def apply_config(parser: argparse.ArgumentParser, path: Path, all_parsers=()) -> None:
    """Make the flags `path` sets `parser`'s defaults; `all_parsers` (every verb's) name the verb a foreign key
    belongs to."""
    defaults = {}
    for key, value in _read_mapping(parser, path).items():
        action = _action(parser, path, key, all_parsers)
        if action.dest in defaults:
            parser.error(f"{path}: {_quoted(key)} sets {action.option_strings[0]} a second time")
        try:
            defaults[action.dest] = _value(action, value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:  # a flag's type may quote the value whole
            parser.error(f"{path}: {_clip(str(key))}: {_clip(str(e))}")
        action.required = False  # given by the file: the command line need not repeat it
    parser.set_defaults(**defaults)


def _chosen_parser(parser: argparse.ArgumentParser, argv: list[str]):
    """(the parser of the verb `argv` chooses, the arguments after the verb); `parser` itself if it has no verbs.
    A verb is the first argument that is not a flag (no parser with verbs here takes a flag with a value)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words = [i for i, arg in enumerate(argv) if not arg.startswith("-")]
            if words and argv[words[0]] in action.choices:
                return _chosen_parser(action.choices[argv[words[0]]], argv[words[0] + 1:])
            return parser, []  # no verb (yet): parse_args reports it
    return parser, argv


def _config_value(parser: argparse.ArgumentParser, argv: list[str]) -> Optional[str]:
    """The value of `--config` in `argv`, if `parser` takes it."""
    action = parser._option_string_actions.get(FLAG)
    if action is None:
        return None
    pre = argparse.ArgumentParser(add_help=False)  # abbreviations as `parser` takes them: --conf is --config
    pre.add_argument(*action.option_strings, dest="config")
    known, _ = pre.parse_known_args(argv)
    return known.config


def parsers(parser: argparse.ArgumentParser):
    """`parser` and every verb's parser under it (each once: a verb's aliases share its parser)."""
    yield parser
    for verb in verb_parsers(parser):
        yield from parsers(verb)


def verb_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of `parser`'s own verbs, if it has any."""
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list({id(p): p for p in found[0].choices.values()}.values()) if found else []


def _read_mapping(parser: argparse.ArgumentParser, path: Path) -> dict:
    import yaml

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            parser.error(f"{FLAG} {path}: over {MAX_BYTES} bytes; a config file holds a few flags")
        values = yaml.load(data.decode("utf-8"), Loader=_loader())
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"{FLAG} {path}: cannot be read ({_clip(str(e))})")
    except _AliasFound as e:
        parser.error(f"{FLAG} {path}: {_clip(str(e.key))}: line {e.line}: YAML aliases (*{_clip(e.anchor)}) are not "
                     f"allowed in a config file; write the value out")
    except yaml.YAMLError as e:
        parser.error(f"{FLAG} {path}: not valid YAML ({_clip(str(e), 600)})")
    except RecursionError:
        parser.error(f"{FLAG} {path}: not valid YAML (nested too deeply)")
    if values is None:  # an empty file sets nothing
        return {}
    if not isinstance(values, dict):
        parser.error(f"{FLAG} {path}: expected a mapping of flag names to values (max_batch_size: 8), found a "
                     f"{type(values).__name__}")
    return values


class _AliasFound(Exception):
    def __init__(self, key, anchor: str, line: int):
        super().__init__(anchor)
        self.key, self.anchor, self.line = key, anchor, line


@functools.cache
def _loader():
    """yaml.SafeLoader refusing aliases (with the top-level key that holds one), built on first use: the CLI starts
    without importing yaml."""
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        depth, key = 0, "(the top level)"

        def compose_node(self, parent, index):
            if self.depth == 1 and isinstance(index, yaml.ScalarNode):  # a value of the top-level mapping
                self.key = index.value
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise _AliasFound(self.key, event.anchor, event.start_mark.line + 1)
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return NoAliasLoader


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _quoted(value: Any) -> str:
    return _QUOTE.repr(value)


SETTINGS = (argparse._StoreAction, argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)


def _action(parser: argparse.ArgumentParser, path: Path, key: Any, all_parsers) -> argparse.Action:
    """The action of the flag `key` names; a usage error naming the key if `parser` has none."""
    flag = "--" + str(key).lstrip("-")
    action = parser._option_string_actions.get(flag)
    if isinstance(key, str) and isinstance(action, SETTINGS) and flag != FLAG:
        return action
    if flag == FLAG:
        parser.error(f"{path}: {_quoted(key)}: a config file cannot name another one")
    owners = sorted({p.prog for p in all_parsers if p is not parser and flag in p._option_string_actions})
    if owners:
        parser.error(f"{path}: {_quoted(key)} is a flag of {' and '.join(owners)}, not of {parser.prog}")
    known = sorted({a.option_strings[0].lstrip("-") for a in parser._actions
                    if isinstance(a, SETTINGS) and a.option_strings and a.option_strings[0] != FLAG})
    parser.error(f"{path}: unknown key {_quoted(key)}; {parser.prog} takes: {', '.join(known)}")


def _value(action: argparse.Action, value: Any) -> Any:
    """`value` as the flag's command-line value would be converted and checked."""
    if action.nargs == 0:  # a switch: true is the flag given, false the flag left out
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {_quoted(value)}")
        return action.const if value else action.default
    if action.nargs in ("+", "*"):
        values = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not values:
            raise ValueError("expected at least one value, got an empty list")
        return [_one(action, v) for v in values]
    if action.nargs == "?" and isinstance(value, bool):  # --quant alone is `quant: true`
        return action.const if value else action.default
    return _one(action, value)


def _one(action: argparse.Action, value: Any) -> Any:
    if value is None or isinstance(value, (bool, list, dict)):
        raise TypeError(f"expected one value (as on the command line: {action.metavar or action.dest.upper()}), "
                        f"got {_quoted(value)}")
    text = str(value)
    try:
        converted = action.type(text) if action.type else text
    except (TypeError, ValueError):  # int(), float(): argparse says "invalid int value" here
        raise ValueError(f"expected {getattr(action.type, '__name__', 'a value')}, got {_quoted(value)}") from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"expected one of {list(action.choices)}, got {_quoted(value)}")
    return converted
