"""Speculative decoding against plain decoding on the same engine and weights, and llama.cpp's prompt lookup.

The built-in SmolLM2-135M-Instruct answers two kinds of prompt at batch 1, greedily, up to `--new-tokens` tokens
(EOS ends an answer, as a user would see it): copy-or-edit tasks (repeat a text or a list, rename a variable in
code, continue a paragraph's copy: the answer is mostly in the prompt) and ordinary chat questions (it is not). Forms, each run on one loaded model:

- `ngram`: the GGUF's own Q4_1 bits (`ours:int4`), compiled unless `--eager`, plain against
  `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 2}`;
- `self-draft`: the float32 import, plain against `{"model": "self", "quant": "int4", "num_speculative_tokens": 4}`
  (the same weights in int4 as the draft).

Every prompt's answer must be the same token for token with and without speculation (the run fails otherwise). Each
timing is the median of `--repeats` calls of `MetaModel.generate` after one warm-up (which also compiles), end to end;
tokens/s is the answer's tokens over that time, summed over the prompts of a kind. "After the first token" compares
the time past a 1-token answer's (the prompt's prefill, which speculation cannot shorten): decoding alone. `costs`
are the engine's measured step costs (a step proposing 1..K tokens, in plain decode steps). The acceptance rate is accepted
over proposed tokens, from the engine's counters.

llama.cpp (llama-cpp-python, if installed): `Llama.generate` on the same prompt ids, greedy, plain and with
`LlamaPromptLookupDecoding(num_pred_tokens=K)` as its draft model, stopped at EOS or the same token count.

    python benchmarks/speculative.py --threads 2 --new-tokens 128 --repeats 3 [--forms ngram self-draft] [--eager]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

PARAGRAPH = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within fifty "
             "years, presses in more than two hundred cities had printed millions of books.")
CODE = ("def total(items):\n    x = 0\n    for item in items:\n        x = x + item.price * item.quantity\n"
        "    return x\n\n\ndef average(items):\n    x = total(items)\n    return x / len(items)\n")
# Chat prompts but the last, a plain completion: the answer is mostly in the prompt.
COPY_PROMPTS = [
    "Repeat this text exactly:\n" + PARAGRAPH,
    "Copy this list exactly:\n1. apples\n2. bread\n3. milk\n4. eggs\n5. butter\n6. cheese\n7. tomatoes\n8. rice",
    "Rename the variable `x` to `count` in this code and write it out in full:\n```python\n" + CODE + "```",
    PARAGRAPH + "\n\nThe same paragraph, copied word for word:\n\nThe history",
]
CHAT_PROMPTS = [
    "What is the capital of France? Tell me about it.",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forms", nargs="+", default=["ngram", "self-draft"], choices=["ngram", "self-draft"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens for ngram")
    p.add_argument("--eager", action="store_true", help="do not compile the decode and verify steps")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for form in args.forms:
        plain, fast, config = models(form, args)
        for kind, prompts in (("copy/edit", COPY_PROMPTS), ("chat", CHAT_PROMPTS)):
            report(form, kind, config, plain, fast, [as_chat(plain.tokenizer, p) for p in prompts], args)
        if form == "ngram":
            llama_cpp_rows(plain, args)


def as_chat(tokenizer, prompt: str) -> str:
    """The prompt as the user's chat turn, but the plain completion (which starts with the paragraph)."""
    if prompt.startswith(PARAGRAPH):
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])


def models(form: str, args):
    """The plain model, the speculating one (sharing its weights) and the speculative config."""
    from accessory.checkpoint.default_model import ensure_default_model
    from accessory.generation.speculative import SpeculativeConfig
    from accessory.model.meta import MetaModel

    compile_ = not args.eager
    if form == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3,
                  "prompt_lookup_min": 2}
        plain = MetaModel.from_pretrained(ensure_default_model(True), max_seq_len=1024, compile=compile_)
        settings = replace(plain.engine.settings, speculative=SpeculativeConfig.from_dict(config))
        return plain, MetaModel(plain.llma, plain.tokenizer, plain.llama_type, settings), config
    config = {"model": "self", "quant": "int4", "num_speculative_tokens": 4}
    plain = MetaModel.from_pretrained(ensure_default_model(), max_seq_len=1024, compile=compile_)
    fast = MetaModel.from_pretrained(ensure_default_model(), max_seq_len=1024, compile=compile_,
                                     speculative_config=config)
    return plain, fast, config


def timed(model, prompt: str, n: int, repeats: int) -> tuple[float, float, list[int]]:
    """The median seconds of `repeats` greedy answers to `prompt` of up to `n` tokens and of 1 token (the prompt's
    prefill and first token: what speculation cannot shorten), after one warm-up; and the answer's ids."""
    model.generate([prompt], max_gen_len=n)
    times, firsts = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        model.generate([prompt], max_gen_len=1)
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        text = model.generate([prompt], max_gen_len=n)[0]
        times.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(firsts), model.tokenizer.encode(text, bos=False, eos=False)


def report(form: str, kind: str, config: dict, plain, fast, prompts: list[str], args) -> None:
    stats = fast.engine.stats
    proposed, accepted = stats.proposed_tokens, stats.accepted_tokens
    total_plain = total_fast = first_plain = first_fast = tokens = 0.0
    for prompt in prompts:
        t_plain, f_plain, ids_plain = timed(plain, prompt, args.new_tokens, args.repeats)
        t_fast, f_fast, ids_fast = timed(fast, prompt, args.new_tokens, args.repeats)
        if ids_fast != ids_plain:
            raise SystemExit(f"{form}: the answer to {prompt[:60]!r} differs with speculation")
        total_plain, total_fast, tokens = total_plain + t_plain, total_fast + t_fast, tokens + len(ids_plain)
        first_plain, first_fast = first_plain + f_plain, first_fast + f_fast
    rate = (stats.accepted_tokens - accepted) / max(1, stats.proposed_tokens - proposed)
    decoding = (total_plain - first_plain) / (total_fast - first_fast)
    print(f"{form:10s} {kind:9s} {'compiled' if not args.eager else 'eager':8s} plain {tokens / total_plain:7.1f} "
          f"tok/s  speculative {tokens / total_fast:7.1f} tok/s  x{total_plain / total_fast:.2f} end to end, "
          f"x{decoding:.2f} after the first token  accepted {rate:.0%}  ({int(tokens)} tokens, identical)  "
          f"{config}  costs {' '.join(f'{c:.2f}' for c in fast.engine.speculation.step_costs or ())}", flush=True)


def llama_cpp_rows(plain, args) -> None:
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("llama.cpp: not installed (pip install llama-cpp-python==0.3.36; a benchmark peer only)")
        return
    from accessory.checkpoint.default_model import gguf_path

    engines = {name: llama_cpp.Llama(model_path=str(gguf_path()), n_threads=args.threads,
                                     n_threads_batch=args.threads, n_ctx=1024, verbose=False, draft_model=draft)
               for name, draft in (("plain", None), ("lookup", LlamaPromptLookupDecoding(num_pred_tokens=args.k)))}
    for kind, prompts in (("copy/edit", COPY_PROMPTS), ("chat", CHAT_PROMPTS)):
        totals, counts = {"plain": 0.0, "lookup": 0.0}, set()
        for prompt in prompts:
            ids = plain.tokenizer.encode(as_chat(plain.tokenizer, prompt), bos=True, eos=False)
            for name, llm in engines.items():
                seconds, n = llama_cpp_time(llm, ids, args)
                totals[name] += seconds
                counts.add((prompt, name, n))
        tokens = sum(n for _, name, n in counts if name == "plain")
        print(f"llama.cpp  {kind:9s} native   plain {tokens / totals['plain']:7.1f} tok/s  prompt lookup "
              f"{tokens / totals['lookup']:7.1f} tok/s  x{totals['plain'] / totals['lookup']:.2f}", flush=True)


def llama_cpp_time(llm, ids: list[int], args) -> tuple[float, int]:
    """Median seconds of `repeats` greedy answers (after a warm-up), and the answer's token count."""
    def run() -> int:
        llm.reset()
        n = 0
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
            if token == llm.token_eos():
                break
            n += 1
            if n == args.new_tokens:
                break
        return n

    run()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        n = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), n


if __name__ == "__main__":
    main()
