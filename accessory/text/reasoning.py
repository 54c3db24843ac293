"""Reasoning kept apart from the answer: what a thinking model (Qwen3, QwQ, DeepSeek-R1 and its distills) writes
between `<think>` and `</think>` before its answer goes to `reasoning_content`, never into the content, and tool
calls are read in the answer only.

A model either writes the opening marker itself (Qwen3), or its chat template ends the prompt with it (DeepSeek-R1's
distills; `opens_reasoning`), so that the reply begins inside the block. `split_reasoning` reads a whole reply or,
for a stream (`ReasoningStream`), its prefix so far, holding back what may still be a marker, so that what a stream
sends is never taken back. The reasoning is trimmed of blank space at its ends, and so is the start of the answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from accessory.text.tool_calls import held_marker


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers that open and close a reply's reasoning (vLLM's `--reasoning-parser` names)."""
    name: str
    start: str = "<think>"
    end: str = "</think>"


REASONING_FORMATS = {fmt.name: fmt for fmt in (ReasoningFormat("qwen3"), ReasoningFormat("deepseek_r1"))}


def reasoning_format(parser: str, template: str) -> Optional[ReasoningFormat]:
    """--reasoning-parser's format: a name of REASONING_FORMATS, "none", or for "auto" the markers if the chat
    template's text writes both."""
    if parser == "auto":
        return REASONING_FORMATS["qwen3"] if "<think>" in template and "</think>" in template else None
    return REASONING_FORMATS.get(parser)


def opens_reasoning(prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether a rendered prompt ends inside a reasoning block (its template wrote the opening marker last)."""
    return prompt.rstrip().endswith(fmt.start)


def closes_reasoning(prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether a rendered prompt ends with a reasoning block closed (Qwen3's, with enable_thinking false, writes it
    empty): the reply is all answer."""
    return prompt.rstrip().endswith(fmt.end)


def split_reasoning(text: str, fmt: ReasoningFormat, opened: bool, final: bool) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply (`final`) or its prefix so far; `opened`: the prompt ended inside the
    block. A reply that does not begin with the opening marker is all answer."""
    start = 0
    if not opened:
        lead = len(text) - len(text.lstrip())
        if text.startswith(fmt.start, lead):
            start = lead + len(fmt.start)
        elif not final and fmt.start.startswith(text[lead:]):
            return "", ""  # blank, or the start of the marker: undecided
        else:
            return "", text
    end = text.find(fmt.end, start)
    if end >= 0:
        return text[start:end].strip(), text[end + len(fmt.end):].lstrip()
    if final:  # cut short while reasoning
        return text[start:].strip(), ""
    body = text[start:len(text) - held_marker(text[start:], fmt.end)]
    return body.strip(), ""


class ReasoningStream:
    """A reply read in pieces: `feed` each piece, then `finish`; each returns the reasoning and the answer to send
    now."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt, self.opened, self.text, self.sent = fmt, opened, "", (0, 0)

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._news(split_reasoning(self.text, self.fmt, self.opened, final=False))

    def finish(self) -> tuple[str, str]:
        return self._news(split_reasoning(self.text, self.fmt, self.opened, final=True))

    def _news(self, split: tuple[str, str]) -> tuple[str, str]:
        news = tuple(whole[done:] for whole, done in zip(split, self.sent))
        self.sent = (len(split[0]), len(split[1]))
        return news
