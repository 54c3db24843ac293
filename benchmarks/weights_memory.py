"""Peak memory and time of the on-disk weight tools on a ~1 GB checkpoint (random weights, deleted afterwards).

    OMP_NUM_THREADS=1 python benchmarks/weights_memory.py [--dim 2048] [--layers 8] [--work DIR]

Builds a bf16 base (dim 2048, 8 layers, vocab 32000: 542M parameters, 1.08 GB) at 2 shards and a fine-tuned copy
(base + noise) at 2 shards, then runs extract, apply and reshard, each in a fresh process, and prints for each its
wall time, its peak resident set (VmHWM, which counts the input pages memory-mapped and read) and its peak anonymous
memory (RssAnon, sampled every 5 ms: what the process itself allocated), beside a process that only imports the
runtime.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def make_checkpoints(root: Path, dim: int, layers: int) -> tuple[Path, Path]:
    from accessory.checkpoint.save import save_checkpoint
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.parallel import ParallelContext

    config = dict(dim=dim, n_layers=layers, n_heads=dim // 128, vocab_size=32000)
    with torch.device("meta"):
        model = Transformer(ModelArgs(**config), ParallelContext(None, 0, 1, 0))
    generator = torch.Generator().manual_seed(0)
    base = {name: (torch.randn(p.shape, generator=generator) * 0.02).to(torch.bfloat16)
            for name, p in model.named_parameters()}
    base_dir = save_checkpoint(root / "base", base, config, 2)
    for value in base.values():  # fine-tuned = base + small noise, in place to keep one copy in memory
        value.add_((torch.randn(value.shape, generator=generator) * 0.002).to(torch.bfloat16))
    return base_dir, save_checkpoint(root / "finetuned", base, config, 2)


def measure(argv: list[str]) -> dict:
    """Run `accessory` with argv in a fresh process; its wall time and peak memory (MiB)."""
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(argv)], check=True, capture_output=True,
                         text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(argv: list[str]) -> None:
    peak = [0]

    def sample():
        while True:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak[0] = max(peak[0], int(line.split()[1]))
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    from accessory.cli import build_parser, run

    start = time.perf_counter()
    if argv:
        args = build_parser().parse_args(argv)
        run(args.handler, args)
    wall = time.perf_counter() - start
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    time.sleep(0.01)
    print(json.dumps({"wall_s": round(wall, 1), "peak_rss_mib": hwm // 1024, "peak_anon_mib": peak[0] // 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", help="folder for the temporary checkpoints (default: the system's temp folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(json.loads(args.child))
    root = Path(tempfile.mkdtemp(prefix="weights-memory-", dir=args.work))
    try:
        base, tuned = make_checkpoints(root, args.dim, args.layers)
        size = sum(p.stat().st_size for p in base.glob("consolidated.*")) / 2 ** 30
        print(f"checkpoint: {size:.2f} GiB bf16 at 2 shards (dim {args.dim}, {args.layers} layers)")
        runs = {
            "import only": [],
            "extract 2+2 -> 2 (bf16 delta)": ["weights", "extract", "--pretrained_path", str(base), "--delta_path",
                                              str(tuned), "--output_path", str(root / "delta")],
            "apply 2+2 -> 2": ["weights", "apply", "--pretrained_path", str(base), "--delta_path",
                               str(root / "delta"), "--output_path", str(root / "applied")],
            "apply 2+2 -> 1": ["weights", "apply", "--pretrained_path", str(base), "--delta_path",
                               str(root / "delta"), "--output_path", str(root / "applied-1"), "--shards", "1"],
            "reshard 2 -> 4": ["reshard", str(base), str(root / "base-4"), "--shards", "4"],
        }
        print("| operation | wall (s) | peak RSS (MiB) | peak anonymous (MiB) |\n|---|---|---|---|")
        for name, argv in runs.items():
            m = measure(argv)
            print(f"| {name} | {m['wall_s']} | {m['peak_rss_mib']} | {m['peak_anon_mib']} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
