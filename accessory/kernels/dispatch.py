"""Which implementation computes each kernel-backed operation: the CPU kernels where they apply, else a portable
torch path that computes the same values by other arithmetic.

- `linear`: x @ W^T for a float W. The kernel for 2 to FLOAT_KERNEL_MAX_ROWS rows of float32 on the CPU (batched
  decode steps); F.linear (the BLAS library) for one row (its matrix-vector product is as fast: both stream W at the
  memory's speed), more rows, other dtypes and devices.
- `quantized_linear`: x @ W^T for a quantized W. The kernels take up to KERNEL_MAX_ROWS rows of float32 x on the
  CPU (BLOCK_KERNEL_MAX_ROWS for GGUF's block formats), and up to MAX_ROWS rows of bfloat16 / float16 x on CUDA
  (Triton kernels, cuda.py; int8 / int4); more rows (prefill), float32 on CUDA, GGUF's block formats on CUDA, or no
  kernels: W is dequantized in row chunks for F.linear.
- `decode_attention`: one query per cache row over that row's own cached positions. The kernel on the CPU with
  float32 caches; elsewhere, SDPA over the first `columns` columns with the position mask.

Both are reachable from torch.compile's graphs: the kernels are torch operators with fake implementations.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from accessory.kernels.cuda import takes as cuda_takes
from accessory.kernels.build import cpu_kernels, loaded
from accessory.quant.formats import GGUF_BLOCKS, QUANTIZERS, dequantize

# Rows of x above which the library's GEMM beats the kernels: with W float32, and with W quantized (dequantized in
# chunks first). Measured on SmolLM2's shapes (benchmarks/README.md).
FLOAT_KERNEL_MAX_ROWS = 16
KERNEL_MAX_ROWS = 32
# GGUF's block formats (q4_k, ...): their portable path dequantizes through many small torch operations (about 1 ms
# a million weights), so the kernels stay as fast or faster up to about 128 rows (Gemma 3 270M's products, one
# thread: Q6_K's cross there, Q4_K's near 200, Q5_0's near 500; benchmarks/README.md)
BLOCK_KERNEL_MAX_ROWS = 128
CHUNK_BYTES = 8 << 20  # float32 bytes of W dequantized at once on the portable path


def _kernels_here(device: torch.device) -> bool:
    # Under torch.compile only kernels already loaded are used (loading a model on the CPU loads them).
    return device.type == "cpu" and (loaded() if torch.compiler.is_compiling() else cpu_kernels())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ weight^T -> (..., out), weight (out, in) float."""
    rows = x.reshape(-1, x.shape[-1])
    fits = x.dtype == weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape[1] % 32 == 0
    if fits and 2 <= rows.shape[0] <= FLOAT_KERNEL_MAX_ROWS and _kernels_here(x.device):
        return torch.ops.accessory.linear_cpu(rows.contiguous(), weight).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def quantized_linear(x: torch.Tensor, fmt: str, q: torch.Tensor, scale: Optional[torch.Tensor] = None,
                     minimum: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (..., in) @ W^T -> (..., out) in x's dtype, W given by its parts in `fmt` (formats.py)."""
    rows = x.reshape(-1, x.shape[-1])
    most = BLOCK_KERNEL_MAX_ROWS if fmt in GGUF_BLOCKS else KERNEL_MAX_ROWS
    if rows.shape[0] <= most and _kernels_here(x.device):
        out = torch.ops.accessory.quantized_linear_cpu(rows.float().contiguous(), fmt, q, scale, minimum)
        out = out.to(x.dtype)
    elif fmt in QUANTIZERS and cuda_takes(rows):
        out = torch.ops.accessory.quantized_linear_cuda(rows.contiguous(), fmt, q, scale, minimum)
    else:
        out = _dequantized_product(rows, fmt, q, scale, minimum)
    return out.reshape(*x.shape[:-1], q.shape[0])


def _dequantized_product(x, fmt, q, scale, minimum) -> torch.Tensor:
    """x @ W^T through F.linear, dequantizing at most CHUNK_BYTES of W at a time."""
    step = max(1, CHUNK_BYTES // (4 * x.shape[-1]))
    outs = []
    for start in range(0, q.shape[0], step):
        parts = {name: part[start:start + step] for name, part in (("q", q), ("scale", scale), ("min", minimum))
                 if part is not None}
        outs.append(F.linear(x, dequantize(parts, fmt, x.dtype)))
    return torch.cat(outs, dim=-1)


def expert_product(x: torch.Tensor, fmt: Optional[str], parts: dict[str, torch.Tensor],
                   expert: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ W_e^T for W_e the weight of expert `expert` (a (1,) tensor, on the device) in a stack of experts'
    weights: `parts` {"weight": (E, out, in)} float, or the quantized parts of `fmt` stacked (E, ...). For a step that
    must not sync with the host (compiled, CUDA graphs). On the CPU an operator reads the index and multiplies by that
    expert's weights in place (one expert read, the compiler sees an opaque call); elsewhere the expert's weights are
    gathered first (a copy of one expert: a CUDA graph can hold no host read)."""
    if x.device.type == "cpu":
        if fmt is None:
            return torch.ops.accessory.expert_linear(x, parts["weight"], expert)
        return torch.ops.accessory.expert_quantized_linear(x, fmt, parts["q"], parts.get("scale"), parts.get("min"),
                                                           expert)
    chosen = {name: part.index_select(0, expert)[0] for name, part in parts.items()}
    if fmt is None:
        return linear(x, chosen["weight"])
    return quantized_linear(x, fmt, chosen["q"], chosen.get("scale"), chosen.get("min"))


@torch.library.custom_op("accessory::expert_linear", mutates_args=())
def _expert_linear(x: torch.Tensor, weights: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    return linear(x, weights[int(expert)])


@_expert_linear.register_fake
def _(x, weights, expert):
    return x.new_empty((*x.shape[:-1], weights.shape[1]))


@torch.library.custom_op("accessory::expert_quantized_linear", mutates_args=())
def _expert_quantized_linear(x: torch.Tensor, fmt: str, q: torch.Tensor, scale: Optional[torch.Tensor],
                             minimum: Optional[torch.Tensor], expert: torch.Tensor) -> torch.Tensor:
    e = int(expert)
    return quantized_linear(x, fmt, q[e], None if scale is None else scale[e], None if minimum is None else minimum[e])


@_expert_quantized_linear.register_fake
def _(x, fmt, q, scale, minimum, expert):
    return x.new_empty((*x.shape[:-1], q.shape[1]))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """Attention of one new token per cache row: q (B, 1, H, D); keys and values the whole caches (rows, H_kv, S, D);
    row b sees its columns 0..positions[b] (`mask` (B, 1, 1, C) says the same for the first C columns) ->
    (B, H, 1, D). Query head h reads KV head h // (H / H_kv)."""
    batch, _, heads, dim = q.shape
    if keys.dtype == torch.float32 and _kernels_here(q.device):
        out = torch.ops.accessory.decode_attention_cpu(q.reshape(batch, heads, dim).float(), keys, values, positions)
        return out.to(q.dtype).view(batch, heads, 1, dim)
    columns = mask.shape[-1]
    return F.scaled_dot_product_attention(q.transpose(1, 2), keys[:batch, :, :columns], values[:batch, :, :columns],
                                          attn_mask=mask, enable_gqa=True)
