"""llama.cpp GGUF files (architecture "llama") -> canonical form, dequantized to float32 by the `gguf` package, or
with `keep_quantized` keeping Q8_0, Q4_0 and Q4_1 tensors' bits as our int8 / int4 formats (quant/formats.py):

| GGUF block (32 values)          | ours  | q                 | scale | min        |
|---------------------------------|-------|-------------------|-------|------------|
| Q8_0: d fp16, 32 x int8         | int8  | the int8 values   | d     |            |
| Q4_1: d, m fp16, 16 bytes       | int4  | the 16 bytes      | d     | m          |
| Q4_0: d fp16, 16 bytes          | int4  | the 16 bytes      | d     | -8 * d     |

The nibble order within a block is ours too, so nothing is repacked, and every value dequantizes to exactly what
the `gguf` package gives (d * q + m, d * q - 8 * d and d * q are all exact or rounded once alike). Other types are
dequantized.

llama.cpp's converter permutes HF's q/k back to Meta's interleaved RoPE layout before writing, so attn_q / attn_k
are taken as they are (tests/test_importers.py pins this against transformers' GGUF loader, which applies the HF
permutation on top of the stored tensors).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import gguf
import numpy as np
import torch
from tqdm import tqdm

from accessory.checkpoint.importers.common import (ImportedModel, check_shapes, expand_templates, rename_strict,
                                            validated_args)
from accessory.errors import CheckpointError, ConfigError

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
# llama.cpp stores Llama-3.1-style rope scaling as this tensor of per-frequency divisors, not as metadata.
ROPE_FREQS = "rope_freqs.weight"
# Meta's llama3 rope-scaling constants (Llama 3.1 / 3.2 / 3.3 params); only the factor varies between releases.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_REQUIRED = object()


def read_gguf(path, workdir, keep_quantized: bool = False) -> ImportedModel:
    """Read a llama.cpp GGUF file of architecture "llama": weights dequantized to float32 under canonical names
    (no `output.weight` when the file has none, i.e. tied embeddings), the config from its `llama.*` metadata, and
    the tokenizer rebuilt by transformers from the file's metadata and saved into `workdir` (tokenizer.json,
    tokenizer_config.json, chat_template.jinja when the file has one, and a generation_config.json holding the
    bos / eos / pad token ids). `keep_quantized`: Q8_0 / Q4_0 / Q4_1 matrices stay quantized (their parts under
    `NAME.q`, `NAME.scale`, `NAME.min`; the formats in `ImportedModel.quantization`)."""
    path, workdir = Path(path), Path(workdir)
    reader = _open(path)
    config = config_from_gguf(reader, str(path))
    weights = _read_all(reader, path, keep_quantized)
    rope_freqs = weights.pop(ROPE_FREQS, None)
    if rope_freqs is not None:
        if config["rope_scaling"] is not None:
            raise ConfigError(f"{path}: has both {ROPE_FREQS} and llama.rope.scaling metadata; expected one")
        config["rope_scaling"] = llama3_scaling_from_freqs(rope_freqs.numpy(), config, str(path))
    config["tie_word_embeddings"] = "output.weight" not in weights
    args = validated_args(config, source=str(path))
    names = expand_templates(GGUF_TO_META, args.n_layers)
    renamed = rename_strict(weights, names, str(path), optional=frozenset({"output.weight"}))
    quantization = {name: value.fmt for name, value in renamed.items() if isinstance(value, Kept)}
    check_shapes({name: value.shape if isinstance(value, Kept) else tuple(value.shape)
                  for name, value in renamed.items()}, args, str(path))
    state_dict = {}
    for name, value in renamed.items():
        if isinstance(value, Kept):
            state_dict.update((f"{name}.{part}", tensor) for part, tensor in value.parts.items())
        else:
            state_dict[name] = value
    tokenizer_files = _save_tokenizer(reader, path, workdir)
    return ImportedModel(state_dict=state_dict, config=config, tokenizer_files=tokenizer_files,
                         quantization=quantization)


def config_from_gguf(reader: gguf.GGUFReader, source: str) -> dict:
    """Our config dict from the `llama.*` metadata (tie_word_embeddings is decided by the tensors, set later)."""
    meta = lambda key, default=_REQUIRED: _field(reader, key, source, default)  # noqa: E731
    if meta("llama.expert_count", 0):
        raise ConfigError(f"{source}: llama.expert_count is {meta('llama.expert_count')}; mixture-of-experts "
                          f"models are not supported")
    dim, n_heads = meta("llama.embedding_length"), meta("llama.attention.head_count")
    n_kv_heads = _one_value(meta("llama.attention.head_count_kv", n_heads), "llama.attention.head_count_kv",
                            source)
    rope_dims = meta("llama.rope.dimension_count", None)
    if rope_dims is not None and n_heads and rope_dims != dim // n_heads:
        raise ConfigError(f"{source}: llama.rope.dimension_count {rope_dims} differs from the head dim "
                          f"{dim // n_heads} (embedding_length / head_count); partial rotary is not supported")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab_size = meta("llama.vocab_size", len(tokens.data) if tokens is not None else _REQUIRED)
    return {
        "dim": dim,
        "n_layers": meta("llama.block_count"),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": vocab_size,
        "hidden_dim": meta("llama.feed_forward_length"),
        # GGUF stores these as float32; recover the decimal they were written from (9.99999975e-06 -> 1e-05).
        "norm_eps": _from_f32(meta("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _from_f32(meta("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, source),
        "tie_word_embeddings": False,
        "max_seq_len": meta("llama.context_length"),
    }


def _rope_scaling(meta, source: str) -> Optional[dict]:
    kind = meta("llama.rope.scaling.type", None)
    factor = meta("llama.rope.scaling.factor", None)
    if kind is None and meta("llama.rope.scale_linear", 1.0) != 1.0:  # older llama.cpp files
        kind, factor = "linear", meta("llama.rope.scale_linear")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ConfigError(f"{source}: llama.rope.scaling.type {kind!r} is not supported; expected 'linear' or "
                          f"'none' (llama3 scaling comes as a {ROPE_FREQS} tensor)")
    if factor is None:
        raise ConfigError(f"{source}: llama.rope.scaling.type is 'linear' but llama.rope.scaling.factor is missing")
    return {"rope_type": "linear", "factor": _from_f32(factor)}


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """Per-frequency divisors of Meta's llama3 rope scaling, as llama.cpp's converter writes them to rope_freqs."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # (head_dim/2,)
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    factors = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < original_max_position_embeddings / high_freq_factor, 1.0, factors)
    return np.where(wavelen > original_max_position_embeddings / low_freq_factor, factor, factors)


def llama3_scaling_from_freqs(rope_freqs: np.ndarray, config: dict, source: str) -> dict:
    """Recover our llama3 rope_scaling dict from a rope_freqs tensor. GGUF keeps only the resulting divisors, so we
    take the factor from their maximum, assume Meta's other constants, and refuse when they do not reproduce it."""
    head_dim = config["dim"] // config["n_heads"]
    scaling = {"rope_type": "llama3", "factor": _from_f32(float(rope_freqs.max())), **_LLAMA3_DEFAULTS}
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
    architecture = _field(reader, "general.architecture", str(path), None)
    if architecture != "llama":
        raise CheckpointError(f"{path}: general.architecture is {architecture!r}; only 'llama' GGUF files can be "
                              f"imported")
    return reader


@dataclass(frozen=True)
class Kept:
    """A GGUF matrix whose quantized bits are kept: its parts in one of our formats, and its float shape."""
    fmt: str
    parts: dict
    shape: tuple


# GGUF block type -> (our format, bytes per block of 32 values)
KEPT_TYPES = {"Q8_0": ("int8", 34), "Q4_0": ("int4", 18), "Q4_1": ("int4", 20)}


def kept_parts(data: np.ndarray, type_name: str) -> dict[str, torch.Tensor]:
    """Our format's parts from a GGUF matrix's raw blocks `data` (rows, bytes per row), without dequantizing."""
    fmt, block = KEPT_TYPES[type_name]
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


def _read_all(reader: gguf.GGUFReader, path: Path, keep_quantized: bool) -> dict:
    """GGUF name -> a float32 tensor (dequantized), or a Kept matrix."""
    weights = {}
    for t in tqdm(reader.tensors, desc=f"reading {path.name}", unit="tensor"):
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions fastest-first
        if keep_quantized and t.tensor_type.name in KEPT_TYPES and len(shape) == 2:
            weights[t.name] = Kept(KEPT_TYPES[t.tensor_type.name][0], kept_parts(t.data, t.tensor_type.name), shape)
            continue
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, numpy order (out, in)
        except NotImplementedError as e:
            raise CheckpointError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf "
                                  f"{getattr(gguf, '__version__', '')} cannot dequantize: {e}") from e
        if not values.flags.writeable:  # F32 tensors come back as a view of the read-only memory map
            values = values.copy()
        weights[t.name] = torch.from_numpy(values.reshape(shape))
    return weights


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
