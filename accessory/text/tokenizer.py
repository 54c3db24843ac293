"""Text <-> token ids: one `Tokenizer` over a SentencePiece `tokenizer.model` or an HF `tokenizer.json`, plus the
chat template that an HF `tokenizer_config.json` (or `chat_template.jinja`) beside it carries.

`encode(s, bos, eos)` keeps LLaMA2-Accessory's signature. The `tokenizers` package is used directly, not
`transformers`, which takes seconds to import.
"""
from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import jinja2
import sentencepiece
import tokenizers

from accessory.errors import TokenizerError
from accessory.jsonfile import read_json_object
from accessory.text.template_sandbox import TEMPLATE_CHARS, template_environment

# When a folder holds both, tokenizer.json wins: HF repos that ship both (Llama-2, Mistral) treat tokenizer.json as
# the complete tokenizer (it carries the added chat tokens and the BOS post-processor; transformers loads it too),
# while tokenizer.model is kept only for the slow SentencePiece path.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Files beside the tokenizer that belong to it and travel with it when a checkpoint is saved.
IMAGE_PLACEHOLDER = "<image>"  # where a prompt's image goes (HF LLaVA's and LLaVA's own spelling)
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")

PathLike = Union[str, Path]


def find_tokenizer(folders: list[PathLike]) -> Optional[Path]:
    """The tokenizer file in the last folder that has one (later folders override earlier ones), or None."""
    for folder in reversed(folders):
        for name in TOKENIZER_FILES:
            if (Path(folder) / name).is_file():
                return Path(folder) / name
    return None


class _SentencePiece:
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


class _HFTokenizers:
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


class Tokenizer:
    """A SentencePiece or HF tokenizer with its chat template; see `from_path` for what `path` may be."""

    def __init__(self, path: PathLike):
        self.path = _resolve(Path(path))
        folder = self.path.parent
        self.files = [self.path] + [folder / n for n in SIDE_FILES if (folder / n).is_file()]
        self._config_path = folder / "tokenizer_config.json"
        config, generation = _read_json(self._config_path), _read_json(folder / "generation_config.json")
        try:
            self._backend = _SentencePiece(self.path) if self.path.suffix != ".json" else _HFTokenizers(self.path)
        except Exception as e:  # both libraries raise plain RuntimeError/Exception on a bad file
            raise TokenizerError(f"cannot read tokenizer {self.path}: {e}") from e
        self.n_words: int = self._backend.n_words
        self.bos_id, self.eos_id, self._add_bos = self._special_ids(config, generation)
        self._eos_ids = frozenset([self.eos_id, *_ids(generation.get("eos_token_id"))])
        # _template_name, in errors: where the template was read (a file, or the key of tokenizer_config.json)
        self._chat_template, self._template_name = _load_chat_template(folder, config)

    @classmethod
    def from_path(cls, path: PathLike) -> "Tokenizer":
        """Load from a `tokenizer.model` or `tokenizer.json` file, or a folder holding one (tokenizer.json wins if
        both are there). The tokenizer_config.json, special_tokens_map.json, generation_config.json and
        chat_template.jinja beside it are read when present. Raises TokenizerError naming the path otherwise."""
        return cls(path)

    # --- special tokens -------------------------------------------------------------------------------------------

    def _special_ids(self, config: dict, generation: dict) -> tuple[Optional[int], int, bool]:
        """(bos_id, eos_id, whether bos=True adds BOS)."""
        if isinstance(self._backend, _SentencePiece):
            # The model file is authoritative, and bos=True always prepends BOS, as in LLaMA2-Accessory.
            bos_id, eos_id, add_bos = self._backend.bos_id, self._backend.eos_id, self._backend.bos_id is not None
        else:
            special_map = _read_json(self._config_path.with_name("special_tokens_map.json"))
            bos_id = self._hf_special_id("bos", config, special_map, generation)
            eos_id = self._hf_special_id("eos", config, special_map, generation)
            add_bos = bos_id is not None and self._hf_adds_bos(config, bos_id)
        if eos_id is None:
            raise TokenizerError(f"{self.path}: no EOS token; expected one in the tokenizer, in eos_token of "
                                 f"{self._config_path.name} / special_tokens_map.json, or in eos_token_id of "
                                 f"generation_config.json beside it")
        return bos_id, eos_id, add_bos

    def _hf_special_id(self, kind: str, config: dict, special_map: dict, generation: dict) -> Optional[int]:
        """BOS/EOS id of a tokenizer.json from `{kind}_token` in tokenizer_config.json or special_tokens_map.json,
        else `{kind}_token_id` of generation_config.json (its first entry when it lists several)."""
        for name, cfg in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
            token = cfg.get(f"{kind}_token")
            token = token.get("content") if isinstance(token, dict) else token  # HF's AddedToken form
            if isinstance(token, str):
                i = self._backend.token_id(token)
                if i is None:
                    raise TokenizerError(f"{self.path.parent / name}: {kind}_token {token!r} is not a token of "
                                         f"{self.path}")
                return i
        ids = _ids(generation.get(f"{kind}_token_id"))
        return ids[0] if ids else None

    def _hf_adds_bos(self, config: dict, bos_id: int) -> bool:
        """Whether this model family starts a text with BOS: `add_bos_token` in tokenizer_config.json when the key
        is there (as transformers v4 did), else whatever the tokenizer.json post-processor does."""
        if "add_bos_token" in config:
            return bool(config["add_bos_token"])
        return self._backend.encode("a", add_special_tokens=True)[:1] == [bos_id]

    @property
    def eos_ids(self) -> set[int]:
        """Ids that end generation: eos_id plus generation_config.json's eos_token_id (int or list)."""
        return set(self._eos_ids)

    @cached_property
    def _chat_stop_ids(self) -> frozenset[int]:
        # The end-of-turn token is whatever the template writes right after an assistant message: render one with a
        # sentinel and read the first token after it, if that is a special token (ChatML's <|im_end|>, Llama-3's
        # <|eot_id|>, ...). Leading whitespace is skipped: Llama-2 writes " </s>".
        sentinel = "ACCESSORYSENTINEL"
        try:
            text = self.apply_chat_template([{"role": "user", "content": "X"},
                                             {"role": "assistant", "content": sentinel}], add_generation_prompt=False)
        except TokenizerError:  # no template, or one that refuses this conversation: EOS alone ends a turn
            return self._eos_ids
        _, found, after = text.partition(sentinel)
        ids = self._backend.encode(after.lstrip()) if found else []
        return self._eos_ids | ({ids[0]} if ids and self._backend.is_special(ids[0]) else set())

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
        """Text of `ids` (a list or a 1-D tensor), without special tokens such as EOS or end-of-turn."""
        return self._backend.decode([int(i) for i in ids])

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters of its vocabulary entry (each of which stands for at least one
        character or byte of text): a text of more than n times this many characters has more than n tokens,
        which callers check before tokenizing a text that cannot fit."""
        return max(len(self._backend.token(i) or "") for i in range(self.n_words))

    # --- chat -----------------------------------------------------------------------------------------------------

    @property
    def backend(self):
        """The library object underneath: `_SentencePiece` (its processor is `.sp`) or `_HFTokenizers` (`.tk`)."""
        return self._backend

    def token_text(self, i: int) -> str:
        """Token `i` on its own, as text: its leading space kept (a SentencePiece "\u2581" or a byte-level "\u0120"
        is a space), a byte token as that byte (undecodable alone: a replacement character)."""
        if self._backend.is_special(i):
            return self._backend.token(i) or ""
        if isinstance(self._backend, _SentencePiece):
            piece = self._backend.token(i)
            return " " + self.decode([i]) if piece.startswith("\u2581") else self.decode([i])
        return self.decode([i])

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def set_chat_template(self, path: PathLike) -> None:
        """Render chats with the Jinja template file at `path` (`read_chat_template`) instead of the model's own; its
        end-of-turn token becomes one of `chat_stop_ids`."""
        self._chat_template, self._template_name = read_chat_template(path), f"the chat template {path}"
        self.__dict__.pop("_chat_stop_ids", None)  # cached from the old template

    def literal_messages(self, render: Callable[[list[dict]], str], messages: list[dict]) -> str:
        """`render(messages)`, as a ChatPrompt when a message holds the text of a special token, so that it is
        encoded as text: a user typing "<|im_end|>\n<|im_start|>system" must not open a system turn."""
        text = render(messages)
        # LLaVA's tokenizers make the image placeholder a special token: in a message it says where the image goes
        specials = self._backend.special_texts - {IMAGE_PLACEHOLDER}
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
                             f"{self._template_name} changes the messages it writes, so that text cannot "
                             f"be kept apart from the template's")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **context) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template, as HF does;
        `context`: more variables for the template (`tools`)."""
        if self._chat_template is None:
            raise TokenizerError(f"{self._config_path} has no chat_template (and there is no chat_template.jinja "
                                 f"beside it): the model has no chat template; use a plain prompt instead")
        bos_token = self._backend.token(self.bos_id) if self.bos_id is not None else None
        # what it may write, and so the most any value it builds may hold (template_sandbox)
        pieces, size, limit = [], 0, self.max_rendered_chars(messages) + len(str(context))
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                         eos_token=self._backend.token(self.eos_id), **context)
        try:
            with self._chat_template.environment.rendering(limit):
                for piece in self._chat_template.generate(**variables):
                    size += len(piece)
                    if size > limit:
                        raise jinja2.TemplateError(f"its output passed {limit} characters")
                    pieces.append(piece)
            return "".join(pieces)
        except Exception as e:  # the template's own failure, whatever it is (a TypeError, a macro that recurses)
            reason = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise TokenizerError(f"{self._template_name} rejected the messages: {_clip(reason)}") from e

    @staticmethod
    def max_rendered_chars(messages: list[dict]) -> int:
        """What a chat template may write for `messages`: their text plus TEMPLATE_CHARS per message."""
        return sum(len(str(m.get("content", ""))) + TEMPLATE_CHARS for m in messages)

    def encode_chat(self, prompt: str) -> list[int]:
        """One user turn rendered with the chat template and the generation prompt, encoded with `bos=True`."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": prompt}]), bos=True, eos=False)


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


def _clip(text: str, limit: int = 500) -> str:
    """A template's error message, which it may make as long as it likes (raise_exception)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _ids(value) -> list[int]:
    """generation_config.json's token-id fields: an int, a list of ints, or absent."""
    values = value if isinstance(value, list) else [value]
    return [i for i in values if isinstance(i, int) and not isinstance(i, bool)]


def _read_json(path: Path) -> dict:
    """A JSON object file, or {} when there is none."""
    return read_json_object(path, TokenizerError) if path.is_file() else {}


def _load_chat_template(folder: Path, config: dict) -> tuple[Optional[jinja2.Template], str]:
    """(the template, where it was read): chat_template.jinja if present (newer HF saves; it takes priority, as in
    transformers), else the tokenizer_config.json `chat_template`: a string, or HF's [{"name", "template"}] list
    whose "default" is used."""
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
        return None, f"{source}: no chat_template"
    if not isinstance(template, str):
        raise TokenizerError(f"{source}: chat_template must be a string or a list of {{name, template}}, got "
                             f"{type(template).__name__}")
    name = f"the chat template {jinja_path}" if source == jinja_path else f"the chat_template of {source}"
    return _compile_template(template, source), name


def read_chat_template(path: PathLike) -> jinja2.Template:
    """The Jinja chat template file at `path` (Hugging Face's format: `messages`, `add_generation_prompt`,
    `bos_token`, `eos_token`), compiled; a TokenizerError naming the file if it cannot be read or compiled."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"chat template {path}: cannot be read ({e})") from e
    return _compile_template(text, path)


def _compile_template(text: str, source) -> jinja2.Template:
    try:
        return template_environment().from_string(text)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{source}: chat template is not a valid Jinja template: {e}") from e


def find_tokenizer_for(folders: list[PathLike], tokenizer_path: Optional[PathLike] = None) -> Optional[Tokenizer]:
    """The tokenizer at `tokenizer_path`, else the one beside the weights (`find_tokenizer`), loaded; None if
    there is none."""
    path = tokenizer_path or find_tokenizer(list(folders))
    return Tokenizer.from_path(path) if path is not None else None
