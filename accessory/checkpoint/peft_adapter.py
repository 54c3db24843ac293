"""Hugging Face PEFT LoRA adapters (a folder `PeftModel.save_pretrained` wrote: adapter_config.json and
adapter_model.safetensors or adapter_model.bin): read, checked, put in our names and layout, and given to a loaded
model's layers, each rank its own slice.

    W' x = W x + s B A x        A = lora_A (r, in), B = lora_B (out, r)
    s = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (rsLoRA), as PEFT defines it

PEFT's names map onto ours as the HF importer's do (`base_model.model.model.layers.N.self_attn.q_proj` ->
`layers.N.attention.wq`; q/k/v/o_proj, gate/up/down_proj). HF's q/k rows are in the rotate-half RoPE layout, ours
interleave each head's rotary pairs: B's rows of q_proj and k_proj are permuted as the importer permutes those
weights (`hf_to_meta_qk`). `fan_in_fan_out` says the *base* weight is stored (in, out) (GPT-2's Conv1D); PEFT's
factors have the shapes above either way (it transposes only the merged delta), and ours are stored (out, in), so
B A is the delta for both. What PEFT can do but we cannot is refused by name: DoRA, LoRA biases, trained biases
or `modules_to_save`, per-module rank/alpha patterns, and targets other than the seven block linears. So is what
no real adapter holds, before it is trusted: r outside 1..MAX_RANK, lora_alpha not finite in (0, MAX_ALPHA], factors
that are not finite floats, a layer number that is not plain ASCII decimal (`01`, `١`) or is beyond the base model.

Factors are held in float (a quantized base stays quantized): s is folded into B. A column-parallel layer (wq wk wv
w1 w3) holds B's rows for its outputs, a row-parallel one (wo w2) A's columns for its inputs, cut by the layer's own
`Shard` (KV heads replicated, uneven or quantization-aligned splits alike), so any rank count works.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from accessory.checkpoint.importers.hf import HF_TO_META, hf_to_meta_qk
from accessory.errors import CheckpointError, ConfigError, listing
from accessory.untrusted import integer, number, read_json_object, shown
from accessory.parallel import Shard
from accessory.parallel.lora import AdapterRouting, LoraColumnParallelLinear, LoraFactors, LoraRowParallelLinear

PathLike = Union[str, Path]
CONFIG_FILE, WEIGHT_FILES = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")
# HF module name (`{i}`: the layer) -> ours: the block linears of HF_TO_META, without ".weight"
MODULES = {hf.removesuffix(".weight"): ours.removesuffix(".weight") for hf, ours in HF_TO_META.items()
           if "_proj." in hf}
# any text where the layer is (`01`, `١` too), so that a layer index that names no module is refused by name
MODULE_PATTERNS = [(re.compile(re.escape(hf).replace(r"\{i\}", r"([^.]+)") + "$"), ours)
                   for hf, ours in MODULES.items()]
TENSOR_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
QK_HEADS = {"attention.wq": "n_heads", "attention.wk": "n_kv_heads"}
# adapter_config.json settings we cannot honour, with the value that means "not used"
UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
               "lora_bias": False, "layer_replication": None, "target_parameters": None}
MAX_RANK = 4096  # r: real adapters use 4 to 256; a larger one is not a low-rank adapter of any model we load
MAX_ALPHA = 1e6  # lora_alpha: real ones are about r or 2r; with r >= 1 the scaling stays finite and far from overflow
FLAGS = ("use_rslora", "fan_in_fan_out")  # true or false (or absent)


@dataclass
class PeftAdapter:
    """One adapter in our names and layout: linear name (`layers.N.attention.wq`) -> (A (r, in), s B (out, r)), both
    float32, whole (not yet sliced for a rank)."""
    source: Path
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    scaling: float


def is_peft_adapter(folder: PathLike) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


def read_adapter(folder: PathLike, args) -> PeftAdapter:
    """The PEFT adapter in `folder`, for a base model with config `args` (ModelArgs: its sizes and heads). Raises
    CheckpointError / ConfigError naming the file and what is wrong."""
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}; expected a Hugging Face PEFT adapter folder "
                              f"(PeftModel.save_pretrained)")
    config = read_json_object(config_path, ConfigError)  # nesting bounded before it is parsed
    rank, scaling = checked_config(config, config_path)
    tensors, source = _read_tensors(folder)
    factors = {}
    for ours, (a, b) in _paired(tensors, source, args.n_layers).items():
        _check_shapes(ours, a, b, rank, args, source)
        layer = ours.split(".", 2)[2]  # attention.wq
        if layer in QK_HEADS:  # rotate-half rows -> interleaved, as the importer does for the weights
            b = hf_to_meta_qk(b, getattr(args, QK_HEADS[layer]))
        factors[ours] = (a.float(), _scaled(b, scaling, ours, source))
    return PeftAdapter(folder, factors, rank, scaling)


def checked_config(config: dict, path: Path) -> tuple[int, float]:
    """(r, s) from adapter_config.json, after refusing what we cannot do and values out of range: ConfigError
    naming the file, the key and the value."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ConfigError(f"{path}: peft_type {shown(peft_type)}; only LORA adapters are supported")
    for key, unused in UNSUPPORTED.items():
        value = config.get(key, unused)
        if value not in (unused, None) and value != {} and value != []:
            raise ConfigError(f"{path}: {key} is {shown(value)}; not supported (supported: LoRA on the block "
                              f"linears q/k/v/o_proj and gate/up/down_proj, with r, lora_alpha, use_rslora, "
                              f"fan_in_fan_out)")
    for key in FLAGS:
        if not isinstance(config.get(key, False), bool):
            raise ConfigError(f"{path}: {key} must be true or false, got {shown(config[key])}")
    _check_targets(config.get("target_modules"), path)
    rank = integer(config.get("r"), str(path), "r", ConfigError, 1, MAX_RANK)
    alpha = number(config.get("lora_alpha"), str(path), "lora_alpha", ConfigError, high=MAX_ALPHA, above=0)
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)  # finite: both are bounded


def _check_targets(targets, path: Path) -> None:
    """target_modules as PEFT writes it: a list of names, one name or pattern, or null (the tensors say which)."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(name, str) for name in targets):
        raise ConfigError(f"{path}: target_modules must be a list of module names, a name or null, got "
                          f"{shown(targets)}")


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file
                    tensors = load_file(str(path))
                else:
                    tensors = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # a truncated or foreign file: name it
                raise CheckpointError(f"{path}: cannot read the adapter's tensors: {e}") from e
            if not isinstance(tensors, dict) or not all(isinstance(key, str) for key in tensors):
                raise CheckpointError(f"{path}: expected a dict of named tensors, got {type(tensors).__name__}")
            return tensors, str(path)
    raise CheckpointError(f"{folder}: no {' or '.join(WEIGHT_FILES)} beside {CONFIG_FILE}")


def _paired(tensors: dict[str, torch.Tensor], source: str,
            n_layers: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our linear name -> (A, B) of every module the adapter trains; unknown tensors and targets, layers the base
    model lacks and factors that are not finite floats are refused, naming the tensor."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = TENSOR_KEY.match(key)
        ours = match and _our_module(match["module"], key, source, n_layers)
        if not ours:
            raise ConfigError(f"{source}: tensor {shown(key)} is not a LoRA factor of a supported module (supported: "
                              f"LoRA on {', '.join(sorted({h.split('.')[-1] for h in MODULES}))})")
        _check_factor(tensor, key, source)
        found.setdefault(ours, {})[match["factor"]] = tensor
    unpaired = sorted(name for name, pair in found.items() if len(pair) != 2)
    if unpaired:
        raise CheckpointError(f"{source}: lora_A or lora_B missing for {listing(unpaired)}")
    if not found:
        raise CheckpointError(f"{source}: holds no LoRA factors")
    return {name: (pair["A"], pair["B"]) for name, pair in found.items()}


def _our_module(hf_module: str, key: str, source: str, n_layers: int) -> Optional[str]:
    for pattern, ours in MODULE_PATTERNS:
        match = pattern.match(hf_module)
        if match:
            return ours.format(i=_layer_index(match[1], key, source, n_layers))
    return None


def _layer_index(text: str, key: str, source: str, n_layers: int) -> int:
    """A tensor key's layer: plain ASCII decimal without a leading zero (int() reads `01` and `١` too, but
    `layers.01` names no module), below the base model's layer count."""
    if not (text.isascii() and text.isdigit() and len(text) <= 9 and str(int(text)) == text):
        raise CheckpointError(f"{source}: tensor {shown(key)}: layer index {shown(text)} is not a plain decimal "
                              f"number (ASCII digits, no leading zero)")
    if int(text) >= n_layers:
        raise CheckpointError(f"{source}: tensor {shown(key)}: layer {text} is beyond the base model's {n_layers} "
                              f"layers")
    return int(text)


def _check_factor(tensor, key: str, source: str) -> None:
    """A factor is a floating-point tensor of finite values: one NaN or inf would turn every logit NaN."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise CheckpointError(f"{source}: tensor {shown(key)} is {kind}; a LoRA factor is a floating-point tensor")
    bad = int((~torch.isfinite(tensor.float())).sum())
    if bad:
        raise CheckpointError(f"{source}: tensor {shown(key)} holds {bad} NaN or infinite value(s); LoRA factors "
                              f"must be finite")


def _scaled(b: torch.Tensor, scaling: float, ours: str, source: str) -> torch.Tensor:
    """s B in float32, refused if that overflows (B finite but near float32's largest, s large)."""
    scaled = b.float() * scaling
    if not torch.isfinite(scaled).all():
        raise CheckpointError(f"{source}: {ours}: lora_B times the scaling {scaling:g} (lora_alpha / r) overflows "
                              f"float32; expected factors of ordinary size")
    return scaled


def _check_shapes(ours: str, a: torch.Tensor, b: torch.Tensor, rank: int, args, source: str) -> None:
    q, kv, hidden = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    shapes = {"attention.wq": (q, args.dim), "attention.wk": (kv, args.dim), "attention.wv": (kv, args.dim),
              "attention.wo": (args.dim, q), "feed_forward.w1": (hidden, args.dim),
              "feed_forward.w3": (hidden, args.dim), "feed_forward.w2": (args.dim, hidden)}
    out, inputs = shapes[ours.split(".", 2)[2]]
    if tuple(a.shape) != (rank, inputs) or tuple(b.shape) != (out, rank):
        raise CheckpointError(f"{source}: {ours}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                              f"the base model; expected ({rank}, {inputs}) and ({out}, {rank}) (r from "
                              f"{CONFIG_FILE}): is this adapter for another model?")


# ---- attaching to a loaded model --------------------------------------------------------------------------------

def attach_adapters(model: nn.Module, adapters: Sequence[tuple[int, PeftAdapter]]) -> None:
    """Give each linear the adapters train (`adapters`: (owner, adapter), owner 0 for every token, i > 0 for the
    tokens routed to adapter i) as LoraFactors, this rank's slice, in the model's dtype. With per-request adapters,
    the model gets an AdapterRouting (`model.adapter_routing`) that its forward passes fill."""
    routing = AdapterRouting() if any(owner for owner, _ in adapters) else None
    names = sorted({name for _, adapter in adapters for name in adapter.factors})
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, (LoraColumnParallelLinear, LoraRowParallelLinear)):
            raise ConfigError(f"{name} is a llama_peft layer with LoRA of its own; merge it first (accessory "
                              f"weights merge-lora), then apply the PEFT adapter to the merged checkpoint")
        pieces = [(owner, *adapter.factors[name]) for owner, adapter in adapters if name in adapter.factors]
        a = torch.cat([_rank_slice(a, layer.weight_shard, 1) for _, a, _ in pieces])  # (R, local inputs)
        b = torch.cat([_rank_slice(b, layer.weight_shard, 0) for _, _, b in pieces], dim=1)  # (local outputs, R)
        owner = torch.cat([torch.full((a_.shape[0],), owner) for owner, a_, _ in pieces])
        device, dtype = model.device, model.dtype
        layer.adapters = LoraFactors(a.to(device, dtype), b.to(device, dtype), owner.to(device), routing)
    model.adapter_routing = routing


def _rank_slice(full: torch.Tensor, shard: Shard, dim: int) -> torch.Tensor:
    """This rank's part of a factor along `dim` if the layer's weight is split there (zero-padded like the weight),
    else all of it."""
    if shard is None or shard.dim != dim:
        return full
    part = full.narrow(dim, shard.start, shard.stop - shard.start)
    pad = shard.local_size - part.shape[dim]
    if pad:
        shape = list(part.shape)
        shape[dim] = pad
        part = torch.cat((part, part.new_zeros(shape)), dim=dim)
    return part


def merged_delta(adapter: PeftAdapter, name: str) -> Optional[torch.Tensor]:
    """s B A (out, in), float32, for linear `name` (`layers.N.attention.wq`), or None if the adapter leaves it."""
    if name not in adapter.factors:
        return None
    a, b = adapter.factors[name]
    return b @ a
