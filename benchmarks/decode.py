"""Greedy decode throughput and memory: accessory's MetaModel.generate against HF transformers' generate.

Both engines run the built-in default model (SmolLM2-135M-Instruct) on the same weights (our checkpoint is imported
from the very GGUF file that transformers loads), on the same prompt token ids, with the same thread count, and
are forced to generate exactly N new tokens per row:

- ours: `MetaModel.generate(prompts, max_gen_len=N, temperature=0)`, timed end to end (tokenization, the decode
  loop and incremental detokenization included). Stop tokens are switched off (`stop_ids` emptied), so EOS cannot
  end a row early; `lockstep` (the engine loop that `generate` drives) is wrapped to count the tokens each request
  actually got and the forward steps it took, and the run fails if any row got other than N tokens.
- HF: `model.generate(input_ids, attention_mask, do_sample=False, max_new_tokens=N, min_new_tokens=N)` on the same
  prompt ids, left-padded, plus one decode of the output ids to text, so both go from prompts to text. The count is
  read from the output shape.

Each (engine, batch size) runs in its own subprocess so its memory high-water mark is its own: `peak` is
`getrusage(RUSAGE_SELF).ru_maxrss` at the end (the whole process, model load included); `loaded` is the resident
size after loading; `gen +` is the high-water mark during the timed generate calls above `loaded` (the kernel's
peak is reset via /proc/self/clear_refs after the warm-up call; where that is not allowed, ru_maxrss is used instead).
One warm-up call, then the median of `--repeats` calls. `prefill s` is the time until every row has its first new
token; `decode tok/s` is the rest: B * (N - 1) tokens over (seconds - prefill s).

    python benchmarks/decode.py --batch-sizes 1 16 --new-tokens 64 --repeats 3 --threads 2 [--nproc 3]

`--nproc N` adds a row for ours under `torchrun --standalone --nproc-per-node=N` (threads split across ranks;
RSS summed over ranks).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MARK = "DECODE-BENCH-RESULT "

# Plain-text prompts of mixed lengths (about 4 to 70 tokens). Batch B uses the first B (cycled past 16).
PROMPTS = [
    "The history of the printing press begins",
    "Once upon a time",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy into "
    "chemical energy. During this process,",
    "def fibonacci(n):",
    "The three primary colours are",
    "In 1969, two astronauts landed on the Moon while a third orbited above. The mission, called Apollo 11, was the "
    "culmination of nearly a decade of work by hundreds of thousands of engineers, scientists and technicians. "
    "Looking back, the most remarkable thing about it was",
    "A good recipe for bread needs",
    "Rivers shape the land they flow through:",
    "Dear hiring manager, I am writing to apply for the position of",
    "The main differences between a list and a tuple in Python are",
    "Water boils at",
    "Machine learning models are trained on data. When the data is biased, the model learns the bias too, which "
    "is why careful evaluation matters. One practical way to check a model for bias is",
    "Paris is the capital of France, Berlin is the capital of Germany, and Rome is",
    "Here is a short poem about the sea:",
    "To make a cup of tea, first",
    "The city council met on Tuesday evening to discuss the new budget. After a long debate about road repairs, "
    "school funding and the library's opening hours, the council finally agreed that",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads per engine (split across ranks)")
    p.add_argument("--nproc", type=int, default=0, help="also run ours under torchrun at this many ranks")
    p.add_argument("--engines", nargs="+", default=["hf", "ours"], choices=["hf", "ours"])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="before each engine, wait up to this many seconds for other processes to leave the CPUs")
    p.add_argument("--worker", choices=["hf", "ours"], help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from accessory.checkpoint.default_model import ensure_default_model, gguf_path

    ensure_default_model()  # import once, outside any timed or measured process
    gguf_path()
    results = []
    for batch in args.batch_sizes:
        runs = [(e, 1) for e in args.engines] + ([("ours", args.nproc)] if args.nproc > 1 else [])
        for engine, nproc in runs:
            print(f"running {engine} at batch {batch}" + (f", {nproc} ranks" if nproc > 1 else "") + " ...",
                  file=sys.stderr, flush=True)
            wait_for_quiet(args.quiet_wait)
            results.append(run_worker(args, engine, batch, nproc))
    print(table(results))
    print(agreement(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def wait_for_quiet(limit_s: float, threshold: float = 0.2) -> None:
    """Wait (up to limit_s) until other processes use under `threshold` cores over one second."""
    deadline = time.monotonic() + limit_s
    while True:
        before = cpu_ticks()
        time.sleep(1.0)
        after = cpu_ticks()
        if not before or not after:
            return
        load = ((after[0] - before[0]) - (after[1] - before[1])) / os.sysconf("SC_CLK_TCK")
        if load < threshold or time.monotonic() > deadline:
            if load >= threshold:
                print(f"  other processes still use {load:.1f} cores; timing anyway", file=sys.stderr)
            return


def run_worker(args, engine: str, batch: int, nproc: int) -> dict:
    worker_args = [str(Path(__file__).resolve()), "--worker", engine, "--batch", str(batch),
                   "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                   "--threads", str(max(1, args.threads // nproc))]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // nproc)), "TOKENIZERS_PARALLELISM": "false"}
    if nproc > 1:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}"] + worker_args
    else:
        cmd = [sys.executable] + worker_args
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{engine} at batch {batch} ({nproc} rank(s)) failed with exit code {proc.returncode}:\n"
                 f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(MARK):])


# ---------------------------------------------------------------------------------------------------- workers

def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from accessory.checkpoint.default_model import ensure_default_model, gguf_path
    from accessory.model.tokenizer import Tokenizer, find_tokenizer

    folder = ensure_default_model()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    tokenizer = Tokenizer.from_path(find_tokenizer([folder]))
    prompt_ids = [tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    n = args.new_tokens
    if args.worker == "ours":
        run, info = ours_runner(folder, prompts, n)
    else:
        run, info = hf_runner(gguf_path(), tokenizer, prompt_ids, n)
    loaded = vm_kib("VmRSS")

    run()  # warm-up
    reset_ok = reset_peak()
    timings = [with_other_load(run) for _ in range(args.repeats)]
    gen_peak = vm_kib("VmHWM") if reset_ok else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    counts = [len(row) for row in timings[-1]["tokens"]]
    if counts != [n] * args.batch:
        raise SystemExit(f"{args.worker}: expected {n} new tokens in each of {args.batch} rows, got {counts}")
    mem = {"peak_kib": maxrss, "loaded_kib": loaded,
           "gen_delta_kib": (gen_peak if reset_ok else maxrss) - loaded}
    mem = reduce_over_ranks(mem)
    if mem is None:  # not the source rank
        return
    seconds = statistics.median(t["seconds"] for t in timings)
    prefill = statistics.median(t["prefill"] for t in timings)
    result = {"engine": info["name"], "batch": args.batch, "new_tokens": n, "generated": sum(counts),
              "steps": timings[-1]["steps"], "seconds": seconds, "prefill": prefill,
              "all_seconds": [t["seconds"] for t in timings], "threads": args.threads,
              "other_load": max(t["other_load"] for t in timings),
              "prompt_lengths": [len(p) for p in prompt_ids], "tokens": timings[-1]["tokens"],
              "peak_reset": reset_ok, **mem, **info}
    print(MARK + json.dumps(result), flush=True)


def ours_runner(folder: Path, prompts: list[str], n: int):
    import torch

    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder)
    if hasattr(model, "stop_ids"):
        model.stop_ids = set()  # EOS must not end a row early
    ctx = model.ctx
    record: dict = {}  # reset by every run()
    runner = importlib.import_module("accessory.generation.runner")
    original = runner.lockstep

    def counting_lockstep(llma, ctx, scheduler, *args, **kwargs):
        # The source rank's requests are queued in the scheduler before the loop starts: read them there, so the
        # tokens each one actually got can be counted afterwards.
        requests = [item for kind, item in list(scheduler.inbox.queue) if kind == "add"] if scheduler else []
        record["requests"] = requests
        for plan in original(llma, ctx, scheduler, *args, **kwargs):
            record["steps"] += plan.runs
            if record["prefill"] is None and requests and all(r.generated for r in requests):
                record["prefill"] = time.perf_counter()
            yield plan

    runner.lockstep = counting_lockstep  # generate() reaches the engine through the runner

    def run() -> dict:
        record.update(requests=[], steps=0, prefill=None)
        if ctx.world_size > 1:
            torch.distributed.barrier(group=ctx.group)
        start = time.perf_counter()
        model.generate(prompts, max_gen_len=n, temperature=0)
        end = time.perf_counter()
        return {"seconds": end - start, "prefill": (record["prefill"] or end) - start,
                "tokens": [r.generated for r in record["requests"]], "steps": record["steps"]}

    name = "accessory" + (f" ({ctx.world_size} ranks)" if ctx.world_size > 1 else "")
    return run, {"name": name, "ranks": ctx.world_size}


def hf_runner(gguf: Path, tokenizer, prompt_ids: list[list[int]], n: int):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    stamps: list[float] = []

    class FirstStep(LogitsProcessor):  # called once per step, after the forward: the first call ends prefill
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    def run() -> dict:
        stamps.clear()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                                 logits_processor=LogitsProcessorList([FirstStep()]))
        new = out[:, width:].tolist()
        [tokenizer.decode(row) for row in new]  # ids to text, as ours returns text
        end = time.perf_counter()
        return {"seconds": end - start, "prefill": (stamps[0] if stamps else end) - start, "tokens": new,
                "steps": len(stamps)}

    eos = model.generation_config.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return run, {"name": f"HF transformers {transformers.__version__}", "ranks": 1, "eos_ids": eos_ids}


def with_other_load(run) -> dict:
    """run(), plus how many cores other processes kept busy meanwhile (a sign the timing is not clean)."""
    before, start = cpu_ticks(), time.perf_counter()
    result = run()
    after, wall = cpu_ticks(), time.perf_counter() - start
    result["other_load"] = float("nan")
    if before and after:  # under torchrun, count the sibling ranks as this one's (they do the same work)
        other = (after[0] - before[0]) - (after[1] - before[1]) * WORLD
        result["other_load"] = max(0.0, other / os.sysconf("SC_CLK_TCK") / wall)
    return result


def cpu_ticks():
    """(ticks any CPU was busy, ticks this process used), or None where /proc is not Linux's."""
    try:
        busy = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return sum(busy) - busy[3] - busy[4], int(own[11]) + int(own[12])  # all but idle, iowait; utime + stime
    except (OSError, ValueError, IndexError):
        return None


WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # ranks on this machine when run under torchrun


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) to the current size, where allowed."""
    import gc

    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def reduce_over_ranks(mem: dict):
    """Summed over ranks under torchrun (None on every rank but 0), as is on a single process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return mem
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mem)
    rank = dist.get_rank()
    from accessory.parallel.context import shutdown_distributed

    shutdown_distributed()
    if rank:
        return None
    return {key: sum(m[key] for m in every) for key in mem}


# ---------------------------------------------------------------------------------------------------- report

def table(results: list[dict]) -> str:
    hf = {r["batch"]: r for r in results if r["engine"].startswith("HF")}
    lines = ["| engine | batch | new tokens | steps | seconds | (range) | tokens/s | vs HF | prefill s | decode tok/s "
             "| peak RSS MiB | loaded MiB | gen + MiB | other load |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        tps = r["generated"] / r["seconds"]
        peer = hf.get(r["batch"])
        ratio = f"{tps / (peer['generated'] / peer['seconds']):.2f}x" if peer else "-"
        decode = r["batch"] * (r["new_tokens"] - 1) / max(r["seconds"] - r["prefill"], 1e-9)
        lines.append(f"| {r['engine']} | {r['batch']} | {r['generated']} | {r['steps']} | {r['seconds']:.2f} "
                     f"| {min(r['all_seconds']):.2f}-{max(r['all_seconds']):.2f} "
                     f"| {tps:.1f} | {ratio} | {r['prefill']:.2f} | {decode:.1f} | {r['peak_kib'] / 1024:.0f} "
                     f"| {r['loaded_kib'] / 1024:.0f} | {r['gen_delta_kib'] / 1024:.0f} | {r['other_load']:.2f} |")
    return "\n".join(lines)


def agreement(results: list[dict]) -> str:
    """How far ours and HF emit the same greedy tokens (a check that both ran the same weights and prompts).

    Expected differences: min_new_tokens stops HF from choosing EOS, while ours (stop tokens off) may choose it, so
    rows can part where ours emitted an EOS id.
    """
    out = []
    for r in results:
        peer = next((h for h in results if h["engine"].startswith("HF") and h["batch"] == r["batch"]), None)
        if peer is None or r is peer:
            continue
        common, at_eos = [], 0
        for a, b in zip(r["tokens"], peer["tokens"]):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            common.append(k)
            at_eos += k < len(a) and a[k] in peer.get("eos_ids", [])
        same = sum(k == r["new_tokens"] for k in common)
        line = (f"greedy agreement, {r['engine']} vs HF at batch {r['batch']}: {same}/{len(common)} rows identical "
                f"over all {r['new_tokens']} tokens; mean common prefix {statistics.mean(common):.1f} tokens")
        if same < len(common):
            line += (f"; {at_eos} of the {len(common) - same} other rows part where ours emitted EOS, which "
                     f"min_new_tokens forbids HF")
        out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    main()
