"""ONNX export: one process's whole model (one rank: every weight) in float32 as `model.onnx`, through torch's own
exporter (torch.onnx.export, dynamo), with the KV cache as inputs and outputs, into a new folder written atomically.

The graph is the Transformer's own cached step (`verify`: L new tokens per row after the row's cached positions) on
a KV cache made of the past keys and values given as inputs plus L new columns, traced on the portable torch path
(kernels.dispatch.portable: ONNX holds no custom operator). So it is our model, not a second implementation of it.

    inputs   input_ids (batch, sequence) int64; past_key_values.{i}.key / .value (batch, kv_heads, past, head_dim)
             float32 for each layer i (past may be 0: a prompt from the start)
    outputs  logits (batch, sequence, vocab) float32; present.{i}.key / .value (batch, kv_heads, past + sequence,
             head_dim): the next step's past

Every row of a batch is at the same position (no padding mask): token j of the input sits at position past + j,
which must stay below max_seq_len (the rotary table's length). `onnx.json` says the same for a program.

Lives in checkpoint/: like convert, it writes a model to another format; it reads the network built above it.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from accessory.checkpoint.save import atomic_folder
from accessory.errors import ConfigError
from accessory.kernels.dispatch import portable
from accessory.network.components import decode_mask
from accessory.network.kv_caches import KVCaches
from accessory.parallel.layers import ParallelWeight
from accessory.parallel.quantized_weight import QuantizedWeight

log = logging.getLogger(__name__)

MODEL_FILE, DESCRIPTION_FILE = "model.onnx", "onnx.json"
# Past this many bytes of weights, ONNX's protobuf (2 GB at most) keeps them in a file beside model.onnx.
EXTERNAL_DATA_BYTES = 1 << 30


def past_names(n_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def present_names(n_layers: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


class CachedStep(nn.Module):
    """input_ids (B, L) after `past` cached positions, and each layer's past keys and values -> float32 logits (B, L,
    vocab) and each layer's keys and values with the L new positions appended: the Transformer's `verify` step on a
    KV cache of past + L columns."""

    def __init__(self, llma: nn.Module):
        super().__init__()
        self.llma = llma

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, length = input_ids.shape
        cached = past[0].shape[2]
        positions = (torch.arange(length, device=input_ids.device) + cached).expand(batch, length)  # (B, L)
        caches = KVCaches.of_tensors([(grown(keys, length), grown(values, length))
                                      for keys, values in zip(past[0::2], past[1::2])], cached + length)
        logits = self.llma.verify(input_ids, positions, decode_mask(positions, cached + length), caches)
        return (logits, *(t for pair in caches.tensors() for t in pair))


def grown(past: torch.Tensor, new: int) -> torch.Tensor:
    """`past` keys or values (B, H_kv, P, D) with `new` empty columns after them, which the step writes."""
    rows, heads, _, head_dim = past.shape
    return torch.cat((past, past.new_zeros(rows, heads, new, head_dim)), dim=2)


def check_exportable(llma: nn.Module) -> None:
    """Refuse, by name, what the exported step cannot hold."""
    args = llma.args
    problems = []
    if llma.ctx.world_size != 1:
        problems.append(f"it is loaded at {llma.ctx.world_size} model-parallel ranks (export one process's whole "
                        f"model: run it without torchrun)")
    if args.experts is not None:
        problems.append("a mixture of experts routes tokens with data-dependent sizes")
    if args.sliding_window is not None:
        problems.append(f"sliding-window layers (window {args.sliding_window}) keep a ring, not a growing past")
    if llma.image_tokens:
        problems.append("a vision-language model's images are not inputs of the exported step")
    if problems:
        raise ConfigError("cannot export this model to ONNX: " + "; ".join(problems))


def float32_weights_(llma: nn.Module) -> int:
    """Dequantize every quantized weight to a float32 Parameter (a GGUF import keeps its Q4_1 bits; ONNX runs
    float32), and stack q/k/v and w1/w3 again as float products. Returns how many weights were dequantized."""
    dequantized: dict[int, nn.Parameter] = {}  # a tied output shares the embedding's weight: dequantized once
    for module in list(llma.modules()):
        weight = getattr(module, "weight", None)
        if isinstance(module, ParallelWeight) and isinstance(weight, QuantizedWeight):
            if id(weight) not in dequantized:
                dequantized[id(weight)] = nn.Parameter(weight.dequantize(torch.float32), requires_grad=False)
            del module.weight
            module.weight = dequantized[id(weight)]
    if dequantized:
        for layer in llma.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()
    return len(dequantized)


def export_onnx(llma: nn.Module, tokenizer_files: Sequence[Path], dst: Path, opset: Optional[int] = None) -> Path:
    """Write `llma` (a Transformer loaded in float32 on the CPU at one rank) as ONNX into the new folder `dst`:
    model.onnx (+ model.onnx.data when the weights are large), onnx.json (the inputs and outputs), and the
    tokenizer files."""
    check_exportable(llma)
    if llma.dtype != torch.float32 or llma.device.type != "cpu":
        raise ConfigError(f"ONNX export takes the model in float32 on the CPU, got {llma.dtype} on {llma.device}")
    count = float32_weights_(llma)
    if count:
        log.info("dequantized %d quantized weights to float32 for ONNX", count)
    n_layers = llma.args.n_layers
    example = example_inputs(llma)
    weight_bytes = sum(p.numel() * p.element_size() for p in llma.parameters())
    with atomic_folder(dst) as tmp:
        with portable(), torch.inference_mode(False), torch.no_grad():
            program = torch.onnx.export(
                CachedStep(llma).eval(), example, dynamo=True, opset_version=opset,
                input_names=["input_ids", *past_names(n_layers)],
                output_names=["logits", *present_names(n_layers)],
                dynamic_shapes=dynamic_shapes(n_layers), optimize=True, verbose=False)
        program.save(str(tmp / MODEL_FILE), external_data=weight_bytes > EXTERNAL_DATA_BYTES)
        (tmp / DESCRIPTION_FILE).write_text(json.dumps(description(llma, program), indent=2) + "\n")
        for path in tokenizer_files:
            shutil.copyfile(path, tmp / Path(path).name)
    return dst


def example_inputs(llma: nn.Module) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: 2 rows of 3 tokens after 2 cached positions (sizes of 2 and more: the exporter keeps a
    size of 1 fixed)."""
    attn = llma.layers[0].attention
    past = torch.zeros(2, attn.n_local_kv_heads, 2, attn.head_dim)
    return (torch.zeros(2, 3, dtype=torch.long), *[past.clone() for _ in range(2 * llma.args.n_layers)])


def dynamic_shapes(n_layers: int) -> tuple:
    """forward(input_ids, *past)'s dynamic axes: input_ids's, then the past tensors' (one tuple: *past)."""
    batch, sequence, past = (torch.export.Dim.DYNAMIC,) * 3
    return ({0: batch, 1: sequence}, tuple({0: batch, 2: past} for _ in range(2 * n_layers)))


def description(llma: nn.Module, program) -> dict:
    """onnx.json: what a program feeds the model and reads from it."""
    attn, args = llma.layers[0].attention, llma.args
    return {
        "format": "accessory onnx export",
        "inputs": {"input_ids": ["batch", "sequence", "int64"],
                   **{name: ["batch", attn.n_local_kv_heads, "past", attn.head_dim, "float32"]
                      for name in past_names(args.n_layers)}},
        "outputs": {"logits": ["batch", "sequence", args.vocab_size, "float32"],
                    **{name: ["batch", attn.n_local_kv_heads, "past + sequence", attn.head_dim, "float32"]
                       for name in present_names(args.n_layers)}},
        "positions": "token j of input_ids is at position past + j in every row; past + sequence <= max_seq_len",
        "max_seq_len": args.max_seq_len, "n_layers": args.n_layers, "vocab_size": args.vocab_size,
        "opset": program.model.opset_imports.get("", None),
        "torch": torch.__version__,
    }


