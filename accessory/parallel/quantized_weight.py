"""QuantizedWeight: a rank's slice of a weight W (out, in), held in a quantized format instead of a float Parameter.

A parallel layer's `weight` is either a float Parameter or one of these (parallel/layers.py `quantize_`). Its
parts are buffers named after the weight (`wq.weight.q`, `wq.weight.scale`, `wq.weight.min`), and each part carries
its own `Shard` (`q_shard`, ...) cut from the float weight's, so loading, saving and resharding slice them as they
slice any tensor. Blocks (groups of 32; GGUF's blocks of 32 or 256) run along `in`: a split of `in` across ranks
falls on block boundaries (the layers align it, or refuse), so every rank's slice holds exactly the same bits as the
same columns of the whole weight, at any rank count.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from accessory.quant.formats import (GROUP, PART_DTYPES, block_size, check_format, dequantize, packed_in,
                                     part_shapes, quantize)
from accessory.kernels import quantized_linear
from accessory.kernels.dispatch import pack_int4_int8x


class QuantizedWeight(nn.Module):
    def __init__(self, fmt: str, out_features: int, in_features: int, shard=None, device=None):
        """`out_features` x `in_features` is this rank's (local) shape; `shard` the float weight's Shard."""
        super().__init__()
        self.fmt, self.shape, self.shard = check_format(fmt), (out_features, in_features), shard
        if in_features % block_size(fmt):
            raise ValueError(f"{in_features} input features per rank are not a multiple of {fmt}'s block of "
                             f"{block_size(fmt)} inputs")
        for name, shape in part_shapes(fmt, out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=PART_DTYPES[fmt][name], device=device))
            setattr(self, f"{name}_shard", part_shard(shard, fmt, name))

    @property
    def parts(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in PART_DTYPES[self.fmt]}

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) @ W^T -> (..., out)."""
        return quantized_linear(x, self.fmt, self.q, getattr(self, "scale", None), getattr(self, "min", None),
                                int8x_parts(self))

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `tokens` of W, dequantized: an embedding lookup (..., in)."""
        flat = tokens.reshape(-1)
        rows = dequantize({name: part[flat] for name, part in self.parts.items()}, self.fmt, dtype)
        return rows.reshape(*tokens.shape, self.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.parts, self.fmt, dtype)

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor, rows_at_once: int = 4096) -> None:
        """Fill the parts from this rank's float slice `weight` (out, in), a block of rows at a time (quantizing
        makes float temporaries of what it is given: a block's, not the whole weight's)."""
        for start in range(0, weight.shape[0], rows_at_once):
            block = slice(start, start + rows_at_once)
            for name, value in quantize(weight[block], self.fmt).items():
                getattr(self, name)[block].copy_(value)

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts.values())

    def extra_repr(self) -> str:
        return f"{self.fmt}, {self.shape[0]}x{self.shape[1]}, blocks of {block_size(self.fmt)}"


INT8X_PARTS = ("int8x_q", "int8x_scale", "int8x_min")


def hold_int8x_copy(module: nn.Module) -> int:
    """Give `module` (int4 parts q, scale, min) a copy of them repacked for the kernel that takes x in int8
    (kernels/dispatch.py pack_int4_int8x), which its few-row products then take: a draft's. Buffers not saved (they
    are derived); the int4 parts stay for what reads them (prefill, an embedding lookup, saving). Returns the bytes
    added."""
    packed = pack_int4_int8x(module.q, module.scale, module.min)
    for name, part in zip(INT8X_PARTS, packed):
        module.register_buffer(name, part, persistent=False)
    return sum(part.numel() * part.element_size() for part in packed)


def int8x_parts(module: nn.Module):
    """The module's int8-x copy of its weight (hold_int8x_copy), or None."""
    return tuple(getattr(module, name) for name in INT8X_PARTS) if hasattr(module, INT8X_PARTS[0]) else None


def part_shard(shard, fmt: str, part: str):
    """The Shard of one part, from the float weight's: rows split alike; a split of `in` (on whole blocks) maps to
    q's columns (2 values a byte for int4, a GGUF block's bytes per block) or to groups (scale, min)."""
    if shard is None or shard.dim == 0:
        return shard
    def columns(n: int) -> int:
        return packed_in(fmt, n) if part == "q" else n // GROUP

    return replace(shard, start=columns(shard.start), stop=columns(shard.stop), size=columns(shard.size),
                   local_size=columns(shard.local_size))


