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

import json
import math
import re
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import numpy as np
import torch

from accessory.checkpoint.importers.common import (ImportedModel, LazyTensors, check_shapes, expand_templates,
                                                   rename_strict, validated_args)
from accessory.checkpoint.importers.families import gguf_family, with_family_names, without_dense_mlp
from accessory.checkpoint.importers.hf import hf_to_meta_qk, rotate_half_to_interleaved
from accessory.errors import CheckpointError, ConfigError
from accessory.network.components import LLAMA3_ROPE_DEFAULTS, base_frequencies, llama3_scaled
from accessory.quant.formats import GGUF_BLOCKS, part_shapes

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
    output."""
    path, workdir = Path(path), Path(workdir)
    reader = _open(path)
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
    base = without_dense_mlp(GGUF_TO_META) if family.is_moe else GGUF_TO_META
    names = expand_templates(with_family_names(base, family.gguf_names), args.n_layers,
                             args.experts.num_experts if args.experts else 0)
    renamed = rename_strict(weights, names, str(path), optional=frozenset({"output.weight"}))
    check_shapes({name: value.shape for name, value in renamed.items()}, args, str(path), family.llama_type)
    _undo_converter(renamed, args, family)
    tokenizer_files = _save_tokenizer(reader, path, workdir)
    return ImportedModel(state_dict=_state_dict(renamed), config=config, tokenizer_files=tokenizer_files,
                         llama_type=family.llama_type,
                         quantization={name: value.fmt for name, value in renamed.items() if value.fmt})


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
    the family's own keys."""
    meta = lambda key, default=_REQUIRED: _field(reader, key, source, default)  # noqa: E731
    arch = family.gguf_arch
    dim, n_heads = meta(f"{arch}.embedding_length"), meta(f"{arch}.attention.head_count")
    n_kv_heads = _one_value(meta(f"{arch}.attention.head_count_kv", n_heads), f"{arch}.attention.head_count_kv",
                            source)
    head_dim = meta(f"{arch}.attention.key_length", dim // n_heads)
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


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read as GGUF: {e}") from e
    return reader


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
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ConfigError(f"{source}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _one_value(value, key: str, source: str):
    """A per-layer array that must hold one value throughout (llama.cpp writes some counts per layer)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"{source}: {key} differs between layers ({value}); not supported")
        return value[0]
    return value


def _from_f32(value: float) -> float:
    return float(str(np.float32(value)))
