"""Serving throughput and time to first token: 1, 4 and 16 concurrent streaming clients against `accessory serve`.

The script starts the server on the built-in default model (SmolLM2-135M-Instruct), alone or under torchrun, waits
until it answers, then for each concurrency C runs C client threads at once; each sends `--requests` streamed chat
completions one after another (temperature 0, `max_tokens` N, different questions), reading the server-sent events
as they come. Per concurrency it reports:

- `tok/s`: completion tokens (the server's own `usage` counts, from `stream_options.include_usage`) over the wall
  time from the first request sent to the last stream closed: the aggregate throughput;
- `TTFT p50 / p90`: seconds from sending a request to its first content chunk;
- `x 1 client`: aggregate tok/s relative to C = 1 in the same run (continuous batching should make it several).

Warm-up first: one request alone, then two together. The server is stopped with SIGTERM at the end.

    python benchmarks/serve.py --clients 1 4 16 --requests 2 --max-tokens 64 [--nproc 1] [--threads 2] \
        [--serve-args --quant int4 --compile]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "glaciers", "deserts", "owls", "rainforests", "comets",
          "coral reefs", "tigers", "the Nile", "mountains", "penguins", "lightning", "the Sahara"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--nproc", type=int, default=1, help="model-parallel ranks (1, 3 or 9 for SmolLM2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads in all")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="more flags for `accessory serve` (last), e.g. --quant int4 --compile")
    args = parser.parse_args()

    port = free_port()
    server = start_server(port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server)
        # warm-up: one request alone, then two together (a compiled step has a graph for each: see --compile)
        one_request(url, "Say hello.", args.max_tokens)
        warm = [threading.Thread(target=one_request, args=(url, "Say hello.", args.max_tokens)) for _ in range(2)]
        [t.start() for t in warm]
        [t.join() for t in warm]
        results = [run_clients(url, clients, args) for clients in args.clients]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    base = results[0]["tokens_per_s"]
    print(f"\naccessory serve, SmolLM2-135M-Instruct, {args.nproc} rank(s), {args.threads} thread(s), "
          f"max_tokens {args.max_tokens}, {args.requests} request(s) per client")
    print(f"{'clients':>7} {'requests':>8} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'TTFT p50':>8} "
          f"{'TTFT p90':>8} {'x 1 client':>10}")
    for r in results:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['tokens_per_s']:>7.1f} "
              f"{r['ttft_p50']:>8.3f} {r['ttft_p90']:>8.3f} {r['tokens_per_s'] / base:>10.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, args) -> subprocess.Popen:
    threads = max(1, args.threads // args.nproc)
    serve = ["-m", "accessory", "serve", "--port", str(port), "--max_seq_len", "1024", "--max_batch_size", "16",
             *args.serve_args]
    if args.nproc == 1:
        command = [sys.executable, *serve]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   *serve]
    return subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server did not answer within {timeout} s")


def one_request(url: str, question: str, max_tokens: int) -> dict:
    """Stream one chat completion: {"ttft": seconds to the first content, "tokens": completion tokens}."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start, "tokens": tokens}


def run_clients(url: str, clients: int, args) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for k in range(args.requests):
            topic = TOPICS[(index * args.requests + k) % len(TOPICS)]
            result = one_request(url, f"Write a short paragraph about {topic}.", args.max_tokens)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]}


if __name__ == "__main__":
    main()
