"""Wall time of a fresh `accessory generate` process for a one-line answer: eager, against --compile with the
decode step's package already in the cache (compile once, run many: accessory/generation/packaged_steps.py), and
optionally against --compile with an empty package cache (`--cold`: the one-time compilation).

Each run is a new process (`python -m accessory generate --prompt ... --max_gen_len N [--quant Q] [--compile]`) on
the built-in model, timed from its start to its exit: interpreter start, imports, loading, the answer. Before the
timed runs, each runs once untimed (the --compile one makes the package for one row, if the cache lacks it; both
leave the files they read in the page cache). The median of `--repeats` runs, alternating eager and compiled so
that a change in the machine's load falls on both.

    python benchmarks/compile_once.py --quant int4 float32 --repeats 5 [--cold] [--bandwidth]

`--cold` also times one --compile run with $ACCESSORY_CACHE's `compiled` folder moved aside (restored afterwards;
inductor's own caches in /tmp are left as they are). `--bandwidth` prints this machine's memory bandwidth at
`--threads` threads (a 512 MiB float32 tensor summed, and copied), against which a float32 decode step, which
reads every weight once, is bound.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The capital of France is"


def command(verb: str, quant: str, compile: bool, new_tokens: int) -> list[str]:
    args = [sys.executable, "-m", "accessory", verb, "--log-level", "warning"]
    if verb == "generate":
        args += ["--prompt", PROMPT, "--max_gen_len", str(new_tokens)]
    if quant != "float32":
        args += ["--quant", quant]
    return args + (["--compile"] if compile else [])


def timed(args: list[str], env: dict) -> tuple[float, str]:
    """Seconds from start to exit, and what it printed; a failed run stops the benchmark with its error."""
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, done.stdout.strip()


def compiled_folder() -> Path:
    from accessory.cache_dir import cache_dir

    return cache_dir() / "compiled"


def cold_seconds(quant: str, new_tokens: int, env: dict) -> float:
    """One --compile run with no packages in the cache (the folder moved aside, then put back)."""
    folder = compiled_folder()
    aside = Path(tempfile.mkdtemp(dir=folder.parent, prefix="compiled-aside-")) / "compiled"
    if folder.exists():
        os.replace(folder, aside)
    try:
        return timed(command("generate", quant, True, new_tokens), env)[0]
    finally:
        if folder.exists():
            shutil.rmtree(folder)
        if aside.exists():
            os.replace(aside, folder)
        aside.parent.rmdir()


def bench(quant: str, repeats: int, new_tokens: int, cold: bool, env: dict) -> dict:
    eager_answer = timed(command("generate", quant, False, new_tokens), env)[1]
    compiled_answer = timed(command("generate", quant, True, new_tokens), env)[1]
    eager, compiled = [], []
    for _ in range(repeats):
        eager.append(timed(command("generate", quant, False, new_tokens), env)[0])
        compiled.append(timed(command("generate", quant, True, new_tokens), env)[0])
    row = {"quant": quant, "eager": statistics.median(eager), "compiled": statistics.median(compiled),
           "eager_range": (min(eager), max(eager)), "compiled_range": (min(compiled), max(compiled)),
           "same_answer": eager_answer == compiled_answer}
    row["cold"] = cold_seconds(quant, new_tokens, env) if cold else None
    return row


def bandwidth(threads: int, repeats: int = 5) -> tuple[float, float]:
    """GB/s reading a 512 MiB float32 tensor (a sum), and copying it (read + write counted), the best of `repeats`."""
    import torch

    torch.set_num_threads(threads)
    source = torch.ones(128 << 20)
    target = torch.empty_like(source)
    read, copied = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        source.sum()
        read.append(source.nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        target.copy_(source)
        copied.append(2 * source.nbytes / (time.perf_counter() - start) / 1e9)
    return max(read), max(copied)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quant", nargs="+", default=["int4", "float32"], choices=["float32", "int8", "int4"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="also time one --compile run with no packages cached")
    p.add_argument("--bandwidth", action="store_true", help="also measure the memory bandwidth")
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    print("| weights | eager s | (range) | --compile, package cached s | (range) | ratio | cold --compile s | "
          "same answer |")
    print("|---|--:|--:|--:|--:|--:|--:|---|")
    for quant in args.quant:
        r = bench(quant, args.repeats, args.new_tokens, args.cold, env)
        cold = "-" if r["cold"] is None else f"{r['cold']:.1f}"
        print(f"| {quant} | {r['eager']:.2f} | {r['eager_range'][0]:.2f}-{r['eager_range'][1]:.2f} | "
              f"{r['compiled']:.2f} | {r['compiled_range'][0]:.2f}-{r['compiled_range'][1]:.2f} | "
              f"{r['compiled'] / r['eager']:.2f}x | {cold} | {'yes' if r['same_answer'] else 'NO'} |", flush=True)
    if args.bandwidth:
        read, copied = bandwidth(args.threads)
        print(f"memory bandwidth at {args.threads} threads: {read:.1f} GB/s read (sum), {copied:.1f} GB/s copy")


if __name__ == "__main__":
    main()
