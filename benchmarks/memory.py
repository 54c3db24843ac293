"""A model larger than any one process, run as pipeline stages (`--pp`), each rank in its own memory cgroup.

Each rank is limited to (an idle rank's RSS + 0.6 x the model's weight bytes), through a cgroup v1 memory controller
of its own (`/sys/fs/cgroup/memory/accessory-memory-R`; root only):
- one process alone under that limit is refused before loading, naming the limit and the `--pp` that would fit
  (exit 2);
- `--pp N` for each N of `--ranks` (above 1) generates the same greedy text as one process without a limit;
- every rank's peak RSS (VmHWM: with the checkpoint's pages mapped while it loads, which the kernel may reclaim under
  the limit) and its anonymous RSS after generating (RssAnon: its weights, KV cache and runtime) are reported at each
  rank count (1: the unlimited process).

    python benchmarks/memory.py --ranks 1 2 4 [--json out.json]

The model is the built-in SmolLM2-135M-Instruct in float32 (its float import: 0.54 GB of weights). The cgroups are
removed at the end, whatever happens.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MARK = "MEMORY-RESULT "
CGROUPS = Path("/sys/fs/cgroup/memory")
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
IDLE = ("import resource, torch, accessory.model.meta, accessory.cli.generate; "
        "print(int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--share", type=float, default=0.6, help="the limit: idle RSS + this x the model's weight bytes")
    p.add_argument("--max-gen-len", type=int, default=32)
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cgroup", help=argparse.SUPPRESS)  # a worker enters the cgroup CGROUP-RANK first
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0 or not CGROUPS.is_dir():
        sys.exit("benchmarks/memory.py needs root and a cgroup v1 memory controller (/sys/fs/cgroup/memory)")
    results = measure(args)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def measure(args) -> dict:
    from accessory.checkpoint.default_model import ensure_default_model

    folder = ensure_default_model()
    weights = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".pth", ".safetensors"))
    idle = int(subprocess.run([sys.executable, "-c", IDLE], capture_output=True, text=True, check=True).stdout)
    limit = idle + int(args.share * weights)
    results = {"weights_bytes": weights, "idle_rss_bytes": idle, "limit_bytes": limit, "runs": []}
    alone = run_job(folder, 1, args, None)  # the reference: one process, no limit
    results["runs"].append({"ranks": 1, "limited": False, **alone})
    refused = run_job(folder, 1, args, limit)
    results["refused_alone"] = {"exit": refused["exit"], "message": refused["message"]}
    for ranks in [r for r in args.ranks if r > 1]:
        run = run_job(folder, ranks, args, limit)
        run["same_text"] = run["texts"] == alone["texts"]
        results["runs"].append({"ranks": ranks, "limited": True, **run})
    return results


def run_job(folder: Path, ranks: int, args, limit) -> dict:
    """`ranks` ranks at --pp `ranks` (one plain process at 1), each in a cgroup limited to `limit` bytes (None: no
    cgroup): their exit code, rank 0's texts, every rank's peak RSS, and the refusal's message if any."""
    worker = [str(Path(__file__).resolve()), "--worker", "--pp", str(ranks), "--max-gen-len", str(args.max_gen_len)]
    cgroups = [CGROUPS / f"accessory-memory-{rank}" for rank in range(ranks)] if limit else []
    if limit:
        worker += ["--cgroup", str(CGROUPS / "accessory-memory")]
    try:
        for cgroup in cgroups:
            make_cgroup(cgroup, limit)
        if ranks > 1:
            torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
            command = [torchrun, "--standalone", f"--nproc-per-node={ranks}", *worker]
        else:
            command = [sys.executable, *worker]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        found = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
        texts = found[0]["texts"] if found else None
        refusal = re.search(r"(config of .*?would fit|ERROR .*)", proc.stderr)
        return {"exit": proc.returncode, "texts": texts,
                "peak_rss_by_rank": found[0]["peak_rss_by_rank"] if found else [],
                "anonymous_rss_by_rank": found[0]["anonymous_rss_by_rank"] if found else [],
                "message": refusal.group(0) if refusal and proc.returncode else None,
                **({"stderr_tail": proc.stderr[-3000:]} if proc.returncode and not refusal else {})}
    finally:
        for cgroup in cgroups:
            remove_cgroup(cgroup)


def make_cgroup(cgroup: Path, limit: int) -> None:
    remove_cgroup(cgroup)
    cgroup.mkdir()
    (cgroup / "memory.limit_in_bytes").write_text(str(limit))


def remove_cgroup(cgroup: Path) -> None:
    if cgroup.is_dir():
        for pid in (cgroup / "cgroup.procs").read_text().split():  # leftovers of a killed run
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        cgroup.rmdir()


def worker(args) -> None:
    if args.cgroup:  # before anything is loaded: what it allocates from here on counts against the limit
        Path(f"{args.cgroup}-{os.environ.get('RANK', '0')}", "cgroup.procs").write_text(str(os.getpid()))
    import logging

    import torch.distributed as dist

    from accessory.checkpoint.default_model import ensure_default_model
    from accessory.errors import ConfigError
    from accessory.model.meta import MetaModel

    logging.basicConfig(level=logging.INFO)
    try:
        model = MetaModel.from_pretrained(str(ensure_default_model()), max_seq_len=256,
                                          pipeline_parallel_size=args.pp)
    except ConfigError as e:
        print(f"ERROR {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    texts = model.generate(PROMPTS, max_gen_len=args.max_gen_len)
    status = open("/proc/self/status").read()
    kib = lambda field: int(status.split(f"{field}:")[1].split()[0]) * 1024  # noqa: E731
    # every rank's, printed by rank 0 alone (lines would interleave)
    memory = model.ctx.all_gather_object((kib("VmHWM"), kib("RssAnon")))
    if model.ctx.is_source:
        print(MARK + json.dumps({"texts": texts, "peak_rss_by_rank": [peak for peak, _ in memory],
                                 "anonymous_rss_by_rank": [anon for _, anon in memory]}), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
