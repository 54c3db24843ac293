"""Serving throughput and time to first token: 1, 4 and 16 concurrent streaming clients against `accessory serve`;
with `--prefix-cache`, time to first token with the prefix cache on and off.

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

`--prefix-cache` measures instead, on one server with the prefix cache on and then one with it off
(`--no-prefix-cache`), each warmed up the same way:

- a 10-turn chat (`--turns`): each turn sends the whole conversation so far (the earlier questions and the
  server's own replies, `--chat-tokens` at most each) and one new question; TTFT of each turn after the first
  (the first has nothing to reuse);
- 16 requests (`--shared-requests`) sent at once, sharing a system prompt of about 500 tokens (`--system-tokens`)
  and each asking a different short question: TTFT p50 and mean.

It reports the prompt tokens (the server's `usage`), TTFT on and off, their ratio off / on, and whether every reply
was the same with the cache off (greedy output must not change).

    python benchmarks/serve.py --prefix-cache [--turns 10] [--shared-requests 16] [--system-tokens 500]

`--startup` measures instead, for the server as `--serve-args` says and again with `--compile` added: the seconds
from starting the process to `/health` ok, then the first request alone, the first 4 together, and the same two
again (with --compile every graph is compiled before `/health` says ok, so the first requests should not wait).

    python benchmarks/serve.py --startup [--serve-args --quant int4]
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
from contextlib import contextmanager
from pathlib import Path

import httpx

TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "glaciers", "deserts", "owls", "rainforests", "comets",
          "coral reefs", "tigers", "the Nile", "mountains", "penguins", "lightning", "the Sahara"]
# The system prompt of the shared-prefix scenario: these rules, repeated until it is long enough (about 20 tokens
# each with SmolLM2's tokenizer).
RULES = ["Answer the question you are asked, and only that question, in plain and friendly language.",
         "If you are not sure of a fact, say that you are not sure instead of guessing at an answer.",
         "Prefer short paragraphs to long ones, and never use more than three sentences in a row about one point.",
         "Give numbers with their units, and round them to a sensible precision for the reader.",
         "When a question has several parts, answer each part in the order in which it was asked.",
         "Do not repeat the question back to the user before answering it; start with the answer itself.",
         "Avoid jargon; when a technical word is needed, explain it in a few simple words the first time.",
         "Be kind to the user, and never mock a question, however simple it may seem to you."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--nproc", type=int, default=1, help="model-parallel ranks (1, 2, 3, 6 or 9 for SmolLM2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads in all")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="instead: TTFT with the prefix cache on and off (a chat, a shared system prompt)")
    parser.add_argument("--turns", type=int, default=10, help="--prefix-cache: turns of the chat")
    parser.add_argument("--chat-tokens", type=int, default=48, help="--prefix-cache: max_tokens of each chat reply")
    parser.add_argument("--shared-requests", type=int, default=16,
                        help="--prefix-cache: requests sent at once that share a system prompt")
    parser.add_argument("--system-tokens", type=int, default=500, help="--prefix-cache: about this many tokens")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="more flags for `accessory serve` (last), e.g. --quant int4 --compile")
    parser.add_argument("--startup", action="store_true", help="measure startup and the first requests instead")
    args = parser.parse_args()
    if args.prefix_cache:
        prefix_cache_main(args)
        return
    if args.startup:
        startup_main(args)
        return

    with serving(args) as url:
        results = [run_clients(url, clients, args) for clients in args.clients]
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


@contextmanager
def serving(args, flags: tuple[str, ...] = ()):
    """A warmed-up `accessory serve` (with `flags`); its URL. Stopped with SIGTERM at the end."""
    port = free_port()
    server = start_server(port, args, flags)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server)
        # warm-up: one request alone, then two together (a compiled step has a graph for each: see --compile)
        one_request(url, user("Say hello."), args.max_tokens)
        warm = [threading.Thread(target=one_request, args=(url, user("Say hello."), args.max_tokens))
                for _ in range(2)]
        [t.start() for t in warm]
        [t.join() for t in warm]
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, args, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    threads = max(1, args.threads // args.nproc)
    serve = ["-m", "accessory", "serve", "--port", str(port), "--max_seq_len", "1024", "--max_batch_size", "16",
             *args.serve_args, *flags]
    if args.nproc == 1:
        command = [sys.executable, *serve]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   *serve]
    return subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def startup_main(args) -> None:
    print(f"accessory serve, SmolLM2-135M-Instruct, {args.nproc} rank(s), {args.threads} thread(s), "
          f"max_tokens {args.max_tokens}; seconds")
    print(f"{'flags':>28} {'to /health ok':>13} {'1st alone':>9} {'1st 4':>7} {'2nd alone':>9} {'2nd 4':>7}")
    for flags in ((), ("--compile",)):
        port, start = free_port(), time.perf_counter()
        server = start_server(port, args, flags)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, server)
            ready = time.perf_counter() - start
            times = [timed_together(url, n, args.max_tokens) for n in (1, 4, 1, 4)]
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
        shown = " ".join([*args.serve_args, *flags]) or "(none)"
        print(f"{shown:>28} {ready:>13.1f} {times[0]:>9.2f} {times[1]:>7.2f} {times[2]:>9.2f} {times[3]:>7.2f}")


def timed_together(url: str, n: int, max_tokens: int) -> float:
    """Seconds until n chat requests sent at once have all been answered."""
    threads = [threading.Thread(target=one_request, args=(url, user(f"Tell me about {TOPICS[i]}."), max_tokens))
               for i in range(n)]
    start = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    return time.perf_counter() - start


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
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


def one_request(url: str, messages: list[dict], max_tokens: int) -> dict:
    """Stream one chat completion: {"ttft": seconds to the first content, "tokens": completion tokens,
    "prompt_tokens", "text"}."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, usage, text = time.perf_counter(), None, {}, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if ttft is None and content:
                ttft = time.perf_counter() - start
            text.append(content or "")
            usage = chunk.get("usage") or usage
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start,
            "tokens": usage.get("completion_tokens", 0), "prompt_tokens": usage.get("prompt_tokens", 0),
            "text": "".join(text)}


def run_clients(url: str, clients: int, args) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for k in range(args.requests):
            topic = TOPICS[(index * args.requests + k) % len(TOPICS)]
            result = one_request(url, user(f"Write a short paragraph about {topic}."), args.max_tokens)
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


# ---- --prefix-cache ---------------------------------------------------------------------------------------------

def prefix_cache_main(args) -> None:
    runs = {}
    for cache, flags in (("on", ()), ("off", ("--no-prefix-cache",))):
        with serving(args, flags) as url:
            runs[cache] = {"chat": chat_turns(url, args), "shared": shared_system_prompt(url, args)}
    rows = prefix_cache_rows(runs)
    same = all(on["text"] == off["text"] for kind in ("chat", "shared")
               for on, off in zip(runs["on"][kind], runs["off"][kind]))
    print(f"\naccessory serve, SmolLM2-135M-Instruct, {args.nproc} rank(s), {args.threads} thread(s), prefix cache "
          f"on and off; replies identical: {'yes' if same else 'NO'}")
    print(f"{'scenario':<44} {'prompt tokens':>13} {'TTFT on':>8} {'TTFT off':>8} {'off / on':>8}")
    for name, tokens, on, off in rows:
        print(f"{name:<44} {tokens:>13} {on:>8.3f} {off:>8.3f} {off / on:>8.2f}")
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "replies_identical": same}, indent=1))


def chat_turns(url: str, args) -> list[dict]:
    """One conversation of args.turns turns, each sending the whole conversation so far."""
    messages, results = [], []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Tell me one fact about {TOPICS[turn % len(TOPICS)]}."})
        result = one_request(url, messages, args.chat_tokens)
        messages.append({"role": "assistant", "content": result["text"]})
        results.append(result)
    return results


def shared_system_prompt(url: str, args) -> list[dict]:
    """args.shared_requests requests sent at once: one long system prompt, a different question each."""
    system = " ".join(RULES[i % len(RULES)] for i in range(max(1, args.system_tokens // 20)))
    results: list[dict] = [{} for _ in range(args.shared_requests)]

    def ask(i: int) -> None:
        question = f"What is special about {TOPICS[i % len(TOPICS)]}?"
        messages = [{"role": "system", "content": system}, *user(question)]
        results[i] = one_request(url, messages, 16)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(args.shared_requests)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return results


def prefix_cache_rows(runs: dict) -> list[tuple[str, str, float, float]]:
    """(scenario, prompt tokens, TTFT on, TTFT off) for the table; the chat's first turn is left out (it has
    nothing to reuse)."""
    def summary(kind: str, reduce) -> list[float]:
        return [reduce([r["ttft"] for r in runs[cache][kind][kind == "chat":]]) for cache in ("on", "off")]

    chat, burst = runs["on"]["chat"], runs["on"]["shared"]
    n, k = len(chat), len(burst)
    chat_tokens, burst_tokens = f"{chat[1]['prompt_tokens']}-{chat[-1]['prompt_tokens']}", \
        f"{k} x {burst[0]['prompt_tokens']}"
    return [(f"{n}-turn chat: turns 2-{n}, mean", chat_tokens, *summary("chat", statistics.mean)),
            (f"{n}-turn chat: turn {n}", str(chat[-1]["prompt_tokens"]), *summary("chat", lambda ts: ts[-1])),
            (f"{k} requests at once, shared system: p50", burst_tokens, *summary("shared", statistics.median)),
            (f"{k} requests at once, shared system: mean", burst_tokens, *summary("shared", statistics.mean))]


if __name__ == "__main__":
    main()
