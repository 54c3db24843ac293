"""Tensor parallelism on one machine, and across two: tok/s at 1, 2 and 3 ranks against one process, the latency of
one collective, and the bytes each rank sends per token.

Decoding (the default): each configuration is one `torchrun --standalone --nproc-per-node=N` job (one plain process
at 1 rank) that loads the model, generates once to warm up (and compile), then times `MetaModel.generate` of
`--new-tokens` greedy tokens per row at each batch size (stop tokens off, so every row runs the whole way; the
median of `--repeats`). Each rank runs `--threads-per-rank` threads (OMP_NUM_THREADS); the rows `1 process, T
threads` are the peers: one rank with one thread, and one process with as many threads as the ranks have in all.
`bytes/token/rank` is what a rank sent per decoded token: what a timed call sent less what a one-token call (the
prompts' prefill and its sample) sends, over the decoded tokens. Sent is what a rank wrote into the shared-memory
segment for the other ranks, or through gloo what the network interfaces carried (loopback here; the link between
the two machines for `--two-machines`) over the machine's ranks. `--transport gloo` sets ACCESSORY_TRANSPORT=gloo:
every collective through gloo, as before shared memory.

    python benchmarks/parallel.py --models smollm2 --ranks 1 2 3 --modes eager compiled --dtypes float32 int4 \\
        --batch-sizes 1 16 --new-tokens 64 --rounds 2
    python benchmarks/parallel.py --collectives          # one all-reduce and one gather: shared memory and gloo
    python benchmarks/parallel.py --collectives --two-machines   # as root: the same, and round trips, over the link
    python benchmarks/parallel.py --two-machines         # as root: two network namespaces, a 1 Gbit/s veth link
    python benchmarks/parallel.py --two-machines --pp 1 2 --modes compiled --dtypes int4   # tensor vs pipeline

Models: `smollm2` (the built-in SmolLM2-135M-Instruct; int4 is its GGUF's Q4_1 bits), `gemma3` (Gemma 3 270M from
its Q4_K_M GGUF: float32 imported, int4 quantized while loading), `moe` (a Mixtral-shaped random model: 8 experts,
top 2, SmolLM2's width and tokenizer, 12 layers; written once into the cache with transformers).

`--two-machines` (root; skipped otherwise): namespaces `acc-m0` and `acc-m1` joined by a veth pair, each direction
limited with `tc qdisc ... tbf rate 1gbit`; `torchrun --nnodes=2` with `--ranks` ranks on each, each machine's ranks
pinned to cores of their own (`taskset`), as two machines would not share a core, and the one-process peers pinned
alike; the namespaces are removed afterwards. `--pp-layers`: the stages' splits, each in turn (`even`, or counts:
`even 19,11`).

`--prompt-tokens N`: each decoding job also times one prompt of N tokens (README.md's text) to its first token, the
prefix cache off, the median of `--repeats`; under a pipeline both as it runs (the prompt through the stages in
pieces) and with the whole prompt in one pass through each stage, alternately in the same job.

    python benchmarks/parallel.py --two-machines --ranks 1 --pp 2 --modes compiled --dtypes int4 --batch-sizes 1 \
        --prompt-tokens 1500
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MARK = "PARALLEL-BENCH-RESULT "
BENCH_DIR = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2"], choices=["smollm2", "gemma3", "moe"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "int4"], choices=["float32", "int4"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="every configuration once per round, in turn")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--transport", default="auto", choices=["auto", "gloo"])
    p.add_argument("--collectives", action="store_true", help="time one all-reduce and one gather instead")
    p.add_argument("--two-machines", action="store_true", help="as root: the ranks on two network namespaces")
    p.add_argument("--pp", nargs="+", type=int, default=[1], help="--two-machines: pipeline stages, each size in turn "
                   "(1: the ranks are tensor-parallel across the link; 2: a stage on each machine)")
    p.add_argument("--pp-layers", nargs="+", default=["even"], help="--two-machines: how the layers split over the "
                   "stages, each in turn")
    p.add_argument("--prompt-tokens", type=int, default=0, help="also time one prompt this long to its first token")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2: bytes/token/rank counts the decoded tokens after the first")
    if args.worker == "decode":
        return decode_worker(args)
    if args.worker == "collectives":
        return collectives_worker(args)
    results = collectives(args) if args.collectives else two_machines(args) if args.two_machines else decoding(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


# ---- decoding ------------------------------------------------------------------------------------------------------

def decoding(args) -> list[dict]:
    """Every configuration once per round, rounds in turn (a slow moment of the machine falls on all of them);
    each configuration's tok/s is the median over rounds of its jobs' medians."""
    jobs = []
    for model in args.models:
        model_folder(model, "float32"), model_folder(model, "int4")  # import once, outside any timed job
        for dtype in args.dtypes:
            for mode in args.modes:
                rows = [(ranks, args.threads_per_rank) for ranks in args.ranks]
                rows += [(1, ranks * args.threads_per_rank) for ranks in sorted(set(args.ranks)) if ranks > 1]
                jobs += [(model, dtype, mode, ranks, threads) for ranks, threads in rows]
    runs: dict[tuple, list[dict]] = {}
    for round_ in range(args.rounds):
        for model, dtype, mode, ranks, threads in jobs:
            print(f"round {round_ + 1}: {model} {dtype} {mode}, {ranks} rank(s) x {threads} thread(s) ...",
                  file=sys.stderr, flush=True)
            for result in run_job(args, ["--worker", "decode", "--models", model, "--dtypes", dtype, "--modes",
                                         mode], ranks, threads):
                print(f"  batch {result['batch']}: {result['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
                runs.setdefault((model, dtype, mode, ranks, threads, result["batch"]), []).append(result)
    results = [over_rounds(each) for each in runs.values()]
    print(decode_table(results))
    if args.prompt_tokens:
        print(first_token_table(results))
    return results


def over_rounds(each: list[dict]) -> dict:
    """One configuration's results of every round: the last, with the medians of its timings over the rounds."""
    timed = [key for key in ("tok_s", "first_token_s", "first_token_whole_s") if key in each[-1]]
    return {**each[-1], **{key: statistics.median(r[key] for r in each) for key in timed},
            "rounds_tok_s": [r["tok_s"] for r in each]}


def first_token_table(results: list[dict]) -> str:
    """Time to the first token of `--prompt-tokens`, once a configuration (every batch size's job measures it)."""
    lines = ["| model | dtype | mode | ranks x threads | prompt tokens | first token (s) | x 1 rank, 1 thread "
             "| whole prompt a pass (s) |", "|---|---|---|---|--:|--:|--:|--:|"]
    firsts = {}
    for r in results:
        firsts.setdefault((r["model"], r["dtype"], r["mode"], r.get("ranks_note", r["ranks"]), r["threads"]), r)
    for r in firsts.values():
        one = next((o for o in firsts.values() if (o["model"], o["dtype"], o["mode"], o["ranks"], o["threads"]) ==
                    (r["model"], r["dtype"], r["mode"], 1, 1)), None)
        where = f"{r['ranks_note']} x {r['threads']}" if "ranks_note" in r else f"{r['ranks']} x {r['threads']}"
        whole = f"{r['first_token_whole_s']:.2f}" if "first_token_whole_s" in r else "-"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['mode']} | {where} | {r['prompt_tokens']} | "
                     f"{r['first_token_s']:.2f} | {one['first_token_s'] / r['first_token_s'] if one else 0:.2f} | "
                     f"{whole} |")
    return "\n".join(lines)


def decode_table(results: list[dict]) -> str:
    lines = ["| model | dtype | mode | batch | ranks x threads | tok/s | x 1 rank, 1 thread "
             "| x 1 process, same threads | bytes/token/rank | time waiting, by rank |",
             "|---|---|---|--:|---|--:|--:|--:|--:|--:|"]
    for r in results:
        same = [o for o in results if (o["model"], o["dtype"], o["mode"], o["batch"]) ==
                (r["model"], r["dtype"], r["mode"], r["batch"]) and o["ranks"] == 1]
        one = next((o for o in same if o["threads"] == 1), None)
        peer = next((o for o in same if o["threads"] == r["ranks"] * r["threads"]), None)
        ratio = lambda o: f"{r['tok_s'] / o['tok_s']:.2f}" if o else "-"  # noqa: E731
        waiting = " / ".join(f"{w:.2f}" for w in r.get("waiting_share_by_rank", [])) if r["ranks"] > 1 else "-"
        where = f"{r['ranks_note']} x {r['threads']}" if "ranks_note" in r else f"{r['ranks']} x {r['threads']}"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['mode']} | {r['batch']} | {where} | "
                     f"{r['tok_s']:.1f} | {ratio(one)} | {ratio(peer) if r['ranks'] > 1 else '-'} | "
                     f"{r['bytes_per_token_rank']:.0f} | {waiting} |")
    return "\n".join(lines)


def run_job(args, worker_args: list[str], ranks: int, threads: int, prefix: tuple = (), env_extra: dict = None,
            torchrun_args: tuple = ("--standalone",)) -> list[dict]:
    """One job: a plain process at 1 rank (not across machines), else torchrun with `ranks` processes, each command
    after `prefix` (a namespace, a core set); the results rank 0 printed."""
    script = [str(Path(__file__).resolve()), *worker_args, "--batch-sizes", *map(str, args.batch_sizes),
              "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--prompt-tokens",
              str(args.prompt_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    if args.transport == "gloo":
        env["ACCESSORY_TRANSPORT"] = "gloo"
    if ranks > 1 or torchrun_args != ("--standalone",):
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        command = [*prefix, torchrun, *torchrun_args, f"--nproc-per-node={ranks}", *script]
    else:
        command = [*prefix, sys.executable, *script]
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line[len(MARK):]) for line in lines]


def decode_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from accessory.model.meta import MetaModel

    model_name, dtype, mode = args.models[0], args.dtypes[0], args.modes[0]
    folder = model_folder(model_name, dtype)
    quant = "int4" if dtype == "int4" and folder == model_folder(model_name, "float32") else None
    model = MetaModel.from_pretrained(folder, quant=quant, compile=mode == "compiled",
                                      max_seq_len=max(1024, args.prompt_tokens + 64),
                                      max_batch_size=max(args.batch_sizes), pipeline_parallel_size=args.pp[0],
                                      pipeline_layers=args.pp_layers[0])
    model.stop_ids = set()
    first_token = first_token_s(model, args.prompt_tokens, args.repeats) if args.prompt_tokens else {}
    for batch in args.batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        model.generate(prompts, max_gen_len=args.new_tokens)  # warm-up, compilation
        before = bytes_sent(model.ctx)
        model.generate(prompts, max_gen_len=1)  # the prefill alone: what decoding sends is the rest
        prefill_sent = bytes_sent(model.ctx) - before
        seconds, sent, waits = [], [], []
        for _ in range(args.repeats):
            if dist.is_initialized():
                dist.barrier()
            before, waited, start = bytes_sent(model.ctx), waited_s(model.ctx), time.perf_counter()
            model.generate(prompts, max_gen_len=args.new_tokens)
            seconds.append(time.perf_counter() - start)
            sent.append(bytes_sent(model.ctx) - before)
            waits.append(waited_s(model.ctx) - waited)
        tokens = batch * args.new_tokens
        # each rank's share of the time spent waiting for the others (through shared memory; 0 otherwise)
        waiting = model.ctx.all_gather_object(statistics.median(waits) / statistics.median(seconds))
        if model.ctx.is_source:
            result = {"model": model_name, "dtype": dtype, "mode": mode, "batch": batch,
                      "ranks": model.ctx.world_size, "pp": args.pp[0], "threads": torch.get_num_threads(),
                      "transport": "shared memory" if model.ctx.local is not None else "gloo" if dist.is_initialized()
                      else "-", "tok_s": tokens / statistics.median(seconds), "all_seconds": seconds,
                      "bytes_per_token_rank": (statistics.median(sent) - prefill_sent) / (tokens - batch),
                      "waiting_share_by_rank": [round(w, 3) for w in waiting], **first_token}
            print(MARK + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def first_token_s(model, tokens: int, repeats: int) -> dict:
    """Seconds from the call to the first token of one prompt of `tokens` tokens, the median of `repeats` (the
    prefix cache off); under a pipeline also with the whole prompt in one pass through each stage, alternately."""
    import torch.distributed as dist

    from accessory.generation import model_runner

    ids = model.tokenizer.encode((BENCH_DIR.parent / "README.md").read_text() * 4, True, False)
    prompt = model.tokenizer.decode(ids[1:tokens])
    engine, model.engine = model.engine, model.engine.configured(prefix_cache=False)
    model.generate([prompt], max_gen_len=1)  # warm-up
    pieces = model_runner.STAGE_PREFILL_TOKENS
    ways = {"first_token_s": pieces, **({"first_token_whole_s": tokens + 1} if model.llma.stage.count > 1 else {})}
    times = {way: [] for way in ways}
    for _ in range(repeats):
        for way, size in ways.items():
            model_runner.STAGE_PREFILL_TOKENS = size
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            model.generate([prompt], max_gen_len=1)
            times[way].append(time.perf_counter() - start)
    model_runner.STAGE_PREFILL_TOKENS, model.engine = pieces, engine
    return {"prompt_tokens": len(model.tokenizer.encode(prompt, True, False)),
            **{way: statistics.median(each) for way, each in times.items()}}


def waited_s(ctx) -> float:
    return ctx.local.waited_s if ctx.local is not None else 0.0


def bytes_sent(ctx) -> float:
    """What this rank has sent so far: what it wrote into the shared-memory segment for the others; through gloo,
    what this network namespace's interfaces (loopback included) carried, shared among the machine's ranks."""
    if ctx.local is not None:
        return ctx.local.bytes_sent
    carried = sum(int(Path(f"/sys/class/net/{name}/statistics/tx_bytes").read_text())
                  for name in os.listdir("/sys/class/net"))
    return carried / int(os.environ.get("LOCAL_WORLD_SIZE", 1))


# ---- the models ----------------------------------------------------------------------------------------------------

PROMPTS = ["The history of the printing press begins", "Once upon a time", "def fibonacci(n):",
           "The three primary colours are", "A good recipe for bread needs", "Rivers shape the land they flow through:",
           "Dear hiring manager, I am writing to apply for the position of", "Water boils at"]


def model_folder(name: str, dtype: str) -> Path:
    """The checkpoint a job loads: int4 of smollm2 is the GGUF's own Q4_1 bits; others quantize while loading."""
    from accessory.checkpoint.default_model import ensure_default_model

    if name == "smollm2":
        return ensure_default_model(keep_quantized=dtype == "int4")
    if name == "gemma3":
        from decode import _gemma_float

        return _gemma_float()
    return moe_folder()


def moe_folder() -> Path:
    """A Mixtral-shaped random model (8 experts, top 2) with SmolLM2's width and tokenizer, in accessory's layout."""
    from accessory.cache_dir import cache_dir
    from accessory.checkpoint.convert import convert
    from accessory.checkpoint.default_model import ensure_default_model

    folder = cache_dir() / "benchmarks" / "mixtral-shaped-8x2"
    if folder.is_dir():
        return folder
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    smollm2 = ensure_default_model()
    config = MixtralConfig(hidden_size=576, intermediate_size=768, num_hidden_layers=12, num_attention_heads=9,
                           num_key_value_heads=3, num_local_experts=8, num_experts_per_tok=2, vocab_size=49152,
                           max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = folder.with_name(folder.name + "-hf")
    MixtralForCausalLM(config).save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, hf / name)
    convert("hf", hf, folder)
    shutil.rmtree(hf)
    return folder


# ---- one collective ------------------------------------------------------------------------------------------------

def collectives(args) -> list[dict]:
    """Each collective's latency at each of `--ranks` (above 1), through shared memory and gloo; with
    `--two-machines`, at 2 ranks, one on each machine, through gloo. Beside them, a round trip of one token's hidden
    states (576 floats) between ranks 0 and 1: gloo's send and receive, and the runtime's link (links.py)."""
    results = []
    if args.two_machines:
        try:
            link_machines()
            results = two_machine_job(args, ["--worker", "collectives"], 1)
        finally:
            unlink_machines()
    for ranks in [r for r in args.ranks if r > 1 and not args.two_machines]:
        for transport in ("auto", "gloo"):
            results += run_job(args, ["--worker", "collectives"], ranks, 1, env_extra={"ACCESSORY_TRANSPORT":
                                                                                        transport})
    lines = ["| ranks | transport | all-reduce of 576 floats (us) | gather of 24576 floats a rank to rank 0 (us) | "
             "round trip of 576 floats, gloo send/recv (us) | round trip of 576 floats, link (us) |",
             "|--:|---|--:|--:|--:|--:|"]
    lines += [f"| {r['ranks']}{' (2 machines)' if args.two_machines else ''} | {r['transport']} | "
              f"{r['all_reduce_us']:.1f} | {r['gather_us']:.1f} | {r['gloo_round_trip_us']:.1f} | "
              f"{r['link_round_trip_us']:.1f} |" for r in results]
    print("\n".join(lines))
    return results


def collectives_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from accessory.parallel import ParallelContext
    from accessory.parallel.links import HIDDEN, connect

    dist.init_process_group("gloo")
    ctx = ParallelContext.from_group(None)
    x, logits = torch.ones(1, 576), torch.ones(1, 49152 // 2)
    rank, other = dist.get_rank(), 1 - min(dist.get_rank(), 1)
    link = connect(dist.group.WORLD, [other] if rank < 2 else [], 60.0).get(other)

    def gloo_round_trip():
        if rank < 2:
            (dist.send(x, other), dist.recv(x, other)) if rank == 0 else (dist.recv(x, other), dist.send(x, other))

    def link_round_trip():
        if rank < 2:
            (link.send(x, HIDDEN), link.receive(x.shape, x.dtype, HIDDEN)) if rank == 0 else (
                link.receive(x.shape, x.dtype, HIDDEN), link.send(x, HIDDEN))

    timed = {}
    for name, call, count in (("all_reduce_us", lambda: ctx.all_reduce(x), 2000),
                              ("gather_us", lambda: ctx.gather_to_source(logits), 500),
                              ("gloo_round_trip_us", gloo_round_trip, 1000),
                              ("link_round_trip_us", link_round_trip, 2000)):
        for _ in range(50):
            call()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            call()
        timed[name] = (time.perf_counter() - start) / count * 1e6
    if ctx.is_source:
        print(MARK + json.dumps({"ranks": ctx.world_size, "transport": "shared memory" if ctx.local else "gloo",
                                 **timed}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---- two machines --------------------------------------------------------------------------------------------------

NAMESPACES, ADDRESSES = ("acc-m0", "acc-m1"), ("10.213.0.1", "10.213.0.2")


def two_machines(args) -> list[dict]:
    """Each namespace a machine with `--ranks[0]` ranks, joined by a rate-limited veth pair, its ranks pinned to
    cores of their own (machine m to the m-th share of the cores: two machines do not share a core); the same jobs,
    and beside each its peers in the same run, pinned alike: one process with 1 thread (on one machine's first
    core), and with as many threads as the ranks have in all. Rounds as in `decoding`."""
    if os.geteuid() != 0:
        print("--two-machines needs root (network namespaces); skipped", file=sys.stderr)
        return []
    per_machine, threads = args.ranks[0], args.threads_per_rank
    if 2 * per_machine * threads > os.cpu_count():
        sys.exit(f"2 machines x {per_machine} rank(s) x {threads} thread(s) need {2 * per_machine * threads} cores; "
                 f"this machine has {os.cpu_count()}")
    jobs = [(model, dtype, mode, pp, layers) for model in args.models for dtype in args.dtypes for mode in args.modes
            for pp in [*args.pp, 0] for layers in (args.pp_layers if pp > 1 else ["even"])]  # pp 0: one process
    runs: dict[tuple, list[dict]] = {}
    try:
        link_machines()
        for model in args.models:
            model_folder(model, "float32"), model_folder(model, "int4")
        for round_ in range(args.rounds):
            for model, dtype, mode, pp, layers in jobs:
                print(f"round {round_ + 1}: {model} {dtype} {mode}, "
                      + (f"2 machines x {per_machine} rank(s), --pp {pp} --pp-layers {layers}" if pp else "one process")
                      + " ...", file=sys.stderr, flush=True)
                for result in (two_machine_decoding(args, model, dtype, mode, per_machine, pp, layers) if pp
                               else one_process_peers(args, model, dtype, mode, 2 * per_machine * threads)):
                    print(f"  batch {result['batch']}: {result['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
                    key = (model, dtype, mode, pp, layers, result["threads"], result["batch"])
                    runs.setdefault(key, []).append(result)
    finally:
        unlink_machines()
    results = [over_rounds(each) for each in runs.values()]
    print(decode_table(results))
    if args.prompt_tokens:
        print(first_token_table(results))
    return results


def one_process_peers(args, model: str, dtype: str, mode: str, all_threads: int) -> list[dict]:
    worker = ["--worker", "decode", "--models", model, "--dtypes", dtype, "--modes", mode]
    return [result for threads in sorted({args.threads_per_rank, all_threads})
            for result in run_job(args, worker, 1, threads, ("taskset", "-c", f"0-{threads - 1}"))]


def two_machine_job(args, worker: list[str], per_machine: int) -> list[dict]:
    """`worker` under `torchrun --nnodes=2`, `per_machine` ranks on each machine (namespace), each pinned."""
    port = 29400 + os.getpid() % 500
    cores = per_machine * args.threads_per_rank
    jobs, out = [], []
    for node, namespace in enumerate(NAMESPACES):
        torchrun_args = ("--nnodes=2", f"--node-rank={node}", f"--master-addr={ADDRESSES[0]}", f"--master-port={port}")
        env = {"GLOO_SOCKET_IFNAME": f"veth{node}"}
        prefix = ("ip", "netns", "exec", namespace, "taskset", "-c", f"{node * cores}-{(node + 1) * cores - 1}")
        jobs.append((torchrun_args, env, prefix))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_job, args, worker, per_machine, args.threads_per_rank, prefix, env, torchrun_args)
                   for torchrun_args, env, prefix in jobs]
        for future in futures:
            out += future.result()
    return out


def two_machine_decoding(args, model: str, dtype: str, mode: str, per_machine: int, pp: int,
                         layers: str) -> list[dict]:
    worker = ["--worker", "decode", "--models", model, "--dtypes", dtype, "--modes", mode, "--pp", str(pp),
              "--pp-layers", layers]
    out = two_machine_job(args, worker, per_machine)
    for r in out:
        r["ranks_note"] = f"2 machines x {per_machine}" + (f", --pp {pp}" if pp > 1 else ", tensor-parallel")
        if pp > 1 and layers != "even":
            r["ranks_note"] += f" --pp-layers {layers}"
    return out


def link_machines() -> None:
    unlink_machines()
    run = lambda *cmd: subprocess.run(cmd, check=True)  # noqa: E731
    for namespace in NAMESPACES:
        run("ip", "netns", "add", namespace)
    run("ip", "link", "add", "veth0", "netns", NAMESPACES[0], "type", "veth", "peer", "name", "veth1", "netns",
        NAMESPACES[1])
    for node, namespace in enumerate(NAMESPACES):
        exec_ = ("ip", "netns", "exec", namespace)
        run(*exec_, "ip", "addr", "add", f"{ADDRESSES[node]}/24", "dev", f"veth{node}")
        run(*exec_, "ip", "link", "set", f"veth{node}", "up")
        run(*exec_, "ip", "link", "set", "lo", "up")
        run(*exec_, "tc", "qdisc", "add", "dev", f"veth{node}", "root", "tbf", "rate", "1gbit", "burst", "256kb",
            "latency", "50ms")


def unlink_machines() -> None:
    for namespace in NAMESPACES:
        subprocess.run(["ip", "netns", "del", namespace], stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
