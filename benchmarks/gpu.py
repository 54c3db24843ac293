"""The CUDA path measured on one GPU: a Llama-2-7B-shaped checkpoint (random bfloat16 weights) against the GPU's
own ceilings and HF transformers on the same weights, in one run (meant to take under 10 minutes; on an H100 it
does not yet: the compiled step compiles again for every batch size, 80-120 s each; benchmarks/README.md, "GPU").

Parts, in order (`--parts` picks some; each prints its table as it ends, and results.json is rewritten after each):

- `roofline`: the HBM ceiling, a device-to-device copy of 2 GiB (bytes read plus written, median of 10).
- `kernels`: each candidate product on the 7B's weights (wqkv, wo, w1|w3, w2, output) at 1, 8, 32, 64 rows: cuBLAS
  on bfloat16, our Triton kernels on int8 / int4 (groups of 32), torch's tinygemm int4 (its layout made once, its
  scale and zero rounded to bfloat16), torch's `_weight_int8pack_mm` (one scale per row: other weights than ours),
  and the portable path (dequantize in chunks, then cuBLAS). Weights rotate among copies over 200 MB, so L2 (50 MB
  on an H100) holds none of them. Median of 3 timings of 30 calls each.
- `checkpoint`: random weights (std 0.02, norms 1, seed 0) saved as a real accessory checkpoint of 2 shards
  (`save_checkpoint`, .pth), with the LLaMA tokenizer.
- `ours`: for bf16, int8 and int4 (quantized while loading, on the GPU): the load time (bf16: from cold files, after
  dropping the page cache, against the time to read the files the same way), the memory, then greedy decoding of
  128 new tokens at batch 1, 8, 32, 64 (prompts of 4 to 70 tokens, benchmarks/decode.py's) eager and compiled (CUDA
  graphs), one warm-up call (16 tokens, the same graphs) then one timed call through the engine (scheduler,
  sampling, detokenization, as `generate`); the time to first token of a 1,000-token prompt (median of 3), and a
  torch.profiler table of a few steps at batch 1 (profiles.txt).
- `hf`: `LlamaForCausalLM.generate` on the same weights (q/k permuted to HF's layout, bfloat16, SDPA), eager
  (its dynamic cache) and with `cache_implementation="static"` (which compiles the decoding forward,
  "reduce-overhead": CUDA graphs), at batch 1 and 32, `min_new_tokens` = `max_new_tokens` = 128, left-padded.
- `allreduce`: one NCCL all-reduce of a decode step's activation (rows x 4096 bfloat16) at world size 1: the fixed
  cost of the call on this GPU, used by the tensor-parallel estimate in benchmarks/README.md.

tok/s is generated tokens per second summed over the batch (end to end: prefill included); "decode tok/s" leaves out
the time until every row has its first token. "weight GB/s" is the bytes of the weights one decode step reads (every
linear and the output projection; the embedding's rows are a gather) over the time of a step at batch 1.

    python benchmarks/gpu.py --out /tmp/gpu-results          # everything, on any CUDA machine
    python benchmarks/gpu.py --tiny --device cpu --parts checkpoint ours hf   # a dry run of the script itself
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # decode.py's prompts
sys.path.insert(0, str(HERE.parent))  # a checkout run without installing

from decode import PROMPTS  # noqa: E402

LLAMA2_7B = dict(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256, norm_eps=1e-5)
TINY = dict(dim=256, n_layers=2, n_heads=4, vocab_size=32000, multiple_of=64, norm_eps=1e-5)
PARTS = ("roofline", "kernels", "checkpoint", "ours", "hf", "allreduce")
FORMATS = ("bf16", "int8", "int4")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-results"), help="results.json, logs and profiles go here")
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/accessory-llama2-7b-random"))
    p.add_argument("--tokenizer", type=Path, help="LLaMA's tokenizer.model (default: mistral-common's copy)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--hf-batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ttft-tokens", type=int, default=1000)
    p.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a small model (a dry run of this script)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    device = torch.device(args.device)
    report.section("machine", machine(device))
    started = time.perf_counter()
    if "roofline" in args.parts and device.type == "cuda":
        report.section("roofline", {"copy_GBps": copy_bandwidth(device)})
    if "kernels" in args.parts and device.type == "cuda":
        report.section("kernels", kernel_table(device, TINY if args.tiny else LLAMA2_7B, report))
    config = dict(TINY if args.tiny else LLAMA2_7B, max_seq_len=2048)
    if "checkpoint" in args.parts or not (args.checkpoint / "config.json").exists():
        report.section("checkpoint", make_checkpoint(args.checkpoint, config, tokenizer_file(args.tokenizer)))
    for fmt in args.formats if "ours" in args.parts else ():
        report.section(f"ours {fmt}", ours(args, fmt, device, report))
        if fmt == args.formats[0] and "hf" in args.parts:  # the peer early: the ratios need it most
            report.section("hf", hf_peer(args, config, device))
    if "hf" in args.parts and "hf" not in report.results:
        report.section("hf", hf_peer(args, config, device))
    if "allreduce" in args.parts and device.type == "cuda":
        report.section("allreduce", allreduce_cost(device, config["dim"]))
    report.section("total", {"seconds": time.perf_counter() - started})
    report.summary()


# ---------------------------------------------------------------------------------------------------- reporting

class Report:
    def __init__(self, out: Path):
        self.out, self.results = out, {}

    def section(self, name: str, values) -> None:
        self.results[name] = values
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        print(f"== {name}: {json.dumps(values, default=str)[:3000]}", flush=True)

    def write(self, name: str, text: str) -> None:
        (self.out / name).write_text(text)

    def append(self, name: str, text: str) -> None:
        with open(self.out / name, "a") as f:
            f.write(text)

    def summary(self) -> None:
        text = summary(self.results)
        self.write("summary.md", text)
        print(text, flush=True)


def machine(device: torch.device) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_GiB=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(nbytes: float) -> float:
    return round(nbytes / 2**30, 2)


# ---------------------------------------------------------------------------------------------------- ceilings

def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy, bytes read plus bytes written (median of 10, after 3)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    assert torch.equal(dst[:4096], src[:4096])
    del src, dst
    torch.cuda.empty_cache()
    return round(2 * nbytes / statistics.median(times) / 1e9, 1)


def linear_shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (out, in, count per step) of the products of one decode step (wq|wk|wv and w1|w3 fused)."""
    from accessory.network.LLM.llama import ModelArgs

    args = ModelArgs(**config)
    d, h, kv = args.dim, args.ffn_hidden_dim, args.n_kv_heads * args.head_dim
    return {"wqkv": (d + 2 * kv, d, args.n_layers), "wo": (d, d, args.n_layers), "w13": (2 * h, d, args.n_layers),
            "w2": (d, h, args.n_layers), "output": (args.vocab_size, d, 1)}


def kernel_table(device: torch.device, config: dict, report: Report) -> dict:
    """Microseconds per product and weight GB/s for each candidate, shape and row count; ms per whole step."""
    import torch.nn.functional as F

    from accessory.kernels.cuda import quantized_linear_cuda, tinygemm_linear, tinygemm_pack
    from accessory.kernels.dispatch import _dequantized_product
    from accessory.quant.formats import dequantize, quantize

    rows_list = (1, 8, 32, 64)
    table, errors = {}, {}
    for name, (n, k, count) in linear_shapes(config).items():
        w = torch.randn(n, k, device=device) * 0.02
        i8, i4 = quantize(w, "int8"), quantize(w, "int4")
        row_scale = w.abs().amax(1) / 127
        per_row = (w / row_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        ref_w = {"int8": dequantize(i8, "int8", torch.bfloat16), "int4": dequantize(i4, "int4", torch.bfloat16)}
        candidates = {
            "bf16 cuBLAS (F.linear)": ({"w": w.bfloat16()}, lambda x, t: F.linear(x, t["w"]), None),
            "int8 ours (Triton, groups of 32)": (i8, lambda x, t: quantized_linear_cuda(x, "int8", t["q"], t["scale"], None), "int8"),
            "int4 ours (Triton, groups of 32)": (i4, lambda x, t: quantized_linear_cuda(x, "int4", t["q"], t["scale"], t["min"]), "int4"),
            "int4 tinygemm (_weight_int4pack_mm)": (lambda: dict(zip(("p", "sz"), tinygemm_pack(i4["q"], i4["scale"], i4["min"]))),
                                                   lambda x, t: tinygemm_linear(x, t["p"], t["sz"]), "int4"),
            "int8 _weight_int8pack_mm (per row)": ({"q": per_row, "s": row_scale.bfloat16()},
                                                  lambda x, t: torch._weight_int8pack_mm(x, t["q"], t["s"]), "row"),
            "int4 dequantize + cuBLAS (before)": (i4, lambda x, t: _dequantized_product(x, "int4", t["q"], t["scale"], t["min"]), "int4"),
        }
        del w
        for label, (tensors, fn, kind) in candidates.items():
            if callable(tensors):  # a layout made once, as a runtime would at load
                try:
                    tensors = tensors()
                except Exception as e:
                    table[label] = f"error: {type(e).__name__}: {str(e)[:200]}"
                    continue
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            copies = [tensors] + [{key: t.clone() for key, t in tensors.items()} for _ in range(max(1, -(-200_000_000 // nbytes)) - 1)]
            for rows in rows_list:
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                try:
                    out = fn(x, tensors)
                    ref = F.linear(x, per_row.bfloat16() * row_scale.bfloat16()[:, None]) if kind == "row" else \
                        F.linear(x, ref_w[kind] if kind else tensors["w"])
                    errors[f"{label} {name} {rows}"] = round(((out.float() - ref.float()).norm() / ref.float().norm()).item(), 5)
                    seconds = time_calls(fn, x, copies)
                except Exception as e:  # a candidate that cannot run this shape is reported, not fatal
                    table.setdefault(label, {}).setdefault(name, {})[rows] = f"error: {type(e).__name__}: {str(e)[:200]}"
                    continue
                table.setdefault(label, {}).setdefault(name, {})[rows] = {
                    "us": round(seconds * 1e6, 1), "weight_GBps": round(nbytes / seconds / 1e9, 1)}
            del copies
        del candidates, i8, i4, per_row, ref_w
        torch.cuda.empty_cache()
    shapes = linear_shapes(config)
    step_ms = {label: {rows: round(sum(by_shape[s][rows]["us"] * shapes[s][2] for s in shapes) / 1e3, 3)
                       for rows in rows_list if all(isinstance(by_shape.get(s, {}).get(rows), dict) for s in shapes)}
               for label, by_shape in table.items() if isinstance(by_shape, dict)}
    report.write("kernels_errors.json", json.dumps(errors, indent=1))
    return {"per_product": table, "step_products_ms": step_ms, "worst_relative_error": max(errors.values())}


def time_calls(fn, x, copies: list, calls: int = 30, repeats: int = 3) -> float:
    """Median seconds per call of fn(x, weights), cycling through copies of the weights (cold in L2)."""
    for i in range(3):
        fn(x, copies[i % len(copies)])
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(x, copies[i % len(copies)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------- checkpoint

def tokenizer_file(path) -> Path:
    if path:
        return Path(path)
    import importlib.util

    spec = importlib.util.find_spec("mistral_common")
    if spec is None:
        raise SystemExit("--tokenizer: a LLaMA tokenizer.model is needed (mistral-common ships one)")
    return Path(spec.submodule_search_locations[0], "data", "tokenizer.model.v1")


def random_state_dict(config: dict, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Meta names -> CPU bfloat16 tensors: std 0.02 (HF's initializer range), norms 1."""
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.parallel import ParallelContext

    with torch.device("meta"):
        model = Transformer(ModelArgs(**config), ParallelContext(None, 0, 1, 0))
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, t in model.saved_tensors().items():
        if "norm" in name:
            weights[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            value = torch.randn(t.shape, generator=generator, device=device, dtype=torch.float32) * 0.02
            weights[name] = value.to(torch.bfloat16).cpu()
    return weights


def make_checkpoint(folder: Path, config: dict, tokenizer: Path) -> dict:
    import shutil

    from accessory.checkpoint.save import save_checkpoint

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    weights = random_state_dict(config, device)
    made = time.perf_counter()
    if folder.exists():
        shutil.rmtree(folder)
    named = folder.parent / "tokenizer.model"  # the name the loader looks for beside the weights
    shutil.copyfile(tokenizer, named)
    save_checkpoint(folder, weights, config, 2, [named])
    os.sync()
    files = sorted(folder.glob("consolidated.*"))
    return {"folder": str(folder), "shards": [f.name for f in files],
            "GB": round(sum(f.stat().st_size for f in files) / 1e9, 2),
            "parameters_B": round(sum(t.numel() for t in weights.values()) / 1e9, 3),
            "random_s": round(made - start, 1), "save_s": round(time.perf_counter() - made, 1)}


def drop_page_cache() -> bool:
    """Empty the page cache (root only), so the next read comes from the disk; False where not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_files_s(folder: Path) -> float:
    """Seconds to read every shard file once, front to back, 64 MiB at a time."""
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    start = time.perf_counter()
    for path in sorted(folder.glob("consolidated.*")):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------- ours

class FirstTokens:
    """Wraps the scheduler's step for one call: when every request has its first token, and the step count."""

    def __init__(self):
        from accessory.generation.scheduler import Scheduler

        self.original = Scheduler.step
        self.requests, self.first = [], None
        state = self

        def step(scheduler, logits):
            plan, events = state.original(scheduler, logits)
            if state.first is None and state.requests and all(r.generated for r in state.requests):
                state.first = time.perf_counter()
            return plan, events

        Scheduler.step = step

    def close(self) -> None:
        from accessory.generation.scheduler import Scheduler

        Scheduler.step = self.original


def run_engine(engine, prompts: list[list[int]], new_tokens: int, watch: FirstTokens, device) -> dict:
    """Greedy decoding of exactly new_tokens per prompt (stop ids emptied) through the engine."""
    from accessory.generation.sampling import SamplingParams
    from accessory.generation.requests import Request

    requests = [Request(i, ids, SamplingParams(max_gen_len=new_tokens, temperature=0.0), 0)
                for i, ids in enumerate(prompts)]
    watch.requests, watch.first = requests, None
    sync(device)
    start = time.perf_counter()
    for _ in engine.stream(requests):
        pass
    sync(device)
    end = time.perf_counter()
    counts = [len(r.generated) for r in requests]
    if counts != [new_tokens] * len(prompts):
        raise RuntimeError(f"expected {new_tokens} tokens per row, got {counts}")
    generated, seconds, prefill = sum(counts), end - start, (watch.first or end) - start
    return {"seconds": round(seconds, 4), "prefill_s": round(prefill, 4), "tok_s": round(generated / seconds, 1),
            "decode_tok_s": round(len(prompts) * (new_tokens - 1) / max(seconds - prefill, 1e-9), 1),
            "tokens": [r.generated for r in requests]}


def ours(args, fmt: str, device: torch.device, report: Report) -> dict:
    from accessory.model.meta import MetaModel

    result = {}
    if fmt == "bf16" and device.type == "cuda":
        result["page_cache_dropped"] = drop_page_cache()
        result["read_files_s"] = round(read_files_s(args.checkpoint), 2)
        result["page_cache_dropped_again"] = drop_page_cache()
    quant = None if fmt == "bf16" else fmt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    model = MetaModel.from_pretrained(args.checkpoint, max_seq_len=2048, device=device, dtype=torch.bfloat16,
                                      quant=quant, max_batch_size=max(args.batches))
    sync(device)
    result["load_s"] = round(time.perf_counter() - start, 2)
    if "read_files_s" in result:
        result["load_over_read"] = round(result["load_s"] / result["read_files_s"], 2)
    if device.type == "cuda":
        result["model_GiB"] = gib(torch.cuda.memory_allocated(device))
        result["load_peak_GiB"] = gib(torch.cuda.max_memory_allocated(device))
    result["weight_bytes_per_step"] = weight_bytes(model.llma)
    tokenizer = model.tokenizer
    prompt_ids = [tokenizer.encode(PROMPTS[i % len(PROMPTS)], bos=True, eos=False) for i in range(max(args.batches))]
    watch = FirstTokens()
    engines = {}  # one per mode: a compiled engine compiles once, and the profile reuses it
    try:
        for mode in args.modes:
            engine = engines[mode] = model.engine.configured(compile=mode == "compiled", keep_cache_bytes=1 << 40)
            engine.stop_ids = set()
            for batch in args.batches:
                prompts = prompt_ids[:batch]
                t0 = time.perf_counter()
                run_engine(engine, prompts, 16, watch, device)  # warm-up: the same graphs (256 columns)
                warm = time.perf_counter() - t0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                timed = run_engine(engine, prompts, args.new_tokens, watch, device)
                timed["warmup_s"] = round(warm, 1)
                if device.type == "cuda":
                    timed["peak_GiB"] = gib(torch.cuda.max_memory_allocated(device))
                result.setdefault(mode, {})[batch] = timed
                report.section(f"ours {fmt} (so far)", {k: v for k, v in result.items() if k not in ("eager", "compiled")})
                print(f"   ours {fmt} {mode} batch {batch}: {timed['tok_s']} tok/s (decode {timed['decode_tok_s']}), "
                      f"warm-up {warm:.1f} s", flush=True)
            if mode == "compiled":
                result["counters"] = compile_counters()
            engine.kept = []  # this mode's KV caches
        if "eager" in result and "compiled" in result and 1 in result["eager"] and 1 in result["compiled"]:
            result["eager_equals_compiled_b1"] = result["eager"][1]["tokens"] == result["compiled"][1]["tokens"]
        for mode in result.keys() & {"eager", "compiled"}:
            for timed in result[mode].values():
                timed.pop("tokens")
        result["ttft"] = time_to_first_token(model, args.ttft_tokens, watch, device)
        if not args.no_profile and device.type == "cuda":
            result["profile"] = profile_steps(model, prompt_ids[:1], fmt, engines, watch, device, report)
    finally:
        watch.close()
        engines.clear()
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every linear (stacked or not, each once) and the output; the
    embedding only gathers rows."""
    from accessory.parallel.quantized_weight import QuantizedWeight

    seen, total = set(), 0
    for name, module in model.named_modules():
        if name.endswith("tok_embeddings") or name == "":
            continue
        tensors = []
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            tensors = list(weight.parts.values())
        elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
            tensors = [weight]
        for t in tensors:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def compile_counters() -> dict:
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items() if group in ("inductor", "stats")}


def time_to_first_token(model, length: int, watch: FirstTokens, device) -> dict:
    """Seconds from submitting one prompt of `length` tokens to its first token (eager engine), median of 3."""
    engine = model.engine.configured(compile=False)
    engine.stop_ids = set()
    generator = torch.Generator().manual_seed(1)
    prompt = [1] + torch.randint(100, 30000, (length - 1,), generator=generator).tolist()
    times = []
    for _ in range(4):
        times.append(run_engine(engine, [prompt], 1, watch, device)["seconds"])
    return {"prompt_tokens": length, "seconds": round(statistics.median(times[1:]), 4),
            "all": [round(t, 4) for t in times]}


def profile_steps(model, prompts, fmt: str, engines: dict, watch: FirstTokens, device, report: Report) -> dict:
    """torch.profiler over 16 decode steps at batch 1: the table of where the time goes, and per-step figures."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for mode, engine in engines.items():
        run_engine(engine, prompts, 16, watch, device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed = run_engine(engine, prompts, 17, watch, device)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        report.append("profiles.txt", f"\n==== {fmt} {mode}, batch 1, 17 tokens\n{table}\n")
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        out[mode] = {"wall_ms_per_token": round(1e3 * (timed["seconds"] - timed["prefill_s"]) / 16, 3),
                     "gpu_busy_ms_per_token": round(gpu_us / 1e3 / 17, 3)}
        engine.kept = []
    return out


# ---------------------------------------------------------------------------------------------------- HF

def hf_peer(args, config: dict, device: torch.device) -> dict:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from accessory.checkpoint.importers.hf import config_to_hf, hf_state_dict
    from accessory.network.LLM.llama import ModelArgs
    from accessory.text.tokenizer import Tokenizer

    transformers.logging.set_verbosity_error()
    weights = random_state_dict(config, device)  # the checkpoint's weights (same seed), not read back from disk
    hf_config = LlamaConfig(**{k: v for k, v in config_to_hf(config, torch.bfloat16).items()
                               if k not in ("architectures", "torch_dtype")})
    hf_config._attn_implementation = "sdpa"
    start = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_config, dtype=torch.bfloat16).eval()
    state = hf_state_dict(weights, ModelArgs(**config), "random weights")
    del weights
    model.load_state_dict(state, strict=True)
    sync(device)
    del state
    result = {"load_s": round(time.perf_counter() - start, 1), "version": transformers.__version__}
    tokenizer = Tokenizer.from_path(tokenizer_file(args.tokenizer))
    prompt_ids = [tokenizer.encode(PROMPTS[i % len(PROMPTS)], bos=True, eos=False) for i in range(max(args.hf_batches))]
    modes = {"eager": {}, "static+compile": {"cache_implementation": "static"}} if device.type == "cuda" else \
        {"eager": {}}
    for mode, options in modes.items():
        for batch in args.hf_batches:
            run = hf_runner(model, prompt_ids[:batch], device, options)
            t0 = time.perf_counter()
            run(args.new_tokens)  # the same length: a static cache of another size would compile again
            warm = time.perf_counter() - t0
            timed = run(args.new_tokens)
            timed["warmup_s"] = round(warm, 1)
            result.setdefault(mode, {})[batch] = timed
            print(f"   HF {mode} batch {batch}: {timed['tok_s']} tok/s, warm-up {warm:.1f} s", flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def hf_runner(model, prompts: list[list[int]], device, options: dict):
    from transformers import LogitsProcessor, LogitsProcessorList

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    stamps: list[float] = []

    class FirstStep(LogitsProcessor):  # called once per step after the forward: the first call ends prefill
        def __call__(self, ids, scores):
            if not stamps:
                sync(device)
                stamps.append(time.perf_counter())
            return scores

    def run(new_tokens: int) -> dict:
        stamps.clear()
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([FirstStep()]), **options)
        sync(device)
        seconds = time.perf_counter() - start
        generated = (out.shape[1] - width) * len(prompts)
        prefill = (stamps[0] if stamps else start) - start
        return {"seconds": round(seconds, 4), "tok_s": round(generated / seconds, 1),
                "decode_tok_s": round(len(prompts) * (new_tokens - 1) / max(seconds - prefill, 1e-9), 1)}

    return run


# ---------------------------------------------------------------------------------------------------- all-reduce

def allreduce_cost(device: torch.device, dim: int) -> dict:
    """Microseconds per NCCL all-reduce of (rows, dim) bfloat16 at world size 1 (median of 5 x 100 calls)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=device)
    out = {}
    try:
        for rows in (1, 8, 32, 64):
            x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
            for _ in range(10):
                dist.all_reduce(x)
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(100):
                    dist.all_reduce(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / 100)
            out[rows] = {"bytes": x.numel() * 2, "us": round(statistics.median(times), 2)}
    finally:
        dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------------- summary

def summary(results: dict) -> str:
    lines = ["", "## summary", ""]
    m = results.get("machine", {})
    lines.append(f"device: {m.get('gpu', m.get('device'))}, torch {m.get('torch')}, triton {m.get('triton')}, "
                 f"transformers {m.get('transformers')}")
    copy = results.get("roofline", {}).get("copy_GBps")
    if copy:
        lines.append(f"HBM (device-to-device copy, read + write): {copy} GB/s")
    rows = ["| engine | mode | " + " | ".join(f"b{b} tok/s" for b in (1, 8, 32, 64)) + " | b1 decode tok/s |",
            "|---|---|--:|--:|--:|--:|--:|"]
    for fmt in FORMATS:
        r = results.get(f"ours {fmt}")
        if not r:
            continue
        for mode in ("eager", "compiled"):
            if mode in r:
                cells = [str(r[mode].get(b, {}).get("tok_s", "-")) for b in (1, 8, 32, 64)]
                rows.append(f"| accessory {fmt} | {mode} | " + " | ".join(cells) +
                            f" | {r[mode].get(1, {}).get('decode_tok_s', '-')} |")
    hf = results.get("hf", {})
    for mode in ("eager", "static+compile"):
        if mode in hf:
            cells = [str(hf[mode].get(b, {}).get("tok_s", "-")) for b in (1, 8, 32, 64)]
            rows.append(f"| HF {hf.get('version')} | {mode} | " + " | ".join(cells) +
                        f" | {hf[mode].get(1, {}).get('decode_tok_s', '-')} |")
    lines += [""] + rows + [""]
    for fmt in FORMATS:
        r = results.get(f"ours {fmt}")
        if r:
            lines.append(f"{fmt}: load {r.get('load_s')} s (files read {r.get('read_files_s', '-')} s), model "
                         f"{r.get('model_GiB')} GiB, peak at batch 64 compiled "
                         f"{r.get('compiled', {}).get(64, {}).get('peak_GiB', '-')} GiB, TTFT "
                         f"{r.get('ttft', {}).get('seconds')} s for {r.get('ttft', {}).get('prompt_tokens')} tokens, "
                         f"profile {r.get('profile')}")
    lines += ["", "targets:"] + [f"- {t}" for t in targets(results)]
    return "\n".join(lines)


def best(r: dict, batch: int, key: str = "tok_s") -> float:
    return max((r[mode][batch][key] for mode in ("eager", "compiled", "static+compile")
                if batch in r.get(mode, {})), default=float("nan"))


def targets(results: dict) -> list[str]:
    out = []
    bf16, int4, hf = results.get("ours bf16", {}), results.get("ours int4", {}), results.get("hf", {})
    copy = results.get("roofline", {}).get("copy_GBps")
    if copy and 1 in bf16.get("compiled", {}):
        rate = bf16["compiled"][1]["decode_tok_s"] * bf16["weight_bytes_per_step"] / 1e9
        out.append(f"bf16 batch 1 weight bytes/s: {rate:.0f} GB/s = {rate / copy:.2f} of the measured {copy} GB/s "
                   f"(target >= 0.75)")
    for batch in (1, 32):
        if batch in bf16.get("compiled", {}) and any(batch in hf.get(m, {}) for m in ("eager", "static+compile")):
            ours_best = max(best(results[f"ours {f}"], batch) for f in FORMATS if f"ours {f}" in results)
            out.append(f"batch {batch}: ours best {ours_best} tok/s (bf16 {best(bf16, batch)}) vs HF best "
                       f"{best(hf, batch)}: {best(bf16, batch) / best(hf, batch):.2f}x in bf16 (target >= 2)")
    if 1 in int4.get("compiled", {}) and 1 in bf16.get("compiled", {}):
        out.append(f"int4 batch 1: {best(int4, 1) / best(bf16, 1):.2f}x bf16 (target >= 1.8)")
    if "load_over_read" in bf16:
        out.append(f"load {bf16['load_s']} s = {bf16['load_over_read']}x the file read {bf16['read_files_s']} s "
                   f"(target <= 1.5; page cache dropped: {bf16.get('page_cache_dropped')})")
    return out


if __name__ == "__main__":
    main()
