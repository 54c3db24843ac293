"""Weight-only quantized (and float32) matrix products on the CPU: every candidate on one pass over the built-in
model's linear layers, at the decode batch sizes that matter.

A "pass" is what one decode step multiplies: per layer x @ W^T with W of shapes wqkv (960, 576), wo (576, 576),
w1|w3 (3072, 576) and w2 (576, 1536), 30 layers, then the output head (49152, 576); 121 products, each W distinct (so
the weights stream from memory, as in the model). x has M rows (the batch). Random weights of the right shapes and
formats: speed depends on shapes and bytes, not values. Median of `--repeats` passes, in ms; all candidates in one
run, one thread count.

Candidates:
- float32: F.linear (the BLAS library torch ships, MKL on x86), and ours (accessory::linear_cpu, kernels/).
- int8: torch's `_weight_int8pack_mm` (per-channel scales), FBGEMM's `quantized.linear_dynamic` (per-channel, and
  it also quantizes x, so not weight-only), inductor-compiled dequantize + F.linear (groups of 32), and ours.
- int4: torch's `_weight_int4pack_mm_for_cpu` (groups of 32), inductor-compiled dequantize + F.linear (groups of
  32), ours (groups of 32, GGUF's layout), and ours with x quantized to int8 (a draft model's products: not exact;
  the int4 weights repacked in tiles of 16 rows).

    python benchmarks/kernels.py --rows 1 16 --repeats 5 --threads 2

`--model gemma3`: GGUF's block formats (kept from a file by `convert gguf --keep-quantized`) on Gemma 3 270M's
shapes, 18 layers of q (1024, 640), k and v (256, 640), o (640, 1024), gate and up (2048, 640), down (640, 2048),
and the output head (262144, 640). The K types need inputs in multiples of 256, so only o and down can be Q4_K /
Q5_K / Q6_K (that is why the Q4_K_M file holds the others in Q5_0): each format runs on the products it can hold,
beside the int4 kernel on the same products (a reference of bytes per second), the Q8_0 head alone (as int8), and
the file's own mix (Q5_0, Q8_0, Q4_K, Q6_K as Google's Q4_K_M holds them, the Q8_0 head as int8) runs on the whole
pass. Each is our kernel (accessory::quantized_linear_cpu, called directly, whatever the row count) against the
portable path (W dequantized in 8 MiB chunks for F.linear, dispatch.py) and the product with x quantized to int8
(accessory::gguf_int8x_linear_cpu, what a prompt's rows take: dispatch.py GGUF_INT8X_ROWS), so the rows where they
cross are visible:

    python benchmarks/kernels.py --model gemma3 --rows 1 16 --repeats 5 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
GROUP = 32
# Gemma 3 270M: per layer q, k, v, o, gate, up, down (out, in), 18 layers, then the head; the Q4_K_M file's formats
GEMMA_LAYER = {"q": (1024, 640), "k": (256, 640), "v": (256, 640), "o": (640, 1024), "gate": (2048, 640),
               "up": (2048, 640), "down": (640, 2048)}
GEMMA_LAYERS, GEMMA_HEAD = 18, (262144, 640)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="+", help="run only the candidates whose name contains one of these")
    p.add_argument("--best", action="store_true", help="the fastest pass of the repeats instead of the median (on a "
                   "machine shared with other work, which only ever slows a pass)")
    p.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2",
                   help="smollm2: float32, int8, int4 on SmolLM2-135M's shapes; gemma3: GGUF's block formats")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from accessory.kernels import cpu_kernels, kernel_isa

    cpu_kernels()
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, ours built for {kernel_isa()}, "
          f"{args.threads} threads", end="")
    if args.model == "gemma3":
        return gemma3(args)
    print(f"; ms per pass over SmolLM2-135M's 121 products ({'best' if args.best else 'median'} of {args.repeats})\n")
    weights = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    candidates = [c for c in CANDIDATES if not args.only or any(o in c[0] for o in args.only)]
    rows_header = " | ".join(f"M={m}" for m in args.rows)
    print(f"| candidate | bytes of W | {rows_header} |")
    print("|---|--:|" + "--:|" * len(args.rows))
    for name, prepare in candidates:
        try:
            product, nbytes = prepare(weights)
            times = [pass_ms(product, m, args.repeats, best=args.best) for m in args.rows]
            cells = " | ".join(f"{t:.2f}" for t in times)
            print(f"| {name} | {nbytes / 2 ** 20:.0f} MiB | {cells} |", flush=True)
        except Exception as e:  # a candidate this torch build lacks: say so, go on
            print(f"| {name} | - | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} |", flush=True)


def pass_ms(product, rows: int, repeats: int, shapes=SHAPES, best: bool = False) -> float:
    xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
    run = lambda: [product(i, xs[k]) for i, (_, k) in enumerate(shapes)]  # noqa: E731
    run()
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times) if best else statistics.median(times)


# ---- candidates: each returns (product(i, x) -> y, bytes of all W) ---------------------------------------------------

def fp32_library(weights):
    return (lambda i, x: F.linear(x, weights[i])), sum(w.numel() * 4 for w in weights)


def fp32_ours(weights):
    from accessory.kernels import linear

    return (lambda i, x: linear(x, weights[i])), sum(w.numel() * 4 for w in weights)


def per_channel_int8(weights):
    scales = [w.abs().amax(1) / 127 for w in weights]
    return [(w / s[:, None]).round().to(torch.int8) for w, s in zip(weights, scales)], scales


def int8_pack_mm(weights):
    q, scales = per_channel_int8(weights)
    return (lambda i, x: torch._weight_int8pack_mm(x, q[i], scales[i])), sum(t.numel() for t in q)


def int8_fbgemm(weights):
    packed = [torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(w, w.abs().amax(1) / 127, torch.zeros(w.shape[0], dtype=torch.long), 0,
                                   torch.qint8), None) for w in weights]
    return (lambda i, x: torch.ops.quantized.linear_dynamic(x, packed[i])), sum(w.numel() for w in weights)


def grouped(weights, fmt):
    from accessory.quant.formats import quantize

    parts = [quantize(w, fmt) for w in weights]
    return parts, sum(t.numel() * t.element_size() for p in parts for t in p.values())


def compiled_dequantize(fmt):
    def prepare(weights):
        from accessory.quant.formats import dequantize

        parts, nbytes = grouped(weights, fmt)
        product = torch.compile(lambda x, p: F.linear(x, dequantize(p, fmt)), dynamic=False)
        return (lambda i, x: product(x, parts[i])), nbytes
    return prepare


def ours(fmt):
    def prepare(weights):
        from accessory.kernels import quantized_linear

        parts, nbytes = grouped(weights, fmt)
        return (lambda i, x: quantized_linear(x, fmt, parts[i]["q"], parts[i]["scale"], parts[i].get("min"))), nbytes
    return prepare


def int4_int8x(weights):
    """int4 with x quantized to int8 (a draft model's products, inexact; AVX-512 VNNI or AVX2), its own repacking;
    the operator called directly, whatever the row count."""
    from accessory.kernels.dispatch import pack_int4_int8x

    parts, _ = grouped(weights, "int4")
    packed = [pack_int4_int8x(p["q"], p["scale"], p["min"]) for p in parts]
    nbytes = sum(t.numel() * t.element_size() for p in packed for t in p)
    return (lambda i, x: torch.ops.accessory.int4_int8x_linear_cpu(x, *packed[i], parts[i]["q"].shape[0])), nbytes


def int4_pack_mm(weights):
    from accessory.quant.formats import quantize, unpack_int4

    packed, scales_zeros, nbytes = [], [], 0
    for w in weights:
        parts = quantize(w, "int4")
        q = unpack_int4(parts["q"]).to(torch.int32)  # (N, K) values 0..15
        packed.append(torch._convert_weight_to_int4pack_for_cpu(q, 2))
        # torch's form: W = (q - 8) * scale + zero, scales and zeros (K / group, N, 2)
        scale = parts["scale"].float()
        zero = parts["min"].float() + 8 * scale
        scales_zeros.append(torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        nbytes += packed[-1].numel() * packed[-1].element_size() + scales_zeros[-1].numel() * 4
    return (lambda i, x: torch._weight_int4pack_mm_for_cpu(x, packed[i], GROUP, scales_zeros[i])), nbytes


# ---- Gemma 3 270M: GGUF's block formats --------------------------------------------------------------------------

def gemma3(args) -> None:
    """Per format, on the products it can hold: ours, the portable path, and int4 ours on the same products."""
    layer = [(name, shape) for name, shape in GEMMA_LAYER.items()] * GEMMA_LAYERS
    mix = [(shape, "q4_k" if name == "o" or (name == "down" and i % 2) else "q8_0" if name == "v" and i % 2
            else "q6_k" if name == "down" else "q5_0") for i, (name, shape) in enumerate(layer)]
    sets = {"q4_k": [(shape, "q4_k") for name, shape in layer if name in ("o", "down")],
            "q5_k": [(shape, "q5_k") for name, shape in layer if name in ("o", "down")],
            "q6_k": [(shape, "q6_k") for name, shape in layer if name in ("o", "down")],
            "q5_0": [(shape, "q5_0") for _, shape in layer],
            "q8_0 head": [(GEMMA_HEAD, "q8_0")],
            "Q4_K_M file mix": mix + [(GEMMA_HEAD, "q8_0")]}
    print(f"; ms per pass ({'best' if args.best else 'median'} of {args.repeats}) and weight bytes streamed per "
          f"second\n")
    rows_header = " | ".join(f"M={m} ms | GB/s" for m in args.rows)
    print(f"| format (products) | candidate | bytes of W | {rows_header} |")
    print("|---|---|--:|" + "--:|--:|" * len(args.rows))
    for label, products in sets.items():
        shapes = [shape for shape, _ in products]
        formats = {fmt for _, fmt in products}
        parts = [block_parts(shape, fmt) for shape, fmt in products]
        candidates = [("ours", kernel_product), ("dequantize + F.linear", portable_product)]
        if formats & {"q4_k", "q5_k", "q6_k", "q5_0"}:
            candidates.append(("ours, x in int8 (a prompt's)", int8x_product))
        if formats <= {"q4_k", "q5_k", "q6_k", "q5_0"}:
            candidates.append(("int4 ours, same products", None))
        for name, make in candidates:
            if args.only and not any(o in f"{label} {name}" for o in args.only):
                continue
            these = parts if make else [block_parts(shape, "int4") for shape in shapes]
            product = (make or kernel_product)(these)
            nbytes = sum(t.numel() * t.element_size() for fmt, p in these for t in p.values())
            times = [pass_ms(product, m, args.repeats, shapes, args.best) for m in args.rows]
            cells = " | ".join(f"{t:.2f} | {nbytes / t / 1e6:.1f}" for t in times)
            print(f"| {label} ({len(shapes)}) | {name} | {nbytes / 2 ** 20:.0f} MiB | {cells} |", flush=True)


def block_parts(shape, fmt):
    """(our format, its parts) for a random weight of `shape`: GGUF blocks as random valid bytes (speed depends on
    bytes, not values), int4 / int8 (Q8_0) quantized from random floats."""
    out, features = shape
    if fmt in ("int4", "q8_0"):
        from accessory.quant.formats import quantize

        ours = "int8" if fmt == "q8_0" else fmt
        return ours, quantize(torch.randn(out, features) * 0.05, ours)
    from accessory.quant.formats import GGUF_BLOCKS

    values, nbytes = GGUF_BLOCKS[fmt]
    q = torch.randint(0, 256, (out, features // values, nbytes), dtype=torch.uint8)
    halves = (torch.randn(out, features // values, len(HALF_AT[fmt])) * 1e-3).half().view(torch.uint8)
    for i, at in enumerate(HALF_AT[fmt]):
        q[..., at:at + 2] = halves[..., 2 * i:2 * i + 2]
    return fmt, {"q": q.reshape(out, -1)}


HALF_AT = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q5_0": (0,)}  # a block's float16 d (and dmin)


def kernel_product(parts):
    return lambda i, x: torch.ops.accessory.quantized_linear_cpu(x, parts[i][0], parts[i][1]["q"],
                                                                 parts[i][1].get("scale"), parts[i][1].get("min"))


def int8x_product(parts):
    """A GGUF block format's product with x quantized to int8 (what a prompt's rows take); others as ours."""
    from accessory.quant.formats import GGUF_BLOCKS

    kernel = kernel_product(parts)
    return lambda i, x: (torch.ops.accessory.gguf_int8x_linear_cpu(x, parts[i][0], parts[i][1]["q"])
                         if parts[i][0] in GGUF_BLOCKS else kernel(i, x))


def portable_product(parts):
    from accessory.kernels.dispatch import _dequantized_product

    return lambda i, x: _dequantized_product(x, parts[i][0], parts[i][1]["q"], parts[i][1].get("scale"),
                                             parts[i][1].get("min"))


CANDIDATES = [
    ("float32 F.linear (torch's BLAS)", fp32_library),
    ("float32 ours (accessory::linear_cpu)", fp32_ours),
    ("int8 torch._weight_int8pack_mm (per channel)", int8_pack_mm),
    ("int8 FBGEMM linear_dynamic (per channel; quantizes x too)", int8_fbgemm),
    ("int8 torch.compile(dequantize + F.linear), groups of 32", compiled_dequantize("int8")),
    ("int8 ours, groups of 32", ours("int8")),
    ("int4 torch._weight_int4pack_mm_for_cpu, groups of 32", int4_pack_mm),
    ("int4 torch.compile(dequantize + F.linear), groups of 32", compiled_dequantize("int4")),
    ("int4 ours, groups of 32 (GGUF Q4_1 layout)", ours("int4")),
    ("int4 ours with x in int8 (a draft's: inexact), tiles of 16 rows", int4_int8x),
]

if __name__ == "__main__":
    main()
