"""llama.cpp GGUF files (architectures llama, qwen2, qwen3, gemma3; mixtures: llama with experts (Mixtral),
qwen3moe) -> canonical form, dequantized to float32 by the `gguf` package, or
with `keep_quantized` keeping Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K matrices' bits in our formats
(quant/formats.py):

| GGUF block (values)              | ours  | q                      | scale | min        |
|----------------------------------|-------|------------------------|-------|------------|
| Q8_0 (32): d fp16, 32 x int8     | int8  | the int8 values        | d     |            |
| Q4_1 (32): d, m fp16, 16 bytes   | int4  | the 16 bytes           | d     | m          |
| Q4_0 (32): d fp16, 16 bytes      | int4  | the 16 bytes           | d     | -8 * d     |
| Q5_0 (32), Q4_K, Q5_K, Q6_K (256) | q5_0, q4_k, q5_k, q6_k | the whole blocks |   |          |

The nibble order within a block is ours too, so nothing is repacked, and every value dequantizes to exactly what
the `gguf` package gives (d * q + m, d * q - 8 * d and d * q are all exact or rounded once alike). The other four
are import-only formats that hold the file's blocks byte for byte (4.5 to 6.6 bits a weight). Other types (and
1-D tensors) are dequantized.

For architecture "llama" (Mistral's files say so too), llama.cpp's converter permutes HF's q/k back to Meta's
interleaved RoPE layout before writing, so attn_q / attn_k are taken as they are (tests/checkpoint/test_importers.py
pins this against transformers' GGUF loader, which applies the HF permutation on top of the stored tensors). qwen2,
qwen3 and gemma3 run on llama.cpp's NEOX RoPE: their q/k stay in HF's rotate-half layout and are permuted here, as
from HF; gemma3's norm weights were stored as 1 + w (families.py says what each architecture needs).

Nothing is dequantized while reading: the weights are LazyTensors over the memory-mapped file, each tensor made
when the writer reads it, a few rows at a time, so `convert gguf` peaks at its output plus one tensor.

A mixture's experts are stacked by llama.cpp into one tensor per projection and layer (`ffn_gate_exps` (E, out,
in)); they are split into one matrix per expert (a quantized stack into each expert's blocks, kept as they are).
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from accessory.checkpoint.importers.common import (ImportedModel, LazyTensors, check_shapes, expand_templates,
                                                   rename_strict, validated_args)
from accessory.checkpoint.importers.families import gguf_family, with_family_names, without_dense_mlp
from accessory.checkpoint.importers.hf import hf_to_meta_qk, rotate_half_to_interleaved
from accessory.errors import AccessoryError, CheckpointError, ConfigError, listing
from accessory.network.config import FIELD_RANGES, MOE_KEYS
from accessory.network.components import base_frequencies, llama3_scaled
from accessory.network.config import LLAMA3_ROPE_DEFAULTS
from accessory.quant.formats import GGUF_BLOCKS, part_shapes
from accessory.untrusted import decoded, integer, number, shown

# GGUF name -> canonical name; `{i}` is the layer index.
GGUF_TO_META = {
    "token_embd.weight": "tok_embeddings.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attention.wq.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attention.wk.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attention.wv.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attention.wo.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.feed_forward.w1.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.feed_forward.w2.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.feed_forward.w3.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attention_norm.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
# llama.cpp's stacked experts of a layer: blk.N.ffn_{gate,down,up}_exps.weight, (E, out, in); split into the
# per-expert names blk.N.ffn_{gate,down,up}.E.weight (families.MOE_GGUF).
STACKED_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|down|up)_exps\.weight")
# llama.cpp stores Llama-3.1-style rope scaling as this tensor of per-frequency divisors, not as metadata.
ROPE_FREQS = "rope_freqs.weight"
MAX_EXPERTS = MOE_KEYS["num_experts"][2]
_REQUIRED = object()


def read_gguf(path, workdir, keep_quantized: bool = False) -> ImportedModel:
    """Read a llama.cpp GGUF file of a known architecture (llama, qwen2, qwen3, gemma3: families.py): weights
    dequantized to float32 under canonical names (no `output.weight` when the file has none, i.e. tied embeddings),
    the config from its `ARCH.*` metadata, and the tokenizer rebuilt by transformers from the file's metadata and
    saved into `workdir` (tokenizer.json, tokenizer_config.json, chat_template.jinja when the file has one, and a
    generation_config.json holding the bos / eos / pad token ids). `keep_quantized`: matrices of the types in
    KEPT_TYPES stay quantized (their parts under `NAME.q`, ...; the formats in `ImportedModel.quantization`).

    The weights are LazyTensors over the memory-mapped file: names, shapes and types are checked here, and each
    tensor is dequantized (or its blocks copied) when it is read, so a writer holds one at a time beside its
    output. A malformed or hostile file is refused with a CheckpointError or ConfigError naming the file, the key
    or tensor and the value (open_gguf, METADATA_CHECKS)."""
    path, workdir = Path(path), Path(workdir)
    reader = open_gguf(path)
    with _malformed(path):  # the pre-check bounds the layout, not every value: what gguf still raises names the file
        config, family, renamed = _model_of(reader, path, keep_quantized)
    tokenizer_files = _save_tokenizer(reader, path, workdir)
    return ImportedModel(state_dict=_state_dict(renamed), config=config, tokenizer_files=tokenizer_files,
                         llama_type=family.llama_type,
                         quantization={name: value.fmt for name, value in renamed.items() if value.fmt})


def _model_of(reader: gguf.GGUFReader, path: Path, keep_quantized: bool) -> tuple[dict, Any, dict[str, Pending]]:
    """The config, the family and the canonical tensors (Pending) of an opened file."""
    architecture = _field(reader, "general.architecture", str(path), None)
    family = gguf_family(architecture, _field(reader, f"{architecture}.expert_count", str(path), 0), str(path))
    config = config_from_gguf(reader, str(path), family)
    weights = _pending_tensors(reader, path, keep_quantized)
    rope_freqs = weights.pop(ROPE_FREQS, None)
    if rope_freqs is not None:
        if config["rope_scaling"] is not None:
            raise ConfigError(f"{path}: has both {ROPE_FREQS} and rope.scaling metadata; expected one")
        config["rope_scaling"] = llama3_scaling_from_freqs(rope_freqs.make().numpy(), config, str(path))
    config["tie_word_embeddings"] = "output.weight" not in weights
    args = validated_args(config, source=str(path), llama_type=family.llama_type)
    _check_layer_count(args, len(weights), family.gguf_arch, path)
    base = without_dense_mlp(GGUF_TO_META) if family.is_moe else GGUF_TO_META
    names = expand_templates(with_family_names(base, family.gguf_names), args.n_layers,
                             args.experts.num_experts if args.experts else 0)
    renamed = rename_strict(weights, names, str(path), optional=frozenset({"output.weight"}))
    check_shapes({name: value.shape for name, value in renamed.items()}, args, str(path), family.llama_type)
    _undo_converter(renamed, args, family)
    return config, family, renamed


def _check_layer_count(args, n_tensors: int, arch: str, path: Path) -> None:
    """Each layer (each expert of each layer) has tensors of its own: a block_count (x expert_count) beyond the
    file's tensors is refused before a name table of that size is made."""
    experts = args.experts.num_experts if args.experts else 1
    if args.n_layers * experts > n_tensors:
        counted = f" x {arch}.expert_count {experts}" if args.experts else ""
        raise CheckpointError(f"{path}: {arch}.block_count {args.n_layers}{counted} asks for more layers than the "
                              f"file's {n_tensors} tensors can hold")


@dataclass(frozen=True)
class Pending:
    """A GGUF tensor not read yet: `make()` gives it as float32 (dequantized) or, with `fmt` (our format), as a Kept
    matrix. Its float `shape` is known from the file's header alone."""
    make: Callable[[], Any]
    shape: tuple
    fmt: Optional[str] = None

    def then(self, step: Callable[[Any], Any]) -> "Pending":
        """This tensor with `step` applied to it once it is made."""
        make = self.make
        return replace(self, make=lambda: step(make()))


def _state_dict(weights: dict[str, Pending]) -> LazyTensors:
    """Canonical name -> its tensor, made on each read; a Kept matrix's parts under NAME.q, NAME.scale, ... (each
    part read alone makes the matrix's parts and keeps that one: they are its bytes, copied)."""
    recipes, shapes = {}, {}
    for name, value in weights.items():
        if value.fmt is None:
            recipes[name], shapes[name] = value.make, value.shape
            continue
        for part, shape in part_shapes(value.fmt, *value.shape).items():
            recipes[f"{name}.{part}"], shapes[f"{name}.{part}"] = partial(_kept_part, value.make, part), shape
    return LazyTensors(recipes, shapes)


def _kept_part(make: Callable[[], "Kept"], part: str) -> torch.Tensor:
    return make().parts[part]


def _undo_converter(weights: dict[str, Pending], args, family) -> None:
    """Undo what llama.cpp's converter did to this architecture's tensors, when each is made: q/k kept in HF's
    rotate-half layout (permuted to Meta's, as from HF; a kept matrix's rows are permuted in every part), and norm
    weights shifted (Gemma's stored as 1 + w)."""
    if family.gguf_rotate_half:
        rotate_half_to_interleaved(weights, args, lambda value, heads: value.then(partial(_permuted_qk, heads=heads)))
    if family.gguf_norm_shift:
        shift = family.gguf_norm_shift
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name].then(lambda w: w - shift)


def _permuted_qk(value, heads: int):
    if not isinstance(value, Kept):
        return hf_to_meta_qk(value, heads)
    order = hf_to_meta_qk(torch.arange(value.shape[0]), heads)  # new row i is old row order[i]
    return Kept(value.fmt, {name: part[order] for name, part in value.parts.items()}, value.shape)


def config_from_gguf(reader: gguf.GGUFReader, source: str, family) -> dict:
    """Our config dict from the `ARCH.*` metadata (tie_word_embeddings is decided by the tensors, set later), with
    the family's own keys. Each value is checked as it is read (METADATA_CHECKS), before any arithmetic on it."""
    meta = lambda key, default=_REQUIRED: _field(reader, key, source, default)  # noqa: E731
    arch = family.gguf_arch
    dim, n_heads = meta(f"{arch}.embedding_length"), meta(f"{arch}.attention.head_count")
    n_kv_heads = meta(f"{arch}.attention.head_count_kv", n_heads)
    if n_heads % n_kv_heads:
        raise ConfigError(f"{source}: {arch}.attention.head_count {n_heads} is not a multiple of "
                          f"{arch}.attention.head_count_kv {n_kv_heads}")
    head_dim = meta(f"{arch}.attention.key_length", None) or _even_split(dim, n_heads, arch, source)
    if meta(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{source}: {arch}.attention.value_length differs from key_length {head_dim}; not "
                          f"supported")
    rope_dims = meta(f"{arch}.rope.dimension_count", None)
    if rope_dims is not None and rope_dims != head_dim:
        raise ConfigError(f"{source}: {arch}.rope.dimension_count {rope_dims} differs from the head dim "
                          f"{head_dim}; partial rotary is not supported")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab_size = meta(f"{arch}.vocab_size", len(tokens.data) if tokens is not None else _REQUIRED)
    config = {
        "dim": dim,
        "n_layers": meta(f"{arch}.block_count"),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": vocab_size,
        # a mixture's files may give only each expert's hidden size (family.gguf_config reads it)
        "hidden_dim": meta(f"{arch}.feed_forward_length", None if family.is_moe else _REQUIRED),
        # GGUF stores these as float32; recover the decimal they were written from (9.99999975e-06 -> 1e-05).
        "norm_eps": _from_f32(meta(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _from_f32(meta(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, source),
        "tie_word_embeddings": False,
        "max_seq_len": meta(f"{arch}.context_length"),
        **({"head_dim": head_dim} if head_dim != dim // n_heads else {}),
    }
    return {**config, **family.gguf_config(meta, {**config, "head_dim": head_dim}, source)}


def _even_split(dim: int, n_heads: int, arch: str, source: str) -> int:
    """The head size of a file without key_length: dim / n_heads, which must divide evenly."""
    if dim % n_heads:
        raise ConfigError(f"{source}: {arch}.embedding_length {dim} is not a multiple of {arch}.attention.head_count "
                          f"{n_heads}, and no {arch}.attention.key_length gives the head size")
    return dim // n_heads


def _rope_scaling(meta, arch: str, source: str) -> Optional[dict]:
    kind = meta(f"{arch}.rope.scaling.type", None)
    factor = meta(f"{arch}.rope.scaling.factor", None)
    if kind is None and meta(f"{arch}.rope.scale_linear", 1.0) != 1.0:  # older llama.cpp files
        kind, factor = "linear", meta(f"{arch}.rope.scale_linear")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ConfigError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported; expected 'linear', 'yarn' "
                          f"or 'none' (llama3 scaling comes as a {ROPE_FREQS} tensor)")
    if factor is None:
        raise ConfigError(f"{source}: {arch}.rope.scaling.type is {kind!r} but {arch}.rope.scaling.factor is missing")
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": _from_f32(factor),
                "original_max_position_embeddings": meta(f"{arch}.rope.scaling.original_context_length")}
    return {"rope_type": "linear", "factor": _from_f32(factor)}


def llama3_rope_factors(head_dim: int, theta: float, **scaling) -> np.ndarray:
    """Per-frequency divisors of Meta's llama3 rope scaling, as llama.cpp's converter writes them to rope_freqs."""
    freqs = base_frequencies(head_dim, theta, torch.float64)
    return (freqs / llama3_scaled(freqs, **scaling)).numpy()


def llama3_scaling_from_freqs(rope_freqs: np.ndarray, config: dict, source: str) -> dict:
    """Recover our llama3 rope_scaling dict from a rope_freqs tensor. GGUF keeps only the resulting divisors, so we
    take the factor from their maximum, assume Meta's other constants, and refuse when they do not reproduce it."""
    head_dim = config["dim"] // config["n_heads"]
    scaling = {"rope_type": "llama3", **LLAMA3_ROPE_DEFAULTS, "factor": _from_f32(float(rope_freqs.max()))}
    expected = llama3_rope_factors(head_dim, config["rope_theta"], **{k: v for k, v in scaling.items()
                                                                      if k != "rope_type"})
    if rope_freqs.shape != expected.shape or not np.allclose(rope_freqs, expected, rtol=1e-4, atol=0):
        raise ConfigError(f"{source}: {ROPE_FREQS} {tuple(rope_freqs.shape)} does not match llama3 rope scaling "
                          f"with {scaling} (head dim {head_dim}, rope_theta {config['rope_theta']}); other "
                          f"per-frequency rope factors are not supported")
    return scaling


@dataclass(frozen=True)
class Kept:
    """A GGUF matrix whose quantized bits are kept: its parts in one of our formats, and its float shape."""
    fmt: str
    parts: dict
    shape: tuple


# GGUF block type -> (our format, bytes per block); Q8_0 / Q4_0 / Q4_1 blocks hold 32 values, as do our groups.
KEPT_TYPES = {"Q8_0": ("int8", 34), "Q4_0": ("int4", 18), "Q4_1": ("int4", 20),
              **{fmt.upper(): (fmt, nbytes) for fmt, (_, nbytes) in GGUF_BLOCKS.items()}}


def kept_parts(data: np.ndarray, type_name: str) -> dict[str, torch.Tensor]:
    """Our format's parts from a GGUF matrix's raw blocks `data` (rows, bytes per row), without dequantizing. Every
    part holds the matrix's rows as its rows, so reordering rows indexes each part alike."""
    fmt, block = KEPT_TYPES[type_name]
    if fmt in GGUF_BLOCKS:  # the blocks as they are
        return {"q": torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))}
    blocks = np.ascontiguousarray(data).reshape(data.shape[0], -1, block)  # (rows, groups, block bytes)
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])  # (rows, groups)
    if type_name == "Q8_0":
        return {"q": torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(data.shape[0], -1)),
                "scale": scale}
    if type_name == "Q4_1":
        minimum = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        q = blocks[..., 4:]
    else:  # Q4_0: d * (q - 8) = d * q + (-8 d); -8 d is exact in float16
        minimum, q = (scale.float() * -8).half(), blocks[..., 2:]
    return {"q": torch.from_numpy(q.copy().reshape(data.shape[0], -1)), "scale": scale, "min": minimum}


def _pending_tensors(reader: gguf.GGUFReader, path: Path, keep_quantized: bool) -> dict[str, Pending]:
    """GGUF name -> its tensor, Pending (nothing is read yet); stacked experts split into one per expert."""
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions fastest-first
        stacked = STACKED_EXPERTS.fullmatch(t.name)
        if stacked and len(shape) == 3 and shape[0] > MAX_EXPERTS:
            raise CheckpointError(f"{path}: tensor {t.name} stacks {shape[0]} experts; at most {MAX_EXPERTS} were "
                                  f"expected")
        if stacked and len(shape) == 3:
            data = np.asarray(t.data).reshape(shape[0], shape[1], -1)  # (experts, rows, row values or bytes)
            for e in range(shape[0]):
                name = f"blk.{stacked.group(1)}.ffn_{stacked.group(2)}.{e}.weight"
                weights[name] = _pending(data[e], t.tensor_type.name, shape[1:], name, path, keep_quantized)
        else:
            weights[t.name] = _pending(t.data, t.tensor_type.name, shape, t.name, path, keep_quantized)
    return weights


def _pending(data: np.ndarray, type_name: str, shape: tuple, name: str, path: Path, keep_quantized: bool) -> Pending:
    """One tensor, to be made as its blocks Kept (a quantized matrix, `keep_quantized`) or as float32."""
    if keep_quantized and type_name in KEPT_TYPES and len(shape) == 2:
        fmt = KEPT_TYPES[type_name][0]
        return Pending(lambda: Kept(fmt, kept_parts(data, type_name), shape), shape, fmt)
    rows = data.reshape(-1, data.shape[-1])  # (rows, bytes or values a row); a 1-D tensor is one row
    _dequantize(rows[:1], type_name, name, path)  # a type gguf cannot read fails now, before anything is written
    return Pending(partial(_dequantized, rows, type_name, shape, name, path), shape)


# Values dequantized at a time: gguf's numpy dequantization makes temporaries bigger than what it returns (a Q5_0
# embedding of 151936 x 896, 519 MiB as float32, peaks 600 MiB above that when dequantized at once).
DEQUANTIZE_VALUES = 1 << 22


def _dequantized(rows: np.ndarray, type_name: str, shape: tuple, name: str, path: Path) -> torch.Tensor:
    """A tensor's `rows` (its raw blocks or values) as float32 of `shape`, dequantized a few rows at a time."""
    out = np.empty((rows.shape[0], math.prod(shape) // rows.shape[0]), np.float32)
    step = max(1, DEQUANTIZE_VALUES // out.shape[1])
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = _dequantize(rows[start:start + step], type_name, name, path)
    return torch.from_numpy(out.reshape(shape))


def _dequantize(data: np.ndarray, type_name: str, name: str, path: Path) -> np.ndarray:
    try:
        return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])  # float32, (rows, values)
    except NotImplementedError as e:
        raise CheckpointError(f"{path}: tensor {name} has type {type_name}, which gguf "
                              f"{getattr(gguf, '__version__', '')} cannot dequantize: {e}") from e


def _save_tokenizer(reader: gguf.GGUFReader, path: Path, workdir: Path) -> list[Path]:
    # Imported here: transformers takes seconds to import, and only this step needs it.
    from transformers import AutoTokenizer
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises assorted types for metadata it cannot convert
        model = _field(reader, "tokenizer.ggml.model", str(path), None)
        raise CheckpointError(f"{path}: transformers cannot build a tokenizer from its metadata "
                              f"(tokenizer.ggml.model={model!r}): {e}") from e
    files = [Path(f) for f in tokenizer.save_pretrained(str(workdir))]
    files.append(_save_generation_config(reader, path, workdir))
    return [f for f in dict.fromkeys(files) if f.is_file()]


def _save_generation_config(reader: gguf.GGUFReader, path: Path, workdir: Path) -> Path:
    """generation_config.json with the special token ids: the end-of-turn / end-of-message ids (Llama 3) join
    eos_token_id, so a runtime that stops on it stops where llama.cpp does."""
    meta = lambda key: _field(reader, key, str(path), None)  # noqa: E731
    eos = [meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    values = {"bos_token_id": meta("tokenizer.ggml.bos_token_id"),
              "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
              "pad_token_id": meta("tokenizer.ggml.padding_token_id")}
    target = workdir / "generation_config.json"
    target.write_text(json.dumps({k: v for k, v in values.items() if v is not None}, indent=2) + "\n")
    return target


def _field(reader: gguf.GGUFReader, key: str, source: str, default: Any = _REQUIRED) -> Any:
    """Metadata `key`'s value, its text decoded strictly and checked by METADATA_CHECKS; `default` (not checked) if
    the file has no such key."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ConfigError(f"{source}: GGUF metadata key {key!r} is missing")
        return default
    check = METADATA_CHECKS.get(key) or METADATA_CHECKS.get(key.partition(".")[2])
    value = _contents(field, key, source)
    return value if check is None else check(value, source, key)


def _contents(field, key: str, source: str) -> Any:
    """A field's value; text decoded strictly (gguf's own `contents()` raises UnicodeDecodeError on bad bytes)."""
    if field.types.count(gguf.GGUFValueType.ARRAY) > 1:
        raise ConfigError(f"{source}: metadata key {key!r} holds nested arrays; a value or a flat array was expected")
    if field.types[-1] != gguf.GGUFValueType.STRING:
        return field.contents()
    texts = [decoded(field.parts[i].tobytes(), f"{source}: metadata key {key!r}", CheckpointError) for i in field.data]
    return texts if field.types[0] == gguf.GGUFValueType.ARRAY else texts[0]


def _one_value(value, key: str, source: str):
    """A per-layer array that must hold one value throughout (llama.cpp writes some counts per layer)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"{source}: {key} differs between layers ({value}); not supported")
        return value[0]
    return value


def _from_f32(value: float) -> float:
    return float(str(np.float32(value)))


# ---- the metadata values read, checked -------------------------------------------------------------------------

def _ranged(field: str, low: Optional[int] = None) -> Callable:
    """A check that a value is within our config field's range (network/config.py), from `low` if given."""
    kind, field_low, high = {**FIELD_RANGES, **MOE_KEYS}[field]
    low = field_low if low is None else low
    if kind is int:
        return lambda value, source, key: integer(value, source, key, ConfigError, low, high)
    return lambda value, source, key: number(value, source, key, ConfigError, low, high)


def _per_layer(check: Callable) -> Callable:
    """`check` of a value llama.cpp may write once per layer (then it must be one value throughout)."""
    return lambda value, source, key: check(_one_value(value, key, source), source, key)


def _positive(value, source: str, key: str) -> float:
    return number(value, source, key, ConfigError, above=0.0)


def _natural(value, source: str, key: str) -> int:
    return integer(value, source, key, ConfigError, 0, (1 << 31) - 1)  # llama.cpp reads these as 32-bit


def _flag(value, source: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {shown(value)}")
    return value


def _text(limit: int) -> Callable:
    def check(value, source: str, key: str) -> str:
        if not isinstance(value, str) or len(value) > limit:
            raise ConfigError(f"{source}: {key} must be text of at most {limit} characters, got {shown(value)}")
        return value
    return check


# The metadata keys read (by config_from_gguf, families.py's gguf_config and the tokenizer step) -> the check of the
# file's value: its type, finite, in range. `ARCH.KEY` keys are listed by KEY. A head_count of 0 divided the
# embedding length, a string one failed in arithmetic, a yarn factor of 0 reached log(0).
METADATA_CHECKS = {
    "general.architecture": _text(64), "tokenizer.ggml.model": _text(64),
    **{f"tokenizer.ggml.{name}_token_id": _natural for name in ("bos", "eos", "eot", "eom", "padding")},
    "embedding_length": _ranged("dim"), "block_count": _ranged("n_layers"),
    "feed_forward_length": _ranged("hidden_dim"), "expert_feed_forward_length": _ranged("hidden_dim"),
    "attention.head_count": _ranged("n_heads"), "attention.head_count_kv": _per_layer(_ranged("n_kv_heads")),
    "attention.key_length": _ranged("head_dim"), "attention.value_length": _ranged("head_dim"),
    "rope.dimension_count": _ranged("head_dim"), "vocab_size": _ranged("vocab_size", low=1),
    "context_length": _ranged("max_seq_len"), "rope.scaling.original_context_length": _ranged("max_seq_len"),
    "attention.sliding_window": _ranged("sliding_window"), "attention.layer_norm_rms_epsilon": _ranged("norm_eps"),
    "rope.freq_base": _ranged("rope_theta"), "final_logit_softcapping": _ranged("final_logit_softcapping"),
    "rope.scaling.type": _text(64), "rope.scaling.factor": _positive, "rope.scale_linear": _positive,
    "expert_count": _ranged("num_experts", low=0), "expert_used_count": _ranged("num_experts_per_tok"),
    "expert_shared_count": _natural, "expert_gating_func": _natural, "expert_weights_norm": _flag,
}


# ---- the layout, checked before gguf's reader trusts it ---------------------------------------------------------
# gguf's reader believes every count it reads: an array declaring 2^60 elements makes it loop 2^60 times (a read past
# the end of the map gives an empty array, not an error), 20,000 nested arrays overflow its recursion, a short header
# raises IndexError. So the header, the metadata and the tensor index are walked here first, checking only lengths
# and counts against the bytes left; gguf still does the reading.

HEADER_BYTES = 24  # magic, version (u32), tensor count, metadata count (u64)
# GGUFValueType -> bytes of one value (STRING and ARRAY have their own lengths)
VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = int(gguf.GGUFValueType.STRING), int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.UINT32)
ELEMENT_BYTES = {**VALUE_BYTES, STRING: 8, ARRAY: 12}  # the least an array element takes (a string: its length)
MIN_ENTRY_BYTES = 13  # a metadata entry: name length (8), type (4), at least a 1-byte value
MIN_TENSOR_BYTES = 32  # a tensor entry: name length, dimension count, one dimension, type, offset
MAX_NESTING = 8  # arrays within arrays: real files nest 1 deep (a list of strings or numbers)
MAX_NAME_BYTES = 65535  # GGUF's limit on a key's name (and ours on a tensor's: llama.cpp's is 64)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSORS = 1 << 16  # real files hold a few thousand at most (a layer's experts are stacked in one)
# gguf's reader makes numpy arrays of every metadata value (about 20 us and 0.9 kB each): Gemma 3's 262k-token
# vocabulary (tokens, scores, types) is 786k values, a 256k-token BPE vocabulary with its merges about 1.02M. More
# are refused before the reader spends minutes and gigabytes on them.
MAX_METADATA_VALUES = 1_500_000
QUANT_TYPES = {int(kind): kind for kind in GGML_QUANT_SIZES}


def open_gguf(path: Path) -> gguf.GGUFReader:
    """gguf's reader of `path` once check_layout has passed it; CheckpointError naming the file for anything else
    the reader finds malformed."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    check_layout(path)
    with _malformed(path):
        return gguf.GGUFReader(path)


@contextlib.contextmanager
def _malformed(path: Path):
    """What gguf (or numpy under it) raises on a malformed file, as a CheckpointError naming the file."""
    try:
        yield
    except AccessoryError:
        raise
    except (ValueError, IndexError, KeyError, struct.error, RecursionError, OverflowError, MemoryError,
            OSError) as e:
        raise CheckpointError(f"{path}: cannot read as GGUF ({type(e).__name__}: {shown(str(e), 200)})") from e


def check_layout(path: Path) -> None:
    """Refuse (CheckpointError naming the file, the key or tensor, and the count) a GGUF file whose header,
    metadata or tensor index declares more than the file holds, nests arrays deeper than MAX_NESTING, holds more
    than MAX_METADATA_VALUES values or MAX_TENSORS tensors, names a key or tensor in bytes that are not UTF-8 or
    twice, or places a tensor's data past its end. A walk over lengths and counts only: fast on real files."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < HEADER_BYTES:
                raise CheckpointError(f"{path}: {size} bytes; a GGUF file starts with a {HEADER_BYTES}-byte header "
                                      f"(magic, version, tensor count, metadata count)")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check_walk(_Layout(data, path))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e


def _check_walk(layout: "_Layout") -> None:
    n_tensors, n_keys = layout.header()
    if n_keys > MAX_METADATA_VALUES or n_tensors > MAX_TENSORS:
        raise CheckpointError(f"{layout.path}: header: {n_keys} metadata keys and {n_tensors} tensors; at most "
                              f"{MAX_METADATA_VALUES} and {MAX_TENSORS} were expected")
    layout.room(n_keys * MIN_ENTRY_BYTES, lambda: f"header: {n_keys} metadata keys")
    alignment = _check_metadata(layout, n_keys)
    layout.room(n_tensors * MIN_TENSOR_BYTES, lambda: f"header: {n_tensors} tensors")
    _check_tensor_index(layout, n_tensors, alignment)


class _Layout:
    """A cursor over a GGUF file's bytes that refuses, naming the file and what it was reading, to step past the
    end."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos, self.order, self.values = data, path, 0, "<", 0

    def header(self) -> tuple[int, int]:
        """The tensor and metadata counts, after the magic and a version gguf can read (and the byte order)."""
        if self.data[:4] != b"GGUF":
            raise CheckpointError(f"{self.path}: starts with {shown(bytes(self.data[:4]))}; a GGUF file starts with "
                                  f"b'GGUF'")
        version = struct.unpack_from("<I", self.data, 4)[0]
        if version & 0xFFFF == 0:  # written on a big-endian machine, as gguf's reader decides
            self.order, version = ">", struct.unpack_from(">I", self.data, 4)[0]
        if version not in READER_SUPPORTED_VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version}; versions {READER_SUPPORTED_VERSIONS} can be "
                                  f"read")
        self.pos = HEADER_BYTES
        return struct.unpack_from(self.order + "QQ", self.data, 8)

    def left(self) -> int:
        return len(self.data) - self.pos

    def room(self, size: int, what: Callable[[], str]) -> None:
        """Refuse `what()` if it needs more than the `size` bytes left."""
        if size > self.left():
            raise CheckpointError(f"{self.path}: {what()}: {size} bytes needed, but only {self.left()} remain in the "
                                  f"file ({len(self.data)} bytes)")

    def skip(self, size: int, what: Callable[[], str]) -> int:
        self.room(size, what)
        self.pos += size
        return self.pos - size

    def uint(self, size: int, what: Callable[[], str]) -> int:
        start = self.skip(size, what)
        return int.from_bytes(self.data[start:start + size], "little" if self.order == "<" else "big")

    def name(self, what: str) -> str:
        """A key's or tensor's name: a GGUF string of at most MAX_NAME_BYTES, strictly UTF-8."""
        length = self.uint(8, lambda: f"{what}'s length")
        if length > MAX_NAME_BYTES:
            raise CheckpointError(f"{self.path}: {what} is {length} bytes long; at most {MAX_NAME_BYTES} were expected")
        start = self.skip(length, lambda: f"{what} ({length} bytes)")
        return decoded(self.data[start:start + length], f"{self.path}: {what}", CheckpointError)

    def strings(self, count: int, key: str) -> None:
        """Step over an array of `count` strings, each length read and bounded (cheap reads in a loop: Gemma 3's
        262k tokens take a fraction of a second)."""
        length_of, data, pos, end = struct.Struct(self.order + "Q").unpack_from, self.data, self.pos, len(self.data)
        for index in range(count):
            if pos + 8 > end:
                raise CheckpointError(f"{self.path}: metadata key {key!r}: string #{index} of {count} starts at byte "
                                      f"{pos}, past the end of the file ({end} bytes)")
            length = length_of(data, pos)[0]
            pos += 8 + length
            if pos > end:
                raise CheckpointError(f"{self.path}: metadata key {key!r}: string #{index} of {count} is {length} "
                                      f"bytes long, but only {end - pos + length} remain in the file ({end} bytes)")
        self.pos = pos

    def count_values(self, count: int, what: str) -> None:
        self.values += count
        if self.values > MAX_METADATA_VALUES:
            raise CheckpointError(f"{self.path}: {what}: {count} values bring the metadata past "
                                  f"{MAX_METADATA_VALUES} values (array elements counted); at most that many are read")


def _check_metadata(layout: _Layout, count: int) -> int:
    """Step over `count` metadata entries; the data alignment they set (general.alignment, else gguf's 32)."""
    alignment, seen = gguf.GGUF_DEFAULT_ALIGNMENT, set()
    for index in range(count):
        key = _new_name(layout, seen, "metadata key", index)
        kind = layout.uint(4, lambda: f"metadata key {key!r}'s type")
        start = layout.pos
        _check_value(layout, kind, key, 0)
        if key == "general.alignment":
            alignment = _alignment(layout, kind, start)
    return alignment


def _new_name(layout: _Layout, seen: set, kind: str, index: int) -> str:
    """Entry `index`'s name (a metadata key's, a tensor's), refused if an earlier entry had it."""
    name = layout.name(f"{kind} #{index}'s name")
    if name in seen:
        raise CheckpointError(f"{layout.path}: {kind} {name!r} appears twice; each {kind.split()[-1]} once was "
                              f"expected")
    seen.add(name)
    return name


def _check_value(layout: _Layout, kind: int, key: str, depth: int) -> None:
    layout.count_values(1, f"metadata key {key!r}")
    if kind in VALUE_BYTES:
        layout.skip(VALUE_BYTES[kind], lambda: f"metadata key {key!r}'s value")
    elif kind == STRING:
        layout.strings(1, key)
    elif kind == ARRAY:
        _check_array(layout, key, depth + 1)
    else:
        raise _unknown_type(layout, key, kind)


def _check_array(layout: _Layout, key: str, depth: int) -> None:
    """Step over an array (its element type, count, elements), nested `depth` deep."""
    if depth > MAX_NESTING:
        raise CheckpointError(f"{layout.path}: metadata key {key!r} nests arrays more than {MAX_NESTING} deep; real "
                              f"files nest them 1 deep")
    kind = layout.uint(4, lambda: f"metadata key {key!r}'s array type")
    count = layout.uint(8, lambda: f"metadata key {key!r}'s array length")
    if kind not in ELEMENT_BYTES:
        raise _unknown_type(layout, key, kind)
    layout.room(count * ELEMENT_BYTES[kind], lambda: f"metadata key {key!r}: an array of {count} "
                                                     f"{gguf.GGUFValueType(kind).name} values")
    layout.count_values(count, f"metadata key {key!r}")
    if kind == STRING:
        layout.strings(count, key)
    elif kind == ARRAY:
        for _ in range(count):
            _check_array(layout, key, depth + 1)
    else:
        layout.pos += count * ELEMENT_BYTES[kind]  # room() above made sure they are there


def _unknown_type(layout: _Layout, key: str, kind: int) -> CheckpointError:
    known = ", ".join(f"{int(t)} ({t.name})" for t in gguf.GGUFValueType)
    return CheckpointError(f"{layout.path}: metadata key {key!r} has value type {kind}; the known types are {known}")


def _alignment(layout: _Layout, kind: int, start: int) -> int:
    """general.alignment's value: gguf's reader takes a UINT32 power of two, and so does the data's layout."""
    value = int.from_bytes(layout.data[start:start + 4], "little" if layout.order == "<" else "big")
    if kind != UINT32 or value == 0 or value & (value - 1):
        raise CheckpointError(f"{layout.path}: metadata key 'general.alignment' must be a UINT32 power of two, got "
                              f"{value if kind == UINT32 else gguf.GGUFValueType(kind).name}")
    return value


def _check_tensor_index(layout: _Layout, count: int, alignment: int) -> None:
    """Step over `count` tensor entries; each tensor's data must lie inside the file, after the index (aligned)."""
    entries, seen = [], set()
    for index in range(count):
        name = _new_name(layout, seen, "tensor", index)
        n_dims = layout.uint(4, lambda: f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CheckpointError(f"{layout.path}: tensor {name!r} has {n_dims} dimensions; 1 to {MAX_DIMS} were "
                                  f"expected")
        dims = [layout.uint(8, lambda: f"tensor {name!r}'s dimensions") for _ in range(n_dims)]
        kind = layout.uint(4, lambda: f"tensor {name!r}'s type")
        entries.append((name, dims, kind, layout.uint(8, lambda: f"tensor {name!r}'s offset")))
    data_start = -(-layout.pos // alignment) * alignment  # as gguf's reader pads it
    for name, dims, kind, offset in entries:
        _check_extent(layout, name, dims, kind, data_start + offset)


def _check_extent(layout: _Layout, name: str, dims: list, kind: int, start: int) -> None:
    """A tensor's type is one gguf knows, its shape whole blocks of it, and its data inside the file."""
    if kind not in QUANT_TYPES:
        raise CheckpointError(f"{layout.path}: tensor {name!r} has type {kind}; the known types are "
                              f"{listing(f'{int(t)} ({t.name})' for t in QUANT_TYPES.values())}")
    block, block_bytes = GGML_QUANT_SIZES[QUANT_TYPES[kind]]
    if min(dims) < 1 or dims[0] % block:
        raise CheckpointError(f"{layout.path}: tensor {name!r} ({QUANT_TYPES[kind].name}) has dimensions {dims} "
                              f"(fastest first); each >= 1, the first a multiple of {block}, were expected")
    end = start + math.prod(dims) // block * block_bytes
    if end > len(layout.data):
        raise CheckpointError(f"{layout.path}: tensor {name!r} ({QUANT_TYPES[kind].name}, dimensions {dims}) takes "
                              f"bytes {start} to {end}, past the end of the file ({len(layout.data)} bytes): is the "
                              f"file cut short?")
