"""The per-token cost of constrained decoding with each grammar library, on the built-in model's tokenizer.

For each library: compile a JSON schema (and plain JSON), then walk a valid document token by token as decoding
would: compute the mask of allowed tokens, check the document's next token is in it, consume it. Prints the compile
time and the mean and 99th-percentile time per token (mask + consume). One process, one thread: what the source
rank pays per constrained row per step.

    .venv/bin/python benchmarks/grammar.py
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from accessory.checkpoint.default_model import ensure_default_model
from accessory.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                       "tags": ["math", "poetry", "engines", "notes"],
                       "address": {"city": "London", "zip": "W1"}, "active": True})


def walk(tokens: list[int], mask_and_consume) -> list[float]:
    times = []
    for token in tokens:
        start = time.perf_counter()
        mask_and_consume(token)
        times.append(time.perf_counter() - start)
    return times


def bench_llguidance(tokenizer: Tokenizer, tokens: list[int], schema) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch as llt

    lltok = llguidance.LLTokenizer(tokenizer.backend.tk.to_str(), n_vocab=tokenizer.n_words,
                                   eos_token=sorted(tokenizer.chat_stop_ids))
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema) if schema else \
        llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    bitmask = llt.allocate_token_bitmask(1, lltok.vocab_size)

    def step(token):
        llt.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = (bitmask[0, token // 32] >> (token % 32)) & 1
        assert allowed, (token, matcher.get_error())
        assert matcher.consume_token(token), matcher.get_error()

    return compile_s, walk(tokens, step)


def bench_xgrammar(tokenizer: Tokenizer, tokens: list[int], schema) -> tuple[float, list[float]]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend.tk)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.n_words,
                                              stop_token_ids=sorted(tokenizer.chat_stop_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema)) if schema else compiler.compile_builtin_json_grammar()
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def step(token):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = (bitmask[0, token // 32] >> (token % 32)) & 1
        assert allowed, token
        assert matcher.accept_token(token)

    return compile_s, walk(tokens, step)


def main():
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_path(ensure_default_model())
    tokens = tokenizer.encode(DOCUMENT, bos=False, eos=False)
    print(f"document: {len(tokens)} tokens; vocab {tokenizer.n_words}")
    print("| library | grammar | compile ms | per token mean us | p99 us |")
    print("|---|---|---|---|---|")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        for label, schema in (("json_schema", SCHEMA), ("json_object", None)):
            bench(tokenizer, tokens, schema)  # warm-up: first-use costs (tokenizer tables) are paid once per server
            compile_s, times = bench(tokenizer, tokens, schema)
            times_us = sorted(t * 1e6 for t in times)
            p99 = times_us[min(len(times_us) - 1, int(0.99 * len(times_us)))]
            print(f"| {name} | {label} | {compile_s * 1e3:.1f} | {statistics.mean(times_us):.0f} | {p99:.0f} |")


if __name__ == "__main__":
    main()
