"""The two tokenizer libraries under `Tokenizer`, behind one small interface: SentencePiece (`tokenizer.model`) and
HF `tokenizers` (`tokenizer.json`). Each encodes (control tokens written as text read as such, or not), decodes
without special tokens, and names its tokens.

The `tokenizers` package is used directly, not `transformers`, which takes seconds to import.
"""
from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Optional, Union

import sentencepiece
import tokenizers

from accessory.errors import TokenizerError


class SentencePieceBackend:
    """tokenizer.model. Decoding drops control pieces (<s>, </s>) by itself."""

    def __init__(self, path: Path):
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.n_words = self.sp.vocab_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        # SentencePiece never produces control pieces from text, but chat templates write "<s>" / "</s>" as text.
        # Split them out first, as HF's LlamaTokenizer does; each other chunk is encoded on its own, as Meta's
        # Llama-2 chat code does per turn.
        self.controls = {self.sp.id_to_piece(i): i for i in range(self.n_words) if self.sp.is_control(i)}
        self.control_re = re.compile("(" + "|".join(map(re.escape, self.controls)) + ")") if self.controls else None

    def encode(self, s: str) -> list[int]:
        if self.control_re is None:
            return self.sp.encode(s)
        ids = []
        for chunk in self.control_re.split(s):
            if chunk in self.controls:
                ids.append(self.controls[chunk])
            elif chunk:
                ids += self.sp.encode(chunk)
        return ids

    def encode_literal(self, s: str) -> list[int]:
        return self.sp.encode(s)

    @property
    def special_texts(self) -> frozenset[str]:
        return frozenset(self.controls)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def token(self, i: int) -> str:
        return self.sp.id_to_piece(i)

    def is_special(self, i: int) -> bool:
        return self.sp.is_control(i)


class HFTokenizersBackend:
    """tokenizer.json. Added tokens written in the text (e.g. "<|im_start|>") encode as their single ids."""

    def __init__(self, path: Path):
        self.tk = tokenizers.Tokenizer.from_file(str(path))
        self.n_words = self.tk.get_vocab_size(with_added_tokens=True)
        self.added = set(self.tk.get_added_tokens_decoder())

    def encode(self, s: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it: seconds for a long text, during which
        # a server's event loop, in another thread, could not answer)
        return self.tk.encode_batch([s], add_special_tokens=add_special_tokens)[0].ids

    def encode_literal(self, s: str) -> list[int]:
        return self._literal.encode_batch([s], add_special_tokens=False)[0].ids

    @cached_property
    def _literal(self) -> tokenizers.Tokenizer:
        """A copy that reads special tokens' text as plain text (a setting of the object: hence a copy)."""
        literal = tokenizers.Tokenizer.from_str(self.tk.to_str())
        literal.encode_special_tokens = True
        return literal

    @cached_property
    def special_texts(self) -> frozenset[str]:
        return frozenset(t.content for i, t in self.tk.get_added_tokens_decoder().items() if t.special)

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def token(self, i: int) -> str:
        return self.tk.id_to_token(i)

    def token_id(self, token: str) -> Optional[int]:
        return self.tk.token_to_id(token)

    def is_special(self, i: int) -> bool:
        return i in self.added


Backend = Union[SentencePieceBackend, HFTokenizersBackend]


def open_backend(path: Path) -> Backend:
    """The backend that reads the tokenizer file at `path`: HF `tokenizers` for a .json file, else SentencePiece."""
    try:
        return SentencePieceBackend(path) if path.suffix != ".json" else HFTokenizersBackend(path)
    except Exception as e:  # both libraries raise plain RuntimeError/Exception on a bad file
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
