"""Mixture of experts against the dense model of the same active size: batch-1 (and batch-16) decode time per step.

A Mixtral-shaped random model (8 experts, top 2, each expert a SwiGLU of `--hidden`) and a LLaMA with one SwiGLU of
2 * hidden: per token both multiply the same attention weights and 2 * 3 * dim * hidden MLP weights, so a mixture
that reads only its 2 chosen experts' weights costs about what the dense model costs; one that read all 8 would
cost about 4x the MLP. Both run in one process, one after the other, on the model's own prefill and decode step
(the engine's step, without the engine around it: `Transformer.decode` on a KV cache), eager and compiled
(torch.compile of `decode`), float32 and int4 (weights random: speed depends on shapes and bytes, not values).
Median ms per decode step over `--steps` steps, after warm-up; the ratio MoE / dense is what to read.

    python benchmarks/moe.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(llama_type: str, args: argparse.Namespace, quant: str | None):
    from accessory.network.LLM import model_classes
    from accessory.parallel import ParallelContext
    from accessory.parallel.quantized_weight import QuantizedWeight

    model_args, transformer = model_classes(llama_type)
    config = dict(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128, n_kv_heads=2, vocab_size=32000,
                  max_seq_len=args.columns)
    if llama_type == "mixtral":
        config.update(hidden_dim=args.hidden, moe={"num_experts": 8, "num_experts_per_tok": 2})
    else:
        config.update(hidden_dim=2 * args.hidden)
    with torch.device("meta"):
        model = transformer(model_args(**config), ParallelContext(None, 0, 1, 0))
    if quant:
        model.quantize_(model.quantization_plan(quant))
    model.materialize(torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantizedWeight):
                module.q.copy_(torch.randint(0, 256, module.q.shape, generator=generator).to(module.q.dtype))
                module.scale.fill_(0.01)
                if hasattr(module, "min"):
                    module.min.fill_(-0.08)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return model


def decode_ms(model, rows: int, steps: int, compiled: bool) -> float:
    from accessory.network.components import Segment, decode_mask
    from accessory.network.kv_caches import KVCaches

    columns = model.args.max_seq_len
    caches = KVCaches.allocate(model, rows, columns)
    prompt = 8
    tokens = torch.randint(10, 32000, (rows * prompt,))
    with torch.inference_mode():
        model.prefill(tokens, [Segment(r * prompt, prompt, r) for r in range(rows)], caches)
        step = torch.compile(model.decode, dynamic=False) if compiled else model.decode
        times, token = [], torch.randint(10, 32000, (rows,))
        for i in range(steps + 3):
            positions = torch.full((rows,), prompt + i)
            start = time.perf_counter()
            logits = step(token, positions, decode_mask(positions, columns), caches)
            token = logits.argmax(-1)  # each step's token from the last: the routing follows the decoding
            if i >= 3:  # warm-up (and compilation)
                times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=3584, help="each expert's hidden size (Mixtral's ratio: 3.5 dim)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--columns", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--quant", nargs="+", default=["float32", "int4"])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"dim {args.dim}, {args.layers} layers, 8 experts of hidden {args.hidden}, top 2; dense hidden "
          f"{2 * args.hidden}; {torch.get_num_threads()} threads")
    print(f"{'weights':8} {'rows':>4} {'mode':8} {'moe ms':>8} {'dense ms':>8} {'ratio':>6}")
    for quant in args.quant:
        models = {kind: build(kind, args, None if quant == "float32" else quant) for kind in ("mixtral", "llama")}
        for rows in args.rows:
            for compiled in (False, True):
                moe, dense = (decode_ms(models[kind], rows, args.steps, compiled) for kind in ("mixtral", "llama"))
                mode = "compiled" if compiled else "eager"
                print(f"{quant:8} {rows:>4} {mode:8} {moe:8.2f} {dense:8.2f} {moe / dense:6.2f}", flush=True)
        del models


if __name__ == "__main__":
    main()
