"""Time to a prompt's first token against prompt length, accessory against llama.cpp on the same GGUF file.

For each thread count of `--threads` and each length N of `--lengths`, the same text (a repeated passage cut to N of
accessory's tokens, decoded back) goes to both engines in one process: accessory's `MetaModel.generate(max_gen_len=1)`
on the file loaded with its bits kept (one forward pass over the prompt, then one token), and llama-cpp-python's
`Llama.eval` of the text's tokens (`n_batch` 512, after `reset`). Each is timed `--repeats` times and the best kept;
the table gives both and the ratio llama.cpp / accessory (above 1: accessory is faster). A warm-up prompt of 64
tokens goes to each first. `--exact-products` loads accessory with from_pretrained's exact_products (x in float32
at every length). `--plot FILE.png` draws seconds against tokens, a line per engine and thread count (matplotlib).

    python benchmarks/prefill.py --model gemma-3-270m-q4_k_m.gguf \
        [--lengths 32 64 128 256 512 1024 2048] [--threads 1 2] [--repeats 2] [--plot benchmarks/prefill.png]

llama-cpp-python and matplotlib are for benchmarks only (benchmarks/README.md says how to install them).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

PASSAGE = "The history of the city of Paris, told year by year, from its first settlers to the present day. "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 127, 128, 129, 256, 400, 512, 1024])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--exact-products", action="store_true")
    parser.add_argument("--plot", type=Path, help="a PNG of seconds against tokens")
    args = parser.parse_args()
    from accessory.model.meta import MetaModel

    window = max(args.lengths) + 64
    ours = MetaModel.from_pretrained(args.model, max_seq_len=window, exact_products=args.exact_products)
    tokens = ours.tokenizer.encode(PASSAGE * (window // 8), bos=False, eos=False)
    texts = {n: ours.tokenizer.decode(tokens[:n]) for n in args.lengths}
    lines = {}
    for threads in args.threads:
        accessory, llama_cpp = sweep(ours, args.model, window, threads, texts, args.repeats)
        lines[f"accessory, {threads} thread(s)"], lines[f"llama.cpp, {threads} thread(s)"] = accessory, llama_cpp
    if args.plot:
        plot(lines, Path(args.model).name, args.plot)


def sweep(ours, model: str, window: int, threads: int, texts: dict, repeats: int) -> tuple[list, list]:
    """Both engines' best seconds to the first token at each length, printed as a table; -> (ours, llama.cpp)."""
    from llama_cpp import Llama

    torch.set_num_threads(threads)
    theirs = Llama(model, n_ctx=window, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

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

    warm = texts[min(texts)][:200]
    accessory_s(warm), llama_cpp_s(warm)
    print(f"\n{model}, {threads} thread(s), best of {repeats}; seconds to the first token")
    print(f"{'tokens':>6} {'accessory':>10} {'llama.cpp':>10} {'llama.cpp / accessory':>22}")
    ours_s, theirs_s = [], []
    for n, text in texts.items():
        ours_s.append(min(accessory_s(text) for _ in range(repeats)))
        theirs_s.append(min(llama_cpp_s(text) for _ in range(repeats)))
        print(f"{n:>6} {ours_s[-1]:>10.3f} {theirs_s[-1]:>10.3f} {theirs_s[-1] / ours_s[-1]:>22.2f}", flush=True)
    return list(zip(texts, ours_s)), list(zip(texts, theirs_s))


def plot(lines: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    colors = {}  # one per thread count: accessory solid, llama.cpp dashed
    for label, points in lines.items():
        color = colors.setdefault(label.partition(", ")[2], f"C{len(colors)}")
        axes.plot(*zip(*points), marker="o", color=color, linestyle="-" if label.startswith("accessory") else "--",
                  label=label)
    axes.set(xlabel="prompt tokens", ylabel="seconds to the first token", title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
