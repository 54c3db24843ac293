"""Weight-only quantized products on CUDA: Triton kernels that read the int8 / int4 formats as they are stored (groups
of 32 inputs with a float16 scale, and a float16 minimum for int4: quant/formats.py), dequantize each tile in
registers and multiply it with bfloat16 / float16 activations, accumulating in float32.

Why our own kernels rather than torch's (benchmarks/README.md, "GPU", has the measurements):
- `torch._weight_int8pack_mm` holds one scale per output row; our int8 has one per 32 inputs, which it cannot
  express without requantizing (other weights than the checkpoint's).
- `torch._weight_int4pack_mm` (tinygemm) takes groups of 32, but its own tiled layout, made once at load (a second
  copy beside the parts that saving and the embedding read), and its scale and zero point in bfloat16, which
  rounds the float16 scale and minimum. It is measured beside ours (`tinygemm_pack`, `tinygemm_linear`): on an
  H100 it was faster (a 7B step's int4 products in 6.7 ms at one row against our 13.3), yet still slower than
  bf16 cuBLAS (5.5 ms), so neither meets what int4 is for yet; the runtime keeps the kernels that need no
  conversion while they are tuned.
These kernels need no layout conversion: the weight the checkpoint holds is the weight the product reads, so
memory is the format's own (8.5 and 5 bits a weight) and the values are exactly those of `dequantize`.

A decode step has few rows (the batch), so the kernel is a matrix-vector product in spirit: each program owns a
block of output rows and streams their weights once, for all rows of x at a time (up to MAX_ROWS). One row is
a multiply-and-sum; more rows go through the tensor cores (`tl.dot`, at least 16 rows, padded). More rows than
MAX_ROWS (prefill) are compute-bound, and dispatch.py dequantizes chunks for cuBLAS instead.

The product is a torch operator (`torch.ops.accessory.quantized_linear_cuda`) with a fake implementation, so a
compiled decode step calls it from its graph, and CUDA graphs capture it. Triton is imported at first use: this
module imports on machines without it (the CPU runtime never calls it).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

MAX_ROWS = 64  # rows of x the kernels take; more (prefill) are dequantized for cuBLAS by dispatch.py
GROUP = 32


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels take this x: 1..MAX_ROWS rows of bfloat16 / float16 on CUDA."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= MAX_ROWS


@torch.library.custom_op("accessory::quantized_linear_cuda", mutates_args=())
def quantized_linear_cuda(x: torch.Tensor, fmt: str, q: torch.Tensor, scale: torch.Tensor,
                          minimum: Optional[torch.Tensor]) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype, W (N, K) given by its parts in `fmt` (int8 or int4)."""
    return _launch(x, fmt, q, scale, minimum)


@quantized_linear_cuda.register_fake
def _(x, fmt, q, scale, minimum):
    return x.new_empty(x.shape[0], q.shape[0])


def _launch(x, fmt, q, scale, minimum, config: Optional[dict] = None) -> torch.Tensor:
    """Run the kernel; `config` (BLOCK_N, BLOCK_K, num_warps, num_stages) fixes the tile instead of autotuning."""
    if fmt not in ("int8", "int4"):  # another format's parts mean other things: never read them as these
        raise ValueError(f"the CUDA kernels take int8 and int4, not {fmt!r}: dequantize it for F.linear instead")
    kernels = _kernels()
    rows, k = x.shape
    n = q.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m = 1 if rows == 1 else max(16, 1 << (rows - 1).bit_length())
    int4 = fmt == "int4"
    args = (x, q, scale, minimum if int4 else scale, out, rows, n, k, x.stride(0))
    if config is None and not kernels.interpreted:
        grid = lambda meta: (triton_cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        kernels.tuned[grid](*args, INT4=int4, BLOCK_M=block_m)
    else:
        config = config or {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
        grid = (triton_cdiv(n, config["BLOCK_N"]),)
        launch = {key: value for key, value in config.items() if key.startswith("BLOCK")}
        options = {} if kernels.interpreted else {key: config[key] for key in ("num_warps", "num_stages")}
        kernels.plain[grid](*args, INT4=int4, BLOCK_M=block_m, **launch, **options)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Tiles (BLOCK_N, BLOCK_K, warps, stages) tried once per (N, K, rows bucket, format) at first use, the fastest kept
# (triton.autotune). A small BLOCK_N keeps every multiprocessor busy on a 4096-row weight.
CONFIGS = [(16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (64, 128, 4, 4)]


class _Kernels:
    """The Triton kernel, compiled at first use: `plain` (a fixed tile) and `tuned` (autotuned)."""

    def __init__(self):
        import triton
        import triton.language as tl

        self.interpreted = os.environ.get("TRITON_INTERPRET") == "1"

        @triton.jit
        def kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, M, N, K, stride_xm,
                   INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
            G: tl.constexpr = BLOCK_K // 32  # groups in a tile
            rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            rm = tl.arange(0, BLOCK_M)
            n_ok = rn < N
            m_ok = rm < M
            groups = K // 32
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rg = k0 // 32 + tl.arange(0, G)
                g_mask = n_ok[:, None] & (rg < groups)[None, :]
                s = tl.load(s_ptr + rn[:, None] * groups + rg[None, :], mask=g_mask, other=0.0).to(tl.float32)
                if INT4:
                    # Byte j of a group's 16 holds input j (low nibble) and j + 16 (high): the tile's values come
                    # out interleaved, (byte, nibble), and x is read in that same order instead of reordering W.
                    rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                    b = tl.load(q_ptr + rn[:, None] * (K // 2) + rb[None, :],
                                mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
                    v = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, G, 32)).to(tl.float32)
                    low = tl.load(m_ptr + rn[:, None] * groups + rg[None, :], mask=g_mask, other=0.0).to(tl.float32)
                    w = v * s[:, :, None] + low[:, :, None]
                    i = tl.arange(0, BLOCK_K)
                    rk = k0 + (i // 32) * 32 + (i % 2) * 16 + (i % 32) // 2
                else:
                    rk = k0 + tl.arange(0, BLOCK_K)
                    v = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :],
                                other=0)
                    w = tl.reshape(v.to(tl.float32), (BLOCK_N, G, 32)) * s[:, :, None]
                # W is rounded to x's dtype, as dequantize(parts, dtype) then F.linear would round it
                w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
                xk = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                             other=0.0)
                if BLOCK_M == 1:  # one row: multiply and sum, (1, K) x (N, K) -> (1, N)
                    acc += tl.sum(xk.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
                else:
                    acc += tl.dot(xk, tl.trans(w))
            out = out_ptr + rm[:, None] * N + rn[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

        self.plain = kernel
        configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in CONFIGS]
        self.tuned = triton.autotune(configs, key=["N", "K", "BLOCK_M", "INT4"], do_bench=_quick_bench)(kernel)


def _quick_bench(fn, quantiles=None):
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_KERNELS: Optional[_Kernels] = None


def _kernels() -> _Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _Kernels()
    return _KERNELS


# ---- measured beside ours (benchmarks/gpu.py): torch's tinygemm, with its layout made once ----------------------

def tinygemm_pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, inner_k_tiles: int = 8):
    """int4 parts -> (packed int32 weight, scale-and-zero bfloat16 (K / 32, N, 2)) for torch._weight_int4pack_mm.
    tinygemm computes (v - 8) * scale + zero, so zero = minimum + 8 * scale (in float32, then rounded)."""
    from accessory.quant.formats import unpack_int4

    values = unpack_int4(q).to(torch.int32)  # (N, K) 0..15
    as_bytes = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)  # its input order: even input high
    packed = torch.ops.aten._convert_weight_to_int4pack(as_bytes.contiguous(), inner_k_tiles)
    zero = minimum.float() + 8 * scale.float()
    scale_zero = torch.stack([scale.float().t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scale_zero


def tinygemm_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scale_zero)
