"""Time to a prompt's first token against prompt length, accessory against llama.cpp on the same GGUF file.

For each length N of `--lengths`, the same text (a repeated passage cut to N of accessory's tokens, decoded back)
goes to both engines in one process: accessory's `MetaModel.generate(max_gen_len=1)` on the file loaded with its
bits kept (one forward pass over the prompt, then one token), and llama-cpp-python's `Llama.eval` of the text's
tokens (`n_batch` 512, after `reset`). Each is timed `--repeats` times and the best kept; the table gives both and
the ratio llama.cpp / accessory (above 1: accessory is faster). A warm-up prompt of 64 tokens goes to each first.

    python benchmarks/prefill.py --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        [--lengths 32 64 127 128 129 256 400 512 1024 2048] [--threads 2] [--repeats 2]

llama-cpp-python is a peer for benchmarks only (benchmarks/README.md says how to build it).
"""
from __future__ import annotations

import argparse
import time

import torch

PASSAGE = "The history of the city of Paris, told year by year, from its first settlers to the present day. "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 127, 128, 129, 256, 400, 512, 1024])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llama_cpp import Llama

    from accessory.model.meta import MetaModel

    window = max(args.lengths) + 64
    ours = MetaModel.from_pretrained(args.model, max_seq_len=window)
    theirs = Llama(args.model, n_ctx=window, n_threads=args.threads, n_batch=512, verbose=False)
    tokens = ours.tokenizer.encode(PASSAGE * (window // 8), bos=False, eos=False)

    def accessory_s(text: str) -> float:
        start = time.perf_counter()
        ours.generate([text], max_gen_len=1, temperature=0.0)
        return time.perf_counter() - start

    def llama_cpp_s(text: str) -> float:
        ids = theirs.tokenize(text.encode(), add_bos=False)
        theirs.reset()
        start = time.perf_counter()
        theirs.eval(ids)
        return time.perf_counter() - start

    warm = ours.tokenizer.decode(tokens[:64])
    accessory_s(warm), llama_cpp_s(warm)
    print(f"{args.model}, {args.threads} thread(s), best of {args.repeats}; seconds to the first token")
    print(f"{'tokens':>6} {'accessory':>10} {'llama.cpp':>10} {'llama.cpp / accessory':>22}")
    for n in args.lengths:
        text = ours.tokenizer.decode(tokens[:n])
        a = min(accessory_s(text) for _ in range(args.repeats))
        b = min(llama_cpp_s(text) for _ in range(args.repeats))
        print(f"{n:>6} {a:>10.3f} {b:>10.3f} {b / a:>22.2f}", flush=True)


if __name__ == "__main__":
    main()
