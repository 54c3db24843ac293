"""The generation engine through MetaModel: batching of mixed lengths, per-row stopping that saves compute, stop
strings across token boundaries (streamed or not), UTF-8, seeds, rank agreement, parameter checks, the KV-cache
lifecycle, the long-input policy, and scoring."""
from __future__ import annotations

import logging

import pytest
import torch

from distributed import run_ranks
from tiny import StepRows, greedy_ids

PROMPTS = ["Hi", "The quick brown fox", "Tensor parallel inference is a way to", "Once upon a time there was",
           "1 2 3 4 5 6 7 8 9 10 11 12 13", "Hello there", "Paris, the city of light, is the capital of", "Why is the sky blue? Because the air"]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=128)


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(smollm2_checkpoint, max_seq_len=1024)


# ---- batching ------------------------------------------------------------------------------------------------

def test_batch_of_eight_lengths_equals_each_prompt_alone(model):
    assert len({len(model.tokenizer.encode(p, True, False)) for p in PROMPTS}) == 8
    batch = model.generate(PROMPTS, max_gen_len=24)
    assert batch == [model.generate([p], max_gen_len=24)[0] for p in PROMPTS]
    ids = [model.tokenizer.encode(p, True, False) for p in PROMPTS]
    assert greedy_ids(model, ids, 24) == [greedy_ids(model, [i], 24)[0] for i in ids]


def test_more_prompts_than_max_batch_size_run_in_waves(model):
    engine = model.engine
    model.engine = engine.configured(max_batch_size=3)
    try:
        with StepRows(model.engine) as sizes:
            waves = model.generate(PROMPTS, max_gen_len=8)
    finally:
        model.engine = engine
    assert max(sizes) == 3
    assert waves == model.generate(PROMPTS, max_gen_len=8)


def test_a_row_that_stops_early_yields_its_text_and_costs_nothing_after(model):
    ids = [model.tokenizer.encode(p, True, False) for p in PROMPTS[:3]]
    free = greedy_ids(model, ids, 20)
    stop = free[0][3]  # row 0's 4th token becomes a stop token; rows 1 and 2 must not contain it
    assert stop not in free[1] and stop not in free[2]
    saved = set(model.stop_ids)
    model.stop_ids = saved | {stop}
    try:
        with StepRows(model.engine) as sizes:
            texts = model.generate(PROMPTS[:3], max_gen_len=20)
    finally:
        model.stop_ids = saved
    assert texts[0] == model.tokenizer.decode(free[0][:3])
    assert texts[1:] == [model.tokenizer.decode(row) for row in free[1:]]
    assert sizes[:4] == [3, 3, 3, 3] and set(sizes[4:]) == {2}  # row 0 left the batch after its stop token


# ---- stop strings and streaming --------------------------------------------------------------------------------

def stop_across_tokens(model, prompt: str) -> str:
    """A stop string made of the end of one generated token and the start of the next."""
    [ids] = greedy_ids(model, [model.tokenizer.encode(prompt, True, False)], 30)
    for k in range(4, len(ids) - 1):
        left, both = model.tokenizer.decode(ids[:k]), model.tokenizer.decode(ids[:k + 1])
        piece = both[len(left):]
        if len(left) >= 2 and len(piece) >= 2 and left[-2:].strip() and piece[:2].strip():
            return left[-2:] + piece[:2]
    pytest.fail("no token boundary with two visible characters on each side")


@pytest.mark.parametrize("prompt", PROMPTS[1:4])
def test_stop_string_across_tokens_is_never_output(model, prompt):
    full = model.generate([prompt], max_gen_len=30)[0]
    stop = stop_across_tokens(model, prompt)
    cut = model.generate([prompt], max_gen_len=30, additional_stop_symbols=[stop])[0]
    assert cut == full[: full.index(stop)] and stop not in cut
    chunks = list(model.stream_generate(prompt, max_gen_len=30, additional_stop_symbols=[stop]))
    assert chunks[-1]["text"] == cut and chunks[-1]["end_of_content"]
    assert [c["end_of_content"] for c in chunks].count(True) == 1
    assert "".join(c["delta"] for c in chunks) == cut
    for chunk in chunks:
        assert stop not in chunk["text"]
        assert cut.startswith(chunk["text"]), "streamed text is never taken back"


def test_streaming_a_batch_ends_like_generate(model):
    stop = stop_across_tokens(model, PROMPTS[2])
    steps = list(model.stream_generate(PROMPTS[:4], max_gen_len=20, additional_stop_symbols=[stop]))
    expected = model.generate(PROMPTS[:4], max_gen_len=20, additional_stop_symbols=[stop])
    assert [event["text"] for event in steps[-1]] == expected
    for row in range(4):
        assert "".join(step[row]["delta"] for step in steps) == expected[row]
        assert all(stop not in step[row]["text"] for step in steps)


def test_utf8_streams_whole_characters(smollm2):
    messages = [{"role": "user", "content": "请用中文写一句话介绍北京。"}]
    chunks = list(smollm2.stream_chat(messages, max_gen_len=40))
    assert any("\u4e00" <= ch <= "\u9fff" for ch in chunks[-1]["text"]), chunks[-1]["text"]
    assert all("\ufffd" not in c["text"] and "\ufffd" not in c["delta"] for c in chunks)
    assert chunks[-1]["text"] == smollm2.chat(messages, max_gen_len=40)


def test_chat_uses_the_models_template_and_stops_at_end_of_turn(smollm2):
    answer = smollm2.chat([{"role": "system", "content": "You answer in one short sentence."},
                           {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer and "<|im_end|>" not in answer and "<|im_start|>" not in answer
    assert (answer.content, answer.reasoning, answer.tool_calls) == (answer, None, ())


def test_chat_reads_a_reply_for_its_reasoning_and_calls():
    """What MetaModel.chat and the server read from a reply (generation/chat.py read_reply)."""
    from accessory.generation.chat import read_reply
    from accessory.text.reasoning import REASONING_FORMATS
    from accessory.text.tool_calls import FORMATS, ToolReading

    text = '<think>\nA city.\n</think>\n\nSure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' * 2
    calls = ToolReading(FORMATS["hermes"], frozenset({"f"}))
    reply = read_reply(text, (REASONING_FORMATS["qwen3"], False), calls)
    assert reply == text and reply.reasoning == "A city." and [c.name for c in reply.tool_calls] == ["f", "f"]
    assert reply.content.startswith("Sure.") and "<tool_call>" not in reply.content
    single = read_reply(text, (REASONING_FORMATS["qwen3"], False), ToolReading(calls.format, calls.tools, False))
    assert len(single.tool_calls) == 1
    assert read_reply("Paris.").content == "Paris." and read_reply("Paris.").reasoning is None


# ---- sampling, seeds, ranks -------------------------------------------------------------------------------------

def test_seed_makes_sampling_reproducible(model):
    kwargs = dict(max_gen_len=24, temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.2)
    runs = [model.generate(PROMPTS[:3], seed=7, **kwargs) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(model.generate(PROMPTS[:3], seed=s, **kwargs)) for s in range(4)}) > 1


def test_top_k_1_is_greedy(model):
    assert model.generate(PROMPTS[:3], max_gen_len=16, temperature=1.5, top_k=1, seed=3) == \
        model.generate(PROMPTS[:3], max_gen_len=16)


def sample_with_divergent_global_rngs(folder):
    """Each rank seeds its global RNG differently and gets a different prompt; they must still agree."""
    import torch.distributed as dist

    from accessory.model.meta import MetaModel

    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    return model.generate(PROMPTS[rank * 2: rank * 2 + 2], max_gen_len=16, temperature=1.0, top_p=1.0)


def test_ranks_agree_without_caller_cooperation(tiny_checkpoints):
    results = run_ranks(2, sample_with_divergent_global_rngs, tiny_checkpoints["mha", 2])
    assert not isinstance(results[0], Exception), results[0].rank_traceback
    assert results[0] == results[1]


@pytest.mark.parametrize("kwargs,name", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_gen_len=0), "max_gen_len"), (dict(repetition_penalty=0.0),
                                                                         "repetition_penalty"),
    (dict(truncate="right"), "truncate")])
def test_bad_parameters_raise_value_error_naming_them(model, kwargs, name):
    for call in (lambda: model.generate(PROMPTS[:1], **kwargs), lambda: list(model.stream_generate("x", **kwargs))):
        with pytest.raises(ValueError, match=name):
            call()


def test_empty_prompt_list_and_bad_messages_are_refused(model):
    with pytest.raises(ValueError, match="prompts"):
        model.generate([])
    with pytest.raises(ValueError, match="list of prompts"):
        model.generate("a string, not a list")
    with pytest.raises(ValueError, match="last message"):
        model.chat([{"role": "user", "content": "hi"}, {"role": "developer", "content": "hi"}])


# ---- long inputs and the KV cache ------------------------------------------------------------------------------

def test_long_prompt_policy_is_the_same_everywhere(model, caplog):
    long_prompt = "word " * 200  # > max_seq_len 128 tokens
    with caplog.at_level(logging.WARNING):
        [text] = model.generate([long_prompt], max_gen_len=10)
    assert "keeping the last 118" in caplog.text
    [kept_end] = greedy_ids(model, [model.tokenizer.encode(long_prompt, True, False)[-118:]], 10)
    assert text == model.tokenizer.decode(kept_end)  # the prompt's last 118 tokens are what the model saw
    for call in (lambda: model.generate([long_prompt], max_gen_len=10, truncate="error"),
                 lambda: list(model.stream_generate(long_prompt, max_gen_len=10, truncate="error")),
                 lambda: model.chat([{"role": "user", "content": long_prompt}], max_gen_len=10, truncate="error")):
        with pytest.raises(ValueError, match="at most 118 fit in max_seq_len 128"):
            call()
    with pytest.raises(ValueError, match="max_gen_len"):
        model.generate(["hi"], max_gen_len=128)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_cache_memory_is_flat_over_100_calls(model):
    # (rows, tokens) per call: the rows change the cache's size. The lengths cannot (at max_seq_len 128 every
    # cache is 128 columns wide); they are short so that 100 calls take seconds, yet each call still decodes
    sizes = [(1, 3), (8, 15), (3, 30), (5, 6)]
    rss = []
    for call in range(100):
        batch, gen = sizes[call % len(sizes)]
        model.generate(PROMPTS[:batch], max_gen_len=gen)
        assert sum(c.nbytes(model.llma) for c in model.engine.kept) <= model.engine.settings.keep_cache_bytes
        if call in (3, 99):
            rss.append(rss_bytes())
    assert rss[1] - rss[0] < 16 << 20, f"grew by {(rss[1] - rss[0]) >> 20} MiB"
    engine = model.engine
    model.engine = engine.configured(keep_cache_bytes=0)
    try:
        model.generate(PROMPTS[:2], max_gen_len=4)
        assert model.engine.kept == [], "a cache over the cap is released after the call"
    finally:
        model.engine = engine


# ---- scoring ----------------------------------------------------------------------------------------------------

def test_next_token_probs_match_a_direct_softmax(model):
    top = model.next_token_probs(PROMPTS[2], top_k=10, temperature=0.7)
    [logits] = model.compute_logits([PROMPTS[2]])
    probs = torch.softmax(logits[-1] / 0.7, dim=-1)
    values, ids = probs.topk(10)
    assert [t[2] for t in top] == ids.tolist()
    assert [t[1] for t in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    everything = model.next_token_probs(PROMPTS[2], top_k=model.llma.args.vocab_size)
    assert sum(t[1] for t in everything) == pytest.approx(1.0, abs=1e-4)
    assert top[0][0] == model.tokenizer.decode([top[0][2]])


def test_compute_logits_equals_the_model_on_each_example_alone(model):
    examples = PROMPTS[:4]
    for text, logits in zip(examples, model.compute_logits(examples)):
        alone = model.llma(torch.tensor([model.tokenizer.encode(text, True, False)]))[0]
        assert logits.shape == alone.shape and (logits - alone).abs().max() < 1e-5


def test_evaluate_examples_against_hand_computed_log_likelihoods(model):
    context = "The quick brown fox"
    examples = [context + " jumps over the lazy dog", context + " sat"]
    result = model.evaluate_examples(examples, contexts=[context, context])
    for i, example in enumerate(examples):
        ids = model.tokenizer.encode(example, True, False)
        start = len(model.tokenizer.encode(context, True, False))
        logprobs = torch.log_softmax(model.compute_logits([example])[0], dim=-1)
        expected = sum(logprobs[p - 1, ids[p]].item() for p in range(start, len(ids)))
        assert result["log_likelihood"][i] == pytest.approx(expected, abs=1e-3)
        assert result["ppl"][i] == pytest.approx(-expected / (len(ids) - start), abs=1e-4)
        assert result["non_context_logits"][i].shape[0] == len(ids) - start
    whole = model.evaluate_examples(examples[:1])
    assert len(whole["max_equal"]) == 1 and whole["log_likelihood"][0] < result["log_likelihood"][0]
    greedy = PROMPTS[1] + model.generate([PROMPTS[1]], max_gen_len=6)[0]
    assert model.evaluate_examples([greedy], contexts=[PROMPTS[1]])["max_equal"] == [True]
    with pytest.raises(ValueError, match="context 0"):
        model.evaluate_examples(["abc def"], contexts=["xyz"])
