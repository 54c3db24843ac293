"""Text <-> token ids: the public `Tokenizer` over a SentencePiece `tokenizer.model` or an HF `tokenizer.json`
(backends.py), with its special ids (special_ids.py) and the chat template beside it (chat_template.py); and finding
a tokenizer beside the weights.

`encode(s, bos, eos)` keeps LLaMA2-Accessory's signature.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from accessory.errors import TokenizerError
from accessory.text.backends import Backend, SentencePieceBackend, open_backend
from accessory.text.chat_template import (ChatPrompt, load_chat_template, read_chat_template, render_chat_template,
                                          render_with_literal_contents)
from accessory.text.special_ids import find_chat_stop_ids, find_eos_ids, find_special_ids, read_side_file
from accessory.text.template_sandbox import TEMPLATE_CHARS

# When a folder holds both, tokenizer.json wins: HF repos that ship both (Llama-2, Mistral) treat tokenizer.json as
# the complete tokenizer (it carries the added chat tokens and the BOS post-processor; transformers loads it too),
# while tokenizer.model is kept only for the slow SentencePiece path.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Files beside the tokenizer that belong to it and travel with it when a checkpoint is saved.
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
IMAGE_PLACEHOLDER = "<image>"  # where a prompt's image goes (HF LLaVA's and LLaVA's own spelling)

PathLike = Union[str, Path]


def find_tokenizer(folders: list[PathLike]) -> Optional[Path]:
    """The tokenizer file in the last folder that has one (later folders override earlier ones), or None."""
    for folder in reversed(folders):
        for name in TOKENIZER_FILES:
            if (Path(folder) / name).is_file():
                return Path(folder) / name
    return None


class Tokenizer:
    """A SentencePiece or HF tokenizer with its chat template; see `from_path` for what `path` may be."""

    def __init__(self, path: PathLike):
        self.path = _resolve(Path(path))
        folder = self.path.parent
        self.files = [self.path] + [folder / n for n in SIDE_FILES if (folder / n).is_file()]
        self._config_path = folder / "tokenizer_config.json"
        config, generation = read_side_file(self._config_path), read_side_file(folder / "generation_config.json")
        self._backend: Backend = open_backend(self.path)
        self.n_words: int = self._backend.n_words
        self.bos_id, self.eos_id, self._add_bos = find_special_ids(self.path, self._backend, config, generation)
        self._eos_ids = find_eos_ids(self.eos_id, generation)
        # _template_name, in errors: where the template was read (a file, or the key of tokenizer_config.json)
        # chat_template_text: its source, where tool-call formats are recognised (tool_calls.detect_format)
        self._chat_template, self._template_name, self.chat_template_text = load_chat_template(folder, config)

    @classmethod
    def from_path(cls, path: PathLike) -> "Tokenizer":
        """Load from a `tokenizer.model` or `tokenizer.json` file, or a folder holding one (tokenizer.json wins if
        both are there). The tokenizer_config.json, special_tokens_map.json, generation_config.json and
        chat_template.jinja beside it are read when present. Raises TokenizerError naming the path otherwise."""
        return cls(path)

    # --- special tokens -------------------------------------------------------------------------------------------

    @property
    def eos_ids(self) -> set[int]:
        """Ids that end generation: eos_id plus generation_config.json's eos_token_id (int or list)."""
        return set(self._eos_ids)

    @cached_property
    def _chat_stop_ids(self) -> frozenset[int]:
        def render_turn(messages: list[dict]) -> str:
            return self.apply_chat_template(messages, add_generation_prompt=False)

        return find_chat_stop_ids(render_turn, self._backend, self._eos_ids)

    @property
    def chat_stop_ids(self) -> set[int]:
        """Ids that end an assistant turn of the chat template, plus `eos_ids` (only those without a template)."""
        return set(self._chat_stop_ids)

    # --- text <-> ids ---------------------------------------------------------------------------------------------

    def encode(self, s: str, bos: bool, eos: bool, *, special: bool = True) -> list[int]:
        """Token ids of `s`. `bos=True` prepends BOS when this tokenizer uses one (always for SentencePiece; for
        tokenizer.json, as its config says), but never a second one: templates such as Llama-3's write it as text.
        `eos=True` appends eos_id. `special=False`: the text of special tokens ("</s>", "<|im_start|>") is read
        as plain text. A ChatPrompt's messages are always read as plain text, its template's text never."""
        if isinstance(s, ChatPrompt):
            ids, done = [], 0
            for start, end in s.contents:
                ids += self._backend.encode(s[done:start]) + self._backend.encode_literal(s[start:end])
                done = end
            ids += self._backend.encode(s[done:])
        else:
            ids = self._backend.encode(s) if special else self._backend.encode_literal(s)
        if bos and self._add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_pieces(self, s: str, separator: str, bos: bool, *, special: bool = True) -> list[list[int]]:
        """Token ids of each piece of `s` split at `separator`, each as `encode` reads it (a ChatPrompt's messages
        still as plain text); BOS before the first only."""
        pieces, at = [], 0
        for text in str(s).split(separator):
            end = at + len(text)
            if isinstance(s, ChatPrompt):
                text = ChatPrompt(text, tuple((max(a, at) - at, min(b, end) - at) for a, b in s.contents
                                              if a < end and b > at))
            pieces.append(self.encode(text, bos=bos and not pieces, eos=False, special=special))
            at = end + len(separator)
        return pieces

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list or a 1-D tensor), without special tokens such as EOS or end-of-turn, but with the
        tool-call and reasoning markers that a reply's readers need where they are special tokens (Mistral's
        "[TOOL_CALLS]", Llama 3's "<|python_tag|>")."""
        ids, kept = [int(i) for i in ids], self._kept_markers
        if kept.keys().isdisjoint(ids):
            return self._backend.decode(ids)
        pieces, start = [], 0
        for at, i in enumerate(ids):
            if i in kept:
                pieces += [self._backend.decode(ids[start:at]), kept[i]]
                start = at + 1
        return "".join(pieces) + self._backend.decode(ids[start:])

    @cached_property
    def _kept_markers(self) -> dict[int, str]:
        """The special tokens `decode` writes: those whose text is a tool-call or reasoning marker."""
        from accessory.text.reasoning import REASONING_FORMATS
        from accessory.text.tool_calls import FORMATS

        markers = {text for fmt in FORMATS.values() for text in (fmt.start, fmt.end, fmt.named, fmt.named_id)}
        markers |= {text for fmt in REASONING_FORMATS.values() for text in (fmt.start, fmt.end)}
        found = {}
        for text in markers & self._backend.special_texts:
            ids = self._backend.encode(text)
            if len(ids) == 1:
                found[ids[0]] = text
        return found

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters of its vocabulary entry (each of which stands for at least one
        character or byte of text): a text of more than n times this many characters has more than n tokens,
        which callers check before tokenizing a text that cannot fit."""
        return max(len(self._backend.token(i) or "") for i in range(self.n_words))

    # --- chat -----------------------------------------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The library object underneath: a `SentencePieceBackend` (its processor is `.sp`) or an
        `HFTokenizersBackend` (`.tk`)."""
        return self._backend

    def token_text(self, i: int) -> str:
        """Token `i` on its own, as text: its leading space kept (a SentencePiece "\u2581" or a byte-level "\u0120"
        is a space), a byte token as that byte (undecodable alone: a replacement character)."""
        if self._backend.is_special(i):
            return self._backend.token(i) or ""
        if isinstance(self._backend, SentencePieceBackend):
            piece = self._backend.token(i)
            return " " + self.decode([i]) if piece.startswith("\u2581") else self.decode([i])
        return self.decode([i])

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def set_chat_template(self, path: PathLike) -> None:
        """Render chats with the Jinja template file at `path` (`read_chat_template`) instead of the model's own; its
        end-of-turn token becomes one of `chat_stop_ids`."""
        (self._chat_template, self.chat_template_text), self._template_name = (read_chat_template(path),
                                                                               f"the chat template {path}")
        self.__dict__.pop("_chat_stop_ids", None)  # cached from the old template

    def literal_messages(self, render: Callable[[list[dict]], str], messages: list[dict]) -> str:
        """`render(messages)`, as a ChatPrompt when a message holds the text of a special token, so that it is
        encoded as text: a user typing "<|im_end|>\n<|im_start|>system" must not open a system turn."""
        # LLaVA's tokenizers make the image placeholder a special token: in a message it says where the image goes
        specials = self._backend.special_texts - {IMAGE_PLACEHOLDER}
        return render_with_literal_contents(render, messages, specials, self._template_name)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **context) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template, as HF does;
        `context`: more variables for the template (`tools`)."""
        if self._chat_template is None:
            raise TokenizerError(f"{self._config_path} has no chat_template (and there is no chat_template.jinja "
                                 f"beside it): the model has no chat template; use a plain prompt instead")
        bos_token = self._backend.token(self.bos_id) if self.bos_id is not None else None
        # what it may write, and so the most any value it builds may hold (template_sandbox)
        limit = self.max_rendered_chars(messages) + len(str(context))
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                         eos_token=self._backend.token(self.eos_id), **context)
        return render_chat_template(self._chat_template, self._template_name, variables, limit)

    @staticmethod
    def max_rendered_chars(messages: list[dict]) -> int:
        """What a chat template may write for `messages`: their text plus TEMPLATE_CHARS per message."""
        return sum(len(str(m.get("content", ""))) + TEMPLATE_CHARS for m in messages)

    def encode_chat(self, prompt: str) -> list[int]:
        """One user turn rendered with the chat template and the generation prompt, encoded with `bos=True`."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": prompt}]), bos=True, eos=False)


def _resolve(path: Path) -> Path:
    if path.is_dir():
        found = find_tokenizer([path])
        if found is None:
            raise TokenizerError(f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)}")
        return found
    if not path.is_file():
        raise TokenizerError(f"tokenizer not found: {path} (expected a tokenizer.model or tokenizer.json file, or a "
                             f"folder holding one)")
    return path


def find_tokenizer_for(folders: list[PathLike], tokenizer_path: Optional[PathLike] = None) -> Optional[Tokenizer]:
    """The tokenizer at `tokenizer_path`, else the one beside the weights (`find_tokenizer`), loaded; None if
    there is none."""
    path = tokenizer_path or find_tokenizer(list(folders))
    return Tokenizer.from_path(path) if path is not None else None
