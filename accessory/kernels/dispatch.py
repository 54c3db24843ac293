"""Which implementation computes each kernel-backed operation: the CPU kernels where they apply, else a portable
torch path that computes the same values by other arithmetic.

- `linear`: x @ W^T for a float W. The kernel for 2 to FLOAT_KERNEL_MAX_ROWS rows of float32 on the CPU (batched
  decode steps), and for one row where it beats the BLAS library's matrix-vector product on this machine (timed
  once: build.one_row_float_kernel); F.linear otherwise (more rows, other dtypes and devices).
- `quantized_linear`: x @ W^T for a quantized W. The kernels take up to KERNEL_MAX_ROWS rows of float32 x on the
  CPU (BLOCK_KERNEL_MAX_ROWS for GGUF's block formats), and up to MAX_ROWS rows of bfloat16 / float16 x on CUDA
  (Triton kernels, cuda.py; int8 / int4); more rows (prefill), float32 on CUDA, GGUF's block formats on CUDA, or no
  kernels: W is dequantized in row chunks for F.linear (a GGUF block format's by a kernel on the CPU). A GGUF block
  format's prompt (GGUF_INT8X_ROWS rows and more) quantizes x to int8 and multiplies in integers instead, as
  llama.cpp does, and so does one row against Q5_0, Q4_K or Q6_K in the AVX-512 kernels, unless
  `exact_products(True)`.
- `quantized_linear` with `int8x` parts (a draft model's int4 weights repacked by `pack_int4_int8x`): up to
  INT8X_MAX_ROWS rows take the kernel that quantizes x to int8 and multiplies in integers (AVX-512 VNNI or AVX2), as
  llama.cpp does Q4_1. Close to the exact product, not equal: a draft's proposals are verified, so its numerics
  cannot change the output. More rows take the exact paths above.
- `decode_attention`: a few queries per cache row over that row's own cached positions. The kernel on the CPU with
  float32 caches; elsewhere, SDPA over the first `columns` columns with the position mask.
- `rms_norm`, `apply_rope` and `gated` (a gated MLP's act(gate) * up): a layer's small steps. In eager steps on the
  CPU in float32, one kernel call each (cpu_kernels.c) instead of eight, fifteen and two torch operations, whose
  dispatch costs more than their arithmetic at decode's few rows. A compiled step takes the torch expressions, which
  its compiler fuses with their neighbours.
- `attends_in_one_call`: whether a decode step's attention, from its q, k and v projections to its output (qk-norm,
  scale, rotary embedding, the cache write and the attention), is one kernel call (attend_cpu): eager float32 steps
  on the CPU with float32 caches, as for the small steps; elsewhere those are the steps above, one at a time.
- `products_in_one_call`: whether a block half's products all go to the kernels for an eager step's rows, so that
  the half, all-reduce aside, is one call that makes them from C++ (attention_block_cpu, mlp_block_cpu).
- `grouped_experts`: a mixture of experts' MLPs, one product per chosen expert on its tokens (eager, and compiled
  on the CPU as an operator); `expert_product`: one expert of a stack chosen by a tensor id (the GPU's static step).

Both are reachable from torch.compile's graphs: the kernels are torch operators with fake implementations.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Union

import torch
import torch.nn.functional as F

from accessory.kernels.cuda import takes as cuda_takes
from accessory.kernels.build import (cpu_kernels, int8x_kernels, int8x_products, loaded, one_row_float_kernel,
                                    set_int8x_products)
from accessory.quant.formats import GGUF_BLOCKS, PARTS, QUANTIZERS, dequantize, unpack_int4

# Rows of x above which the library's GEMM beats the kernels: with W float32, and with W quantized (dequantized in
# chunks first). Measured on SmolLM2's shapes (benchmarks/README.md).
FLOAT_KERNEL_MAX_ROWS = 16
KERNEL_MAX_ROWS = 32
# GGUF's block formats (q4_k, ...): up to about 128 rows the products' kernels were as fast as dequantizing through
# many small torch operations then F.linear (Gemma 3 270M's products, one thread: Q6_K's cross there, Q4_K's near
# 200, Q5_0's near 500; benchmarks/README.md). Past them W is dequantized by a kernel (dequantize_gguf_cpu). The
# limit holds with exact products only; otherwise GGUF_INT8X_ROWS takes over below it.
BLOCK_KERNEL_MAX_ROWS = 128
# From these rows of x on (a prompt, a batch of 16 decode rows), a GGUF block format's product quantizes x to int8 and
# multiplies in integers, as llama.cpp does (gguf_int8x_linear_cpu, where the kernels have it: AVX-512 or AVX2): not
# exact (x's rounding), and faster than the exact kernels from 8-16 rows (Gemma 3 270M's products, 2 threads, AMD
# EPYC: 1.3x at 16 rows, 2-2.8x at 64; benchmarks/README.md). Each row's result depends on that row alone.
GGUF_INT8X_ROWS = {"q4_k": 16, "q5_k": 16, "q6_k": 16, "q5_0": 16}
# A draft's steps feed one token per row: the int8-x kernel up to 16 rows (a pass over SmolLM2's products from memory,
# 2 threads: 3.3 against 6.8 ms at 1 row, 16.0 against 20.1 at 16; benchmarks/kernels.py), the exact paths beyond.
INT8X_MAX_ROWS = 16
CHUNK_BYTES = 8 << 20  # float32 bytes of W dequantized at once on the portable path


_portable_blocks = 0  # `portable()` blocks open: a plain global, which torch.compile reads (not a ContextVar)


@contextlib.contextmanager
def portable() -> Iterator[None]:
    """Every operation by its portable torch path inside this block: what an exporter traces (ONNX holds no
    custom operator). The kernels' row and length tests are skipped too, so a traced size stays symbolic."""
    global _portable_blocks
    _portable_blocks += 1
    try:
        yield
    finally:
        _portable_blocks -= 1


def _kernels_here(device: torch.device) -> bool:
    # Under torch.compile only kernels already loaded are used (loading a model on the CPU loads them).
    if _portable_blocks:
        return False
    return device.type == "cpu" and (loaded() if torch.compiler.is_compiling() else cpu_kernels())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ weight^T -> (..., out), weight (out, in) float."""
    rows = x.reshape(-1, x.shape[-1])
    fits = x.dtype == torch.float32 and _float_kernel_fits(weight)
    if fits and _kernels_here(x.device) and (2 <= rows.shape[0] <= FLOAT_KERNEL_MAX_ROWS
                                             or (rows.shape[0] == 1 and one_row_float_kernel())):
        return torch.ops.accessory.linear_cpu(rows.contiguous(), weight).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def _float_kernel_fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape[1] % 32 == 0


def exact_products(exact: bool) -> None:
    """Whether a GGUF block format's products stay in float32 (MetaModel.from_pretrained's exact_products) instead
    of taking x in int8: a prompt's (GGUF_INT8X_ROWS rows and more) and one row against Q5_0, Q4_K or Q6_K (a
    batch-1 decode step, in the kernels' one-row path on AVX-512). Process-wide."""
    set_int8x_products(not exact)


def _takes_gguf_int8x(fmt: str) -> bool:
    return int8x_products() and fmt in GGUF_BLOCKS and int8x_kernels()


def _kernel_max_rows(fmt: str) -> int:
    if fmt in GGUF_BLOCKS:
        return GGUF_INT8X_ROWS[fmt] - 1 if _takes_gguf_int8x(fmt) else BLOCK_KERNEL_MAX_ROWS
    return KERNEL_MAX_ROWS


def quantized_linear(x: torch.Tensor, fmt: str, q: torch.Tensor, scale: Optional[torch.Tensor] = None,
                     minimum: Optional[torch.Tensor] = None,
                     int8x: Optional[tuple[torch.Tensor, ...]] = None) -> torch.Tensor:
    """x (..., in) @ W^T -> (..., out) in x's dtype, W given by its parts in `fmt` (formats.py); int4 may come with
    its `int8x` repacking too (a draft's weights: pack_int4_int8x)."""
    rows = x.reshape(-1, x.shape[-1])
    most = _kernel_max_rows(fmt)
    if int8x is not None and rows.shape[0] <= INT8X_MAX_ROWS and _kernels_here(x.device):
        out = torch.ops.accessory.int4_int8x_linear_cpu(rows.float().contiguous(), *int8x, q.shape[0]).to(x.dtype)
    elif rows.shape[0] <= most and _kernels_here(x.device):
        out = torch.ops.accessory.quantized_linear_cpu(rows.float().contiguous(), fmt, q, scale, minimum)
        out = out.to(x.dtype)
    elif _takes_gguf_int8x(fmt) and _kernels_here(x.device):
        out = torch.ops.accessory.gguf_int8x_linear_cpu(rows.float().contiguous(), fmt, q).to(x.dtype)
    elif fmt in QUANTIZERS and cuda_takes(rows):
        out = torch.ops.accessory.quantized_linear_cuda(rows.contiguous(), fmt, q, scale, minimum)
    else:
        out = _dequantized_product(rows, fmt, q, scale, minimum)
    return out.reshape(*x.shape[:-1], q.shape[0])


def pack_int4_int8x(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """int4 parts (formats.py) in the layout of the int8-x kernel (cpu_kernels.c): tiles of 16 rows of W (the last
    padded with zero rows); per tile and group of 32 inputs, 4 x 64 bytes, byte 4r + c of vector i holding row r's
    inputs 4i + c (low nibble) and 16 + 4i + c (high nibble); scale and min (tiles, groups * 16), a group's 16 rows
    together. -> (q, scale, min)."""
    out, groups = scale.shape
    tiles = -(-out // 16)
    padded = tiles * 16 - out
    values = F.pad(unpack_int4(q), (0, 0, 0, padded)).reshape(tiles, 16, groups, 2, 4, 4)  # t, r, g, half, i, c
    values = values.permute(0, 2, 4, 1, 5, 3)  # t, g, i, r, c, half
    packed = (values[..., 0] | (values[..., 1] << 4)).reshape(tiles, groups * 256)

    def by_tile(part: torch.Tensor) -> torch.Tensor:
        return F.pad(part, (0, 0, 0, padded)).reshape(tiles, 16, groups).transpose(1, 2).reshape(tiles, groups * 16)

    return packed.contiguous(), by_tile(scale).contiguous(), by_tile(minimum).contiguous()


def _dequantized_product(x, fmt, q, scale, minimum) -> torch.Tensor:
    """x @ W^T through F.linear, dequantizing at most CHUNK_BYTES of W at a time (a GGUF block format's by the
    kernel, where the kernels are loaded: the portable path's many small operations cost more than the product)."""
    step = max(1, CHUNK_BYTES // (4 * x.shape[-1]))
    kernel = fmt in GGUF_BLOCKS and _kernels_here(x.device)
    outs = []
    for start in range(0, q.shape[0], step):
        if kernel:
            weight = torch.ops.accessory.dequantize_gguf_cpu(q[start:start + step], fmt, x.shape[-1]).to(x.dtype)
        else:
            parts = {name: part[start:start + step] for name, part in (("q", q), ("scale", scale), ("min", minimum))
                     if part is not None}
            weight = dequantize(parts, fmt, x.dtype)
        outs.append(F.linear(x, weight))
    return torch.cat(outs, dim=-1)


def _small_step_kernel(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and not torch.compiler.is_compiling() and _kernels_here(x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension; with `offset` (Gemma's 1.0), x / rms(x) * (offset + weight)."""
    if _small_step_kernel(x) and weight.dtype == torch.float32:
        return torch.ops.accessory.rms_norm_cpu(x, weight, eps, offset)
    # Normalise in float32 (bf16 loses too much in the mean of squares). Meta scales in the input dtype; Gemma
    # scales in float32 by (1 + w), which in bf16 would round 1 + w away.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).type_as(x)
    return normed.type_as(x) * weight


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate Meta-style interleaved pairs (x[2i], x[2i+1]) by angle a_i: (x0 cos - x1 sin, x0 sin + x1 cos).

    x: (B, L, H, D); rotations: (B or 1, L, D / 2, 2) from `rope_table`."""
    if _small_step_kernel(x) and rotations.dtype == torch.float32:
        return torch.ops.accessory.rotary_cpu(x, rotations)
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, L, H, D/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = rotations[:, :, None, :, 0], rotations[:, :, None, :, 1]  # (B, L, 1, D/2)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(3).type_as(x)


def products_in_one_call(x: torch.Tensor, products: list) -> bool:
    """x (..., in), an eager step's input to a block half's `products` ((format, parts) each:
    ParallelWeight.plain_parts, None for one that has none): whether each is a product `linear` or
    `quantized_linear` would give the kernels for x's rows, so that the half may run in one call
    (attention_block_cpu, mlp_block_cpu) that makes them from C++."""
    rows = x.numel() // x.shape[-1]
    if not _small_step_kernel(x) or any(product is None for product in products):
        return False
    return all(rows <= _kernel_max_rows(fmt) if fmt else rows <= FLOAT_KERNEL_MAX_ROWS and _float_kernel_fits(parts[0])
               for fmt, parts in products)


def attends_in_one_call(x: torch.Tensor, k_cache: torch.Tensor, ring: bool) -> bool:
    """x (B, L, ...), a decode step's input: whether attend_cpu takes this decode step (one token a row on a ring:
    several would need the mask that says which of its columns each sees)."""
    return _small_step_kernel(x) and k_cache.dtype == torch.float32 and (x.shape[1] == 1 or not ring)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's hidden units: ACTIVATIONS[activation](gate) * up."""
    if _small_step_kernel(gate):
        return torch.ops.accessory.gated_cpu(gate, up, activation)
    return ACTIVATIONS[activation](gate) * up


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, fmt: Optional[str],
                    w13: list[torch.Tensor], w2: list[torch.Tensor], activation: str) -> torch.Tensor:
    """A mixture's gated MLPs over tokens x (T, dim), one product per local expert on the tokens that chose it:
    `local` (T, k) each choice's local expert (L, the stack's length, for one held elsewhere: skipped), `weights`
    (T, k) the router's weights. w13 / w2: the local experts' stacked [w1; w3] (L, 2 * hidden, dim) and w2
    (L, dim, hidden), float (one tensor) or `fmt`'s parts in PARTS order. Only the chosen experts' weights are read;
    the grouping costs one host sync (how many tokens each expert got). Under torch.compile this runs as the operator
    `accessory::grouped_experts`, whose sizes the compiler never sees."""
    k, count = local.shape[1], w13[0].shape[0]
    if x.shape[0] == 1:  # one token (batch-1 decode): its k experts in turn, without sorting
        return sum((weight * _expert_mlp(x, fmt, w13, w2, activation, expert)
                    for weight, expert in zip(weights[0], local[0].tolist()) if expert < count), torch.zeros_like(x))
    choices = local.flatten()  # (T * k,): choice c is token c // k's
    order = choices.argsort(stable=True)
    sizes = torch.bincount(choices, minlength=count + 1).tolist()
    y, start = torch.zeros_like(x), 0
    for expert, size in enumerate(sizes[:count]):
        if size:
            chosen = order[start:start + size]
            tokens = chosen // k
            out = _expert_mlp(x[tokens], fmt, w13, w2, activation, expert)
            y.index_add_(0, tokens, out * weights.flatten()[chosen, None])
        start += size
    return y


def _expert_mlp(x: torch.Tensor, fmt: Optional[str], w13: list[torch.Tensor], w2: list[torch.Tensor],
                activation: str, expert: int) -> torch.Tensor:
    gate, up = expert_product(x, fmt, w13, expert).chunk(2, dim=-1)
    return expert_product(gated(gate, up, activation), fmt, w2, expert)


def expert_product(x: torch.Tensor, fmt: Optional[str], stack: list[torch.Tensor],
                   expert: Union[int, torch.Tensor]) -> torch.Tensor:
    """x (..., in) @ W_e^T for expert `expert` of a stack of experts' weights: [(E, out, in)] float, or `fmt`'s parts
    stacked (E, ...) in PARTS order. `expert`: an int (a view of its weights, nothing copied), or a (1,) tensor on
    the device, for a GPU's static step that must not sync with the host (the weights gathered by id: a copy of
    one expert)."""
    if isinstance(expert, int):
        chosen = [part[expert] for part in stack]
    else:
        chosen = [part.index_select(0, expert)[0] for part in stack]
    if fmt is None:
        return linear(x, chosen[0])
    parts = dict(zip(PARTS[fmt], chosen))
    return quantized_linear(x, fmt, parts["q"], parts.get("scale"), parts.get("min"))


@torch.library.custom_op("accessory::grouped_experts", mutates_args=())
def _grouped_experts(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, fmt: Optional[str],
                     w13: list[torch.Tensor], w2: list[torch.Tensor], activation: str) -> torch.Tensor:
    return grouped_experts(x, weights, local, fmt, w13, w2, activation)


@_grouped_experts.register_fake
def _(x, weights, local, fmt, w13, w2, activation):
    return torch.empty_like(x)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     mask: torch.Tensor, ring: bool = False) -> torch.Tensor:
    """Attention of L new tokens per cache row: q (B, L, H, D); keys and values the whole caches (rows, H_kv, S, D);
    token l of row b sees its columns 0..positions[b, l] (`mask` (B, 1, L, C) says the same for the first C
    columns) -> (B, H, L, D). Query head h reads KV head h // (H / H_kv). The kernel takes it on the CPU (each
    token over its own columns, as a one-token step would), but for several tokens on a ring (a sliding window's
    cache, whose columns are not positions: the mask says which each token sees)."""
    batch, length, heads, dim = q.shape
    if _kernels_here(q.device) and keys.dtype == torch.float32 and (length == 1 or not ring):
        out = torch.ops.accessory.decode_attention_cpu(q.float().contiguous(), keys, values, positions.contiguous())
        return out.to(q.dtype).transpose(1, 2)
    columns = mask.shape[-1]
    return F.scaled_dot_product_attention(q.transpose(1, 2), keys[:batch, :, :columns], values[:batch, :, :columns],
                                          attn_mask=mask, enable_gqa=True)
