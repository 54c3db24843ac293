"""The two weight-only formats: a weight W (out, in) in groups of GROUP consecutive inputs, each group with its own
float16 scale (and minimum, for int4). Pure torch, any device; the fast CPU products are in accessory/kernels/.

| format | tensors (out = rows of W, groups = in / 32)          | W[n, k] (g = k // 32)          | bits/weight |
|--------|------------------------------------------------------|--------------------------------|-------------|
| int8   | q int8 (out, in), scale fp16 (out, groups)           | scale[n, g] * q[n, k]          | 8.5         |
| int4   | q uint8 (out, in / 2), scale, min fp16 (out, groups) | scale[n, g] * q4[n, k] + min   | 5           |

int4 packs two values per byte in GGUF's order: in each group's 16 bytes, byte j holds element j in its low nibble and
element j + 16 in its high one. So llama.cpp's Q8_0 (int8), Q4_1 (int4) and Q4_0 (int4 with min = -8 * scale) map
onto these formats bit for bit (checkpoint/importers/gguf.py), and dequantize to exactly what the `gguf` package
gives. The quantizers follow llama.cpp's Q8_0 and Q4_1 (scale = max |w| / 127; scale = (max - min) / 15 and min),
rounding each value against the float16 scale and minimum that are stored.
"""
from __future__ import annotations

import torch

GROUP = 32
FORMATS = ("int8", "int4")
PARTS = {"int8": ("q", "scale"), "int4": ("q", "scale", "min")}  # the tensors of each format, in order


def check_format(fmt: str, source: str = "quant") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{source}: unknown quantization format {fmt!r}; known: {list(FORMATS)}")
    return fmt


def packed_in(fmt: str, in_features: int) -> int:
    """Columns of q for `in_features` inputs: two int4 values share a byte."""
    return in_features // 2 if fmt == "int4" else in_features


def part_shapes(fmt: str, out_features: int, in_features: int) -> dict[str, tuple[int, int]]:
    shapes = {"q": (out_features, packed_in(fmt, in_features)), "scale": (out_features, in_features // GROUP)}
    if fmt == "int4":
        shapes["min"] = shapes["scale"]
    return shapes


PART_DTYPES = {"int8": {"q": torch.int8, "scale": torch.float16},
               "int4": {"q": torch.uint8, "scale": torch.float16, "min": torch.float16}}


def quantize(weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The parts of `weight` (out, in; in a multiple of GROUP) in `fmt`, computed in float32."""
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
