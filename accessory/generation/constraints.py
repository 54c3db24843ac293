"""Structured output: a request's output is held to a JSON schema, any JSON object, a regular expression or a list
of choices, by masking the tokens that could not continue a match before each sampling step (on the source rank).

The grammar engine is llguidance (measured in benchmarks/grammar.py beside xgrammar: both cost tens of
microseconds per token, but llguidance compiles a schema in about a millisecond where xgrammar takes about half a
second, which a server with a new schema per request would pay in time to first token; and it needs no torch).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Optional

import torch

# Objects are written compactly with the separators models write by themselves, and no other whitespace: free
# whitespace lets a model pad forever without breaking the grammar.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "tool_calls", "reasoned")


class ConstraintError(ValueError):
    """A schema or pattern that cannot be compiled."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `spec`: the schema as JSON text (json_schema), the pattern (regex), the
    choices as a JSON list (choice), a Lark grammar of tool calls (tool_calls: text/tool_calls.py `call_grammar`)
    or of reasoning and then an answer (reasoned: `after_reasoning`); empty for json_object."""
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a constraint's kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict) -> "Constraint":
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def choice(cls, choices: list[str]) -> "Constraint":
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(choices))

    def grammar(self) -> str:
        """The llguidance grammar (its JSON text) for this constraint."""
        import llguidance

        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(map(re.escape, json.loads(self.spec))))
        if self.kind in ("tool_calls", "reasoned"):
            return llguidance.LLMatcher.grammar_from_lark(self.spec)
        schema = json.loads(self.spec) if self.kind == "json_schema" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)

    def lark(self) -> str:
        """This constraint as a Lark grammar (llguidance's) whose `start` rule is the whole output."""
        if self.kind in ("tool_calls", "reasoned"):
            return self.spec
        if self.kind == "regex":
            return f"start: /{_lark_regex(self.spec)}/"
        if self.kind == "choice":
            return "start: " + " | ".join(map(json.dumps, json.loads(self.spec)))
        schema = json.loads(self.spec) if self.kind == "json_schema" else {"type": "object"}
        return f"start: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


ANY_TEXT = r"/(.|\n)*/"


def after_reasoning(constraint: Optional[Constraint], markers: tuple[str, str], opened: bool,
                    budget: Optional[int]) -> Optional[Constraint]:
    """The constraint of a reply that may reason first, between `markers` (a thinking model's <think> and
    </think>): its reasoning free, but closed after `budget` tokens (the closing marker is then forced), and its
    answer held to `constraint` (free without one). `opened`: the prompt ended inside the block, so the reply
    begins in it; else the reply may open one or answer at once. None where nothing is held."""
    if constraint is None and budget is None:
        return None
    end = json.dumps(markers[1])
    limit = f", max_tokens={budget}" if budget is not None else ""
    answer = f"answer: {ANY_TEXT}" if constraint is None else re.sub(r"^start:", "answer:", constraint.lark(),
                                                                       count=1, flags=re.M)
    rules = [f"thought[stop={end}{limit}]: {ANY_TEXT}", answer]
    reasoned = f"thought {end} /{FEW_BLANKS}/ answer"
    if not opened:
        opening = _regex(markers[0])
        rules.append(f"THINKING: /{FEW_BLANKS}{opening}/")
        if constraint is None:  # a free answer at once must not open a block: there the budget would not apply
            rules.append(f"ANSWER_AT_ONCE: {ANY_TEXT} & ~/{BLANK}{opening}(.|\\n)*/")
        reasoned = f"THINKING {reasoned} | {'answer' if constraint is not None else 'ANSWER_AT_ONCE'}"
    return Constraint("reasoned", "\n".join([f"start: {reasoned}", *rules]))


BLANK = r"[ \t\n]*"
FEW_BLANKS = r"[ \t\n]{0,3}"  # around the markers: more would let a model pad forever


CONTROL_ESCAPES = {"\n": r"\n", "\r": r"\r", "\t": r"\t"}


def _lark_regex(pattern: str) -> str:
    """A regular expression as a Lark regex literal reads it: a slash would end the literal and a line break
    cannot be in it, so both are escaped (an escaped line break, as re.escape writes one, too)."""
    def written(match: re.Match) -> str:
        escaped, plain = match.groups()
        char = escaped if escaped is not None else plain
        return CONTROL_ESCAPES.get(char) or ("\\" + char if escaped is not None or char == "/" else char)

    return re.sub(r"\\(.)|([/\n\r\t])", written, pattern, flags=re.S)


def _regex(text: str) -> str:
    """A Lark regex literal's body that matches `text`."""
    return _lark_regex(re.escape(text))


class Matcher:
    """One row's place in its constraint: which tokens may come next, and the tokens taken so far. A state that
    the grammar engine refuses (one of its limits, a dead end) raises ConstraintError saying so: the row ends."""

    def __init__(self, matcher, vocab_size: int, stops: torch.Tensor, kind: str):
        """`stops`: the bitmask of the stop ids (`token_bits`)."""
        import llguidance.torch

        self._matcher, self.vocab_size, self._stops, self.kind, self.taken = matcher, vocab_size, stops, kind, 0
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> torch.Tensor:
        """The bitmask (words,) int32 of the tokens that may come next, bit t % 32 of word t // 32 (a stop id is
        allowed once the output is a whole match)."""
        self.check()
        return self._bitmask[0].clone()

    def check(self) -> None:
        """Work out which tokens may come next; ConstraintError if the engine refuses, or if none may (the output
        could then never become a match)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        if self._matcher.is_error():
            raise self._refused()
        if not self._matcher.is_accepting():  # llguidance may offer a stop id here (for a special token's text)
            self._bitmask &= ~self._stops
            if not self._bitmask.any():
                raise self._dead_end("no token continues a match (output is text: a pattern that needs a special "
                                     "token's text, such as <|im_end|>, matches no output)")

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise self._refused()
        self.taken += 1

    def consume_forced(self) -> None:
        """Take the tokens that the grammar forces next (all its outputs go on with them)."""
        forced = self._matcher.compute_ff_tokens()
        if forced and (not self._matcher.consume_tokens(forced) or self._matcher.is_error()):
            raise self._refused()
        self.taken += len(forced)

    def copy(self) -> "Matcher":
        return Matcher(self._matcher.deep_copy(), self.vocab_size, self._stops, self.kind)

    def _refused(self) -> "ConstraintError":
        """The engine's error: a dead end it found, or one of its limits (it gives up on a grammar too complex)."""
        why = _first_line(self._matcher.get_error())
        if why in DEAD_ENDS or self._matcher.stop_reason() in DEAD_ENDS:
            return self._dead_end("no text matches it")
        return ConstraintError(f"the grammar engine gave up on the {self.kind} constraint{self._where()}: {why}")

    def _dead_end(self, why: str) -> "ConstraintError":
        return ConstraintError(f"the {self.kind} constraint admits no output{self._where()}: {why}")

    def _where(self) -> str:
        return f" past its first {self.taken} token(s)" if self.taken else ""

    @property
    def finished(self) -> bool:
        """The output is a whole match and nothing may follow it (then the row stops)."""
        return self._matcher.is_stopped()


def start(constraint: Constraint, tokenizer, vocab_size: int, stop_ids) -> Matcher:
    """A matcher at the start of `constraint`, for a model whose logits have `vocab_size` entries and whose rows
    end on `stop_ids`. Raises ConstraintError for a schema or pattern that cannot be compiled, or whose first step
    already shows that it admits no output."""
    import llguidance

    lltokenizer = _lltokenizer(tokenizer, vocab_size, frozenset(stop_ids))
    try:
        grammar = constraint.grammar()
    except Exception as e:  # llguidance raises ValueError, or its own errors, for bad patterns
        raise ConstraintError(f"the {constraint.kind} constraint cannot be compiled: {_first_line(str(e))}") from None
    # log_level 0: its warnings would go to stderr, not to our log; errors without the parser's state and grammar
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0,
                                   limits=llguidance.LLParserLimits(verbose_errors=False))
    if matcher.is_error():
        raise ConstraintError(f"the {constraint.kind} constraint cannot be compiled: "
                              f"{_first_line(matcher.get_error())}")
    started = Matcher(matcher, vocab_size, token_bits(stop_ids, vocab_size), constraint.kind)
    started.check()
    ahead = started.copy()  # what every output starts with: a schema whose required fields nest forever fails here
    ahead.consume_forced()
    ahead.check()
    return started


DEAD_ENDS = ("NoExtension", "NoExtensionBias")  # llguidance's words for "no more text can match"
ERROR_CHARS = 300  # the most of a grammar engine's message that a refusal repeats (some quote the schema)


def _first_line(message: str) -> str:
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= ERROR_CHARS else line[:ERROR_CHARS] + "..."


def token_bits(ids, vocab_size: int) -> torch.Tensor:
    """A token bitmask with the bits of `ids` set, laid out as llguidance's: (1, vocab_size / 32) int32 words."""
    words = -(-vocab_size // 32)
    bits = [0] * words
    for i in ids:
        if 0 <= i < 32 * words:
            bits[i // 32] |= 1 << (i % 32)
    return torch.tensor([[b - (1 << 32) if b >= 1 << 31 else b for b in bits]], dtype=torch.int32)


@functools.lru_cache(maxsize=4)
def _lltokenizer(tokenizer, vocab_size: int, stop_ids: frozenset):
    """llguidance's view of the vocabulary (about a second to build; once per tokenizer)."""
    import llguidance

    backend = tokenizer.backend
    eos = sorted(stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    n_vocab = max(vocab_size, tokenizer.n_words)
    if hasattr(backend, "tk"):  # HF tokenizers: llguidance reads tokenizer.json itself
        return llguidance.LLTokenizer(backend.tk.to_str(), n_vocab=n_vocab, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SentencePieceVocabulary(backend.sp, eos)),
                                  n_vocab=n_vocab, eos_token=eos)


class _SentencePieceVocabulary:
    """What llguidance reads of a SentencePiece model: each token's bytes, the special ids, and encoding."""

    def __init__(self, sp, eos: list[int]):
        self.sp, self.eos_token_id = sp, eos[0]
        self.bos_token_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.tokens = [self._bytes(i) for i in range(sp.vocab_size())]
        self.special_token_ids = [i for i in range(sp.vocab_size()) if sp.is_control(i) or sp.is_unknown(i)]

    def _bytes(self, i: int) -> bytes:
        piece = self.sp.id_to_piece(i)
        if self.sp.is_byte(i):  # "<0x0A>"
            return bytes([int(piece[3:5], 16)])
        if self.sp.is_control(i) or self.sp.is_unknown(i):
            return b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def __call__(self, text: str) -> list[int]:
        """`text` as the continuation of other text: without the space SentencePiece puts before a whole text
        (else llguidance, tokenizing bytes the pattern forces, would allow "▁-" where "-" must come)."""
        marker = self.sp.encode("\n")
        ids = self.sp.encode("\n" + text)
        return ids[len(marker):] if ids[:len(marker)] == marker else self.sp.encode(text)
