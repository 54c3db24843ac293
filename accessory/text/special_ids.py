"""Which ids are special to a tokenizer: BOS and EOS (and whether `bos=True` adds BOS), the ids that end generation,
and the end-of-turn ids of its chat template. A SentencePiece model file states BOS and EOS itself; a tokenizer.json
takes them from the HF side files beside it: tokenizer_config.json, special_tokens_map.json, generation_config.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from accessory.errors import TokenizerError
from accessory.untrusted import read_json_object
from accessory.text.backends import Backend, HFTokenizersBackend, SentencePieceBackend


def read_side_file(path: Path) -> dict:
    """A JSON object file, or {} when there is none."""
    return read_json_object(path, TokenizerError) if path.is_file() else {}


def find_special_ids(path: Path, backend: Backend, config: dict, generation: dict) -> tuple[Optional[int], int, bool]:
    """(bos_id, eos_id, whether bos=True adds BOS) of the tokenizer file at `path`, read by `backend`; `config` and
    `generation`: its tokenizer_config.json and generation_config.json."""
    if isinstance(backend, SentencePieceBackend):
        # The model file is authoritative, and bos=True always prepends BOS, as in LLaMA2-Accessory.
        bos_id, eos_id, add_bos = backend.bos_id, backend.eos_id, backend.bos_id is not None
    else:
        special_map = read_side_file(path.parent / "special_tokens_map.json")
        bos_id = _hf_special_id("bos", path, backend, config, special_map, generation)
        eos_id = _hf_special_id("eos", path, backend, config, special_map, generation)
        add_bos = bos_id is not None and _hf_adds_bos(backend, config, bos_id)
    if eos_id is None:
        raise TokenizerError(f"{path}: no EOS token; expected one in the tokenizer, in eos_token of "
                             f"tokenizer_config.json / special_tokens_map.json, or in eos_token_id of "
                             f"generation_config.json beside it")
    return bos_id, eos_id, add_bos


def _hf_special_id(kind: str, path: Path, backend: HFTokenizersBackend, config: dict, special_map: dict,
                   generation: dict) -> Optional[int]:
    """BOS/EOS id of a tokenizer.json from `{kind}_token` in tokenizer_config.json or special_tokens_map.json,
    else `{kind}_token_id` of generation_config.json (its first entry when it lists several)."""
    for name, cfg in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        token = cfg.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token  # HF's AddedToken form
        if isinstance(token, str):
            i = backend.token_id(token)
            if i is None:
                raise TokenizerError(f"{path.parent / name}: {kind}_token {token!r} is not a token of {path}")
            return i
    ids = _token_ids(generation.get(f"{kind}_token_id"))
    return ids[0] if ids else None


def _hf_adds_bos(backend: HFTokenizersBackend, config: dict, bos_id: int) -> bool:
    """Whether this model family starts a text with BOS: `add_bos_token` in tokenizer_config.json when the key
    is there (as transformers v4 did), else whatever the tokenizer.json post-processor does."""
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    return backend.encode("a", add_special_tokens=True)[:1] == [bos_id]


def find_eos_ids(eos_id: int, generation: dict) -> frozenset[int]:
    """Ids that end generation: `eos_id` plus generation_config.json's eos_token_id (int or list)."""
    return frozenset([eos_id, *_token_ids(generation.get("eos_token_id"))])


def _token_ids(value) -> list[int]:
    """generation_config.json's token-id fields: an int, a list of ints, or absent."""
    values = value if isinstance(value, list) else [value]
    return [i for i in values if isinstance(i, int) and not isinstance(i, bool)]


def find_chat_stop_ids(render_turn: Callable[[list[dict]], str], backend: Backend,
                       eos_ids: frozenset[int]) -> frozenset[int]:
    """`eos_ids` plus the end-of-turn id of the chat template `render_turn` renders a conversation with (without
    the generation prompt); `eos_ids` alone when there is no template or it refuses the conversation."""
    # The end-of-turn token is whatever the template writes right after an assistant message: render one with a
    # sentinel and read the first token after it, if that is a special token (ChatML's <|im_end|>, Llama-3's
    # <|eot_id|>, ...). Leading whitespace is skipped: Llama-2 writes " </s>".
    sentinel = "ACCESSORYSENTINEL"
    try:
        text = render_turn([{"role": "user", "content": "X"}, {"role": "assistant", "content": sentinel}])
    except TokenizerError:  # no template, or one that refuses this conversation: EOS alone ends a turn
        return eos_ids
    _, found, after = text.partition(sentinel)
    ids = backend.encode(after.lstrip()) if found else []
    return eos_ids | ({ids[0]} if ids and backend.is_special(ids[0]) else set())
