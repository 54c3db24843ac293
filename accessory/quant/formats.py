"""The weight-only formats: a weight W (out, in) held as parts whose rows are W's rows, each row cut along `in` into
blocks of a fixed number of values. Pure torch, any device; the fast CPU products are in accessory/kernels/.

Ours, made by `quantize` (`accessory quantize`, `quant=`): groups of GROUP consecutive inputs, each group with its
own float16 scale (and minimum, for int4).

| format | tensors (out = rows of W, groups = in / 32)          | W[n, k] (g = k // 32)          | bits/weight |
|--------|------------------------------------------------------|--------------------------------|-------------|
| int8   | q int8 (out, in), scale fp16 (out, groups)           | scale[n, g] * q[n, k]          | 8.5         |
| int4   | q uint8 (out, in / 2), scale, min fp16 (out, groups) | scale[n, g] * q4[n, k] + min   | 5           |

int4 packs two values per byte in GGUF's order: in each group's 16 bytes, byte j holds element j in its low nibble and
element j + 16 in its high one. So llama.cpp's Q8_0 (int8), Q4_1 (int4) and Q4_0 (int4 with min = -8 * scale) map
onto these formats bit for bit (checkpoint/importers/gguf.py), and dequantize to exactly what the `gguf` package
gives. The quantizers follow llama.cpp's Q8_0 and Q4_1 (scale = max |w| / 127; scale = (max - min) / 15 and min),
rounding each value against the float16 scale and minimum that are stored.

Import-only, kept from GGUF files (`accessory convert gguf --keep-quantized`): llama.cpp's blocks as the file holds
them, one uint8 part `q` (out, in / block * block bytes), a row's blocks one after another. There is no quantizer
for them (llama.cpp's K-quant search is not reproduced here): `quantize` refuses them by name.

| format | GGUF | block: values, bytes | a block                                               | W = ...                  | bits/weight |
|--------|------|----------------------|-------------------------------------------------------|--------------------------|-------------|
| q4_k   | Q4_K | 256, 144             | d, dmin fp16; 8 x (6-bit sc, 6-bit m); 256 x 4 bits   | d*sc * q - dmin*m        | 4.5         |
| q5_k   | Q5_K | 256, 176             | as Q4_K, plus a 5th bit per value (32 bytes)          | d*sc * q - dmin*m        | 5.5         |
| q6_k   | Q6_K | 256, 210             | 256 x 6 bits (4 low + 2 high); 16 x int8 sc; d fp16   | d*sc * (q - 32)          | 6.5625      |
| q5_0   | Q5_0 | 32, 22               | d fp16; 32 high bits; 32 x 4 low bits                 | d * (q - 16)             | 5.5         |

(K types: sc and m per 32 values, Q6_K's sc per 16.) Why the blocks as they are rather than unpacked parts: memory
and bandwidth stay the file's 4.5 to 6.6 bits per weight (unpacking to int8 values plus float scales would take 8.5
or more), importing copies bytes, and each block sits in one contiguous run that the CPU kernels stream and
dequantize in registers. Rows are rows of every part, so row slices and row permutations (tensor parallelism's
column splits, RoPE layouts) are plain indexing; a split of `in` must fall on whole blocks (`block_size`).
Dequantizing is bit-exact to the gguf package: every d*sc*q is exact in float32 (at most 23 significant bits), so
each value is rounded once, at the subtraction of dmin*m, as numpy's float32 computes it.
"""
from __future__ import annotations

import torch

GROUP = 32
QUANTIZERS = ("int8", "int4")  # the formats `quantize` makes
GGUF_BLOCKS = {"q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "q5_0": (32, 22)}  # values, bytes
FORMATS = (*QUANTIZERS, *GGUF_BLOCKS)
PARTS = {"int8": ("q", "scale"), "int4": ("q", "scale", "min"),  # the tensors of each format, in order
         **{fmt: ("q",) for fmt in GGUF_BLOCKS}}


def check_format(fmt: str, source: str = "quant", quantizing: bool = False) -> str:
    """`fmt` if it is a known format (one `quantize` makes, if `quantizing`), else a ValueError naming `source`."""
    if fmt not in FORMATS:
        raise ValueError(f"{source}: unknown quantization format {fmt!r}; known: {list(FORMATS)}")
    if quantizing and fmt not in QUANTIZERS:
        raise ValueError(f"{source}: {fmt!r} is an import-only format (GGUF's {fmt.upper()} blocks, kept by "
                         f"`accessory convert gguf --keep-quantized`); weights can be quantized to "
                         f"{list(QUANTIZERS)}")
    return fmt


def block_size(fmt: str) -> int:
    """Inputs per block of `fmt`: a split of `in` across ranks must fall on multiples of it."""
    return GGUF_BLOCKS[fmt][0] if fmt in GGUF_BLOCKS else GROUP


def packed_in(fmt: str, in_features: int) -> int:
    """Columns of q for `in_features` inputs (a multiple of the block): two int4 values share a byte; a GGUF
    block format stores each block of values in its block's bytes."""
    if fmt in GGUF_BLOCKS:
        values, nbytes = GGUF_BLOCKS[fmt]
        return in_features // values * nbytes
    return in_features // 2 if fmt == "int4" else in_features


def part_shapes(fmt: str, out_features: int, in_features: int) -> dict[str, tuple[int, int]]:
    shapes = {"q": (out_features, packed_in(fmt, in_features))}
    if fmt in QUANTIZERS:
        shapes["scale"] = (out_features, in_features // GROUP)
    if fmt == "int4":
        shapes["min"] = shapes["scale"]
    return shapes


PART_DTYPES = {"int8": {"q": torch.int8, "scale": torch.float16},
               "int4": {"q": torch.uint8, "scale": torch.float16, "min": torch.float16},
               **{fmt: {"q": torch.uint8} for fmt in GGUF_BLOCKS}}


def quantize(weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The parts of `weight` (out, in; in a multiple of GROUP) in `fmt` (int8 or int4), computed in float32."""
    check_format(fmt, quantizing=True)
    out, features = weight.shape
    if features % GROUP:
        raise ValueError(f"{features} input features are not a multiple of the quantization group size {GROUP}")
    groups = weight.float().reshape(out, features // GROUP, GROUP)
    if fmt == "int8":  # symmetric, as llama.cpp's Q8_0: scale = max |w| / 127
        scale = (groups.abs().amax(-1) / 127).half()
        q = (groups * _inverse(scale)[..., None]).round().clamp(-127, 127).to(torch.int8)
        return {"q": q.reshape(out, features), "scale": scale}
    low = groups.amin(-1)  # asymmetric, as llama.cpp's Q4_1: min and (max - min) / 15
    scale, minimum = ((groups.amax(-1) - low) / 15).half(), low.half()
    q = ((groups - minimum.float()[..., None]) * _inverse(scale)[..., None]).round().clamp(0, 15).to(torch.uint8)
    return {"q": pack_int4(q.reshape(out, features)), "scale": scale, "min": minimum}


def dequantize(parts: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W (out, in) from its parts, computed in float32 as llama.cpp and the gguf package do, then cast to dtype."""
    if fmt in GGUF_BLOCKS:
        return _dequantize_blocks(parts["q"], fmt).to(dtype)
    scale = parts["scale"].float()[..., None]  # (out, groups, 1)
    if fmt == "int8":
        q = parts["q"].float().reshape(*scale.shape[:2], GROUP)
        weight = q * scale
    else:
        q = unpack_int4(parts["q"]).float().reshape(*scale.shape[:2], GROUP)
        weight = q * scale + parts["min"].float()[..., None]
    return weight.reshape(scale.shape[0], -1).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values 0..15 -> (out, in / 2) bytes, GGUF's order within each group."""
    halves = q.reshape(q.shape[0], -1, 2, GROUP // 2)  # (out, groups, low/high, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(q.shape[0], -1)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in / 2) bytes -> (out, in) values 0..15."""
    pairs = packed.reshape(packed.shape[0], -1, GROUP // 2)  # (out, groups, 16)
    return torch.cat([pairs & 15, pairs >> 4], dim=-1).reshape(packed.shape[0], -1)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32, 0 where the scale is 0 (an all-equal group: every q is 0)."""
    scale = scale.float()
    return torch.where(scale > 0, 1 / scale.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros(()))


# ---- GGUF blocks --------------------------------------------------------------------------------------------------

def _dequantize_blocks(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """W (out, in) float32 from a GGUF block format's bytes q (out, blocks * block bytes), as gguf.quants does."""
    values, nbytes = GGUF_BLOCKS[fmt]
    rows = q.shape[0]
    blocks = q.reshape(rows, -1, nbytes)  # (out, blocks, block bytes)
    if fmt == "q5_0":
        d = _half(blocks[..., 0:2])  # (out, blocks, 1)
        high = _bits(blocks[..., 2:6])  # (out, blocks, 32): the 5th bit of value j is bit j of 4 little-endian bytes
        low = _nibbles(blocks[..., 6:22])  # (out, blocks, 32): value j < 16 in byte j's low nibble, j + 16 its high
        weight = d * ((low | (high << 4)).float() - 16)  # exact: d has 11 significant bits, q - 16 five
    elif fmt == "q6_k":
        # Two halves of 128 values: 64 bytes of low 4 bits (values 0-63 low nibbles, 64-127 high), 32 of high 2 bits
        low = _nibbles(blocks[..., 0:128].reshape(rows, -1, 2, 1, 64), dim=-2).reshape(rows, -1, 2, 4, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=q.device)[:, None]
        high = (blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> shifts) & 3  # (out, blocks, 2, 4, 32)
        q6 = ((low | (high << 4)).float() - 32).reshape(rows, -1, 16, 16)  # (out, blocks, 16 scales, 16 values)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # (out, blocks, 16)
        weight = (_half(blocks[..., 208:210]) * scales)[..., None] * q6  # d * sc * q, each product exact
    else:  # q4_k, q5_k: 8 sub-blocks of 32 values, each with a 6-bit scale and a 6-bit minimum
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
        sc, m = _k_scales(blocks[..., 4:16])  # (out, blocks, 8)
        first = 16 if fmt == "q4_k" else 48  # q5_k: 32 bytes of 5th bits first (bit i of byte l: sub-block i)
        low = _nibbles(blocks[..., first:first + 128].reshape(rows, -1, 4, 1, 32), dim=-2)  # (out, blocks, 4, 2, 32)
        q5 = low.reshape(rows, -1, 8, 32)
        if fmt == "q5_k":
            shifts = torch.arange(8, dtype=torch.uint8, device=q.device)[:, None]
            q5 = q5 | (((blocks[..., None, 16:48] >> shifts) & 1) << 4)  # (out, blocks, 8, 32)
        weight = (d * sc.float())[..., None] * q5.float() - (dmin * m.float())[..., None]
    return weight.reshape(rows, -1)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian float16 bytes -> (..., 1) float32."""
    return two_bytes.contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Low nibbles, then high nibbles, concatenated along `dim`."""
    return torch.cat([packed & 15, packed >> 4], dim=dim)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 8 n) their bits, least significant first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 1).flatten(-2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 scales and 8 minimums of 6 bits: sub-blocks 0-3 in the low 6 bits of bytes 0-3
    (scales) and 4-7 (minimums); 4-7 in bytes 8-11's nibbles, topped by bytes 0-7's two high bits."""
    s, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([s & 63, (low & 15) | ((s >> 2) & 48)], dim=-1)
    minimums = torch.cat([m & 63, (low >> 4) | ((m >> 2) & 48)], dim=-1)
    return scales, minimums
