"""The rest of the OpenAI API on a live `accessory serve` (the default model at 3 ranks), through the official
`openai` client: log-probs against the model's own logits in this process, n samples, the penalties, logit_bias and
min_p, content-part arrays, developer and tool roles, continuing an assistant message, structured output validated
with jsonschema, /tokenize and /detokenize, system_fingerprint; and every other field refused by name. Operating it:
/health while loading, /metrics counting exactly the requests made, X-Request-Id and the per-request log line, SSE
keep-alive comments while a request waits."""
from __future__ import annotations

import concurrent.futures
import json
import math
import re

import httpx
import jsonschema
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from serving import KEY, MODEL, QUESTION, chat, streamed_text

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oracle(smollm2_checkpoint):
    """The same checkpoint in this process, one rank: its logits are what the server's log-probs must say."""
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(str(smollm2_checkpoint), max_seq_len=512)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


# ---- log-probs ----------------------------------------------------------------------------------------------------

def test_chat_logprobs_are_the_models_own(server, oracle):
    answer = chat(server.client(), max_tokens=8, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens >= 5
    prompt = post(server, "/tokenize", {"model": MODEL, "messages": QUESTION}).json()["tokens"]
    generated = oracle.tokenizer.encode("".join(c.token for c in content), bos=False, eos=False)
    logits = oracle.compute_logits([prompt + generated], bos=False)[0]
    expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for position, (entry, token) in enumerate(zip(content, generated)):
        assert math.isclose(entry.logprob, expected[position, token].item(), abs_tol=2e-3), position
        best = expected[position].topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=2e-3)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert bytes(entry.bytes).decode() == entry.token


def test_completion_logprobs_streamed_equal_whole(server):
    client = server.client()
    ask = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**ask).choices[0]
    tokens, logprobs = [], []
    for chunk in client.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
    assert "".join(whole.logprobs.tokens) == whole.text and tokens == whole.logprobs.tokens
    assert logprobs == pytest.approx(whole.logprobs.token_logprobs)
    assert all(len(top) == 2 for top in whole.logprobs.top_logprobs)
    assert whole.logprobs.text_offset[0] == 0


# ---- n, penalties, bias ---------------------------------------------------------------------------------------------

def test_n_samples_differ_and_repeat_with_a_seed(server):
    client = server.client()
    ask = dict(messages=[{"role": "user", "content": "Write a word."}], max_tokens=4, temperature=1.0, seed=7)
    first = chat(client, n=3, logprobs=True, **ask)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3
    again = chat(client, n=3, **ask)
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert chat(client, **ask).choices[0].message.content == texts[0]  # sample 0 is what n=1 gives
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    assert first.usage.prompt_tokens == chat(client, **ask).usage.prompt_tokens  # the prompt counts once
    streamed = {}
    for chunk in chat(client, n=3, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_logit_bias_and_min_p_change_what_is_chosen(server):
    client = server.client()
    plain = chat(client, max_tokens=4, logprobs=True)
    first_token = plain.choices[0].logprobs.content[0].token
    first_id = post(server, "/tokenize", {"prompt": first_token, "add_special_tokens": False}).json()["tokens"][0]
    banned = chat(client, max_tokens=1, logit_bias={str(first_id): -100}, logprobs=True)  # its first token is all
    assert banned.choices[0].logprobs.content[0].token != first_token
    # min_p = 1 keeps only the most likely token: sampling at any temperature is then greedy
    assert chat(client, max_tokens=4, temperature=2.0, seed=3, extra_body={"min_p": 1.0}).choices[0].message.content == \
        plain.choices[0].message.content


def test_penalties_and_bias_choose_the_argmax_of_the_adjusted_logits(server, oracle):
    """Greedy with OpenAI's penalties: each token is the argmax of the model's logits minus frequency_penalty per
    earlier occurrence in the output and presence_penalty once, plus the bias (recomputed here, one rank)."""
    prompt = "I like apples and apples like me. Apples apples"
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    bias = {oracle.tokenizer.encode(" and", bos=False, eos=False)[0]: -5.0}
    answer = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, frequency_penalty=1.5, presence_penalty=0.5,
        logit_bias={str(t): b for t, b in bias.items()}, logprobs=0).choices[0]
    generated = oracle.tokenizer.encode("".join(answer.logprobs.tokens), bos=False, eos=False)
    logits = oracle.compute_logits([ids + generated], bos=False)[0][len(ids) - 1:]
    counts = torch.zeros(logits.shape[-1])
    for position, token in enumerate(generated):
        adjusted = logits[position] - 1.5 * counts - 0.5 * (counts > 0)
        for biased, value in bias.items():
            adjusted[biased] += value
        assert adjusted.argmax().item() == token, position
        counts[token] += 1
    plain = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert plain.choices[0].text != answer.text


# ---- messages -------------------------------------------------------------------------------------------------------

def test_content_parts_developer_role_and_continuing_the_assistant(server):
    client = server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert chat(client, parts, max_tokens=4).choices[0].message.content == \
        chat(client, joined, max_tokens=4).choices[0].message.content
    developer = [{"role": "developer", "content": "Answer in French."}, *QUESTION]
    system = [{"role": "system", "content": "Answer in French."}, *QUESTION]
    answer = chat(client, developer, max_tokens=4).choices[0].message.content
    assert answer == chat(client, system, max_tokens=4).choices[0].message.content
    assert answer != chat(client, max_tokens=4).choices[0].message.content  # the instruction changed the answer
    whole = chat(client, max_tokens=10).choices[0].message.content
    start = whole[:len(whole) // 2].rstrip()
    rest = chat(client, [*QUESTION, {"role": "assistant", "content": start}], max_tokens=10).choices[0]
    assert (start + rest.message.content).startswith(whole[:len(whole) * 3 // 4])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    refused = post(server, "/v1/chat/completions", {"model": MODEL, "messages": image})
    assert refused.status_code == 400 and "image_url" in refused.json()["error"]["message"]


def test_tools_need_a_template_that_writes_them(server):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    answer = post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": tools})
    assert answer.status_code == 400 and "tools" in answer.json()["error"]["message"]
    assert post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": tools,
                                                 "tool_choice": "none", "max_tokens": 4}).status_code == 200


# ---- structured output ---------------------------------------------------------------------------------------------

def test_json_schema_output_validates_on_8_seeds_decoding_together(server):
    client = server.client()
    ask = [{"role": "user", "content": "Invent a person: name and age, as JSON."}]

    def person(seed: int):
        return chat(client, ask, max_tokens=32, temperature=1.0, seed=seed,
                    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # they share the batch
        answers = list(pool.map(person, range(8)))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({answer.choices[0].message.content for answer in answers}) > 4


def test_json_object_regex_and_choice(server):
    client = server.client()
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    streamed, _, finish = streamed_text(chat(client, ask, max_tokens=80, stream=True,
                                             response_format={"type": "json_object"}))
    assert finish == "stop" and isinstance(json.loads(streamed), dict)
    date = chat(client, [{"role": "user", "content": "When did the Bastille fall?"}], max_tokens=20,
                extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}).choices[0].message.content
    assert len(date) == 10 and date[4] == date[7] == "-"
    picked = chat(client, max_tokens=10, extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]}, n=3,
                  temperature=1.0, seed=1)
    assert {c.message.content for c in picked.choices} <= {"Paris", "Lyon", "Nice"}


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"logit_bias": {"99999999": 1}}, None),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"store": True}, "store"),
    ({"messages": [{"role": "user", "content": "hi", "color": "red"}]}, "messages.0.color"),
], ids=["bad-schema", "bad-regex", "two-constraints", "unknown-format", "tool-choice", "penalty-range",
        "bias-token", "top-without-logprobs", "too-many-top", "unknown-field", "unknown-message-field"])
def test_fields_that_cannot_work_are_refused_by_name(server, body, param):
    answer = post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert param is None or error["param"] == param, error


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(server, oracle):
    client, prompt = server.client(), "The capital of France is"
    ask = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = client.completions.create(**ask).choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt + " Paris") and "".join(logprobs.tokens) == choice.text
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    expected = torch.log_softmax(oracle.compute_logits([ids], bos=False)[0], dim=-1)
    shown = len(ids) - (ids[0] == oracle.tokenizer.bos_id)  # a BOS the text does not hold is not shown
    first = len(ids) - shown  # the position of the first token shown
    for k in range(shown):
        position = first + k
        if position == 0:
            assert logprobs.token_logprobs[k] is None and logprobs.top_logprobs[k] is None
            continue
        assert math.isclose(logprobs.token_logprobs[k], expected[position - 1, ids[position]].item(), abs_tol=2e-3)
        assert sorted(logprobs.top_logprobs[k].values(), reverse=True) == pytest.approx(
            expected[position - 1].topk(2).values.tolist(), abs=2e-3)
    assert logprobs.text_offset[shown] == len(prompt)  # the completion's first token starts after the prompt
    tokens, values, text = [], [], ""
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert text == choice.text and tokens == logprobs.tokens
    assert values == pytest.approx(logprobs.token_logprobs, abs=1e-6)


def test_several_prompts_in_one_completion_request(server):
    client, prompts = server.client(), ["The capital of France is", "One, two, three,"]
    answer = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2, echo=True)
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts]
    assert texts == [prompts[0] + alone[0]] * 2 + [prompts[1] + alone[1]] * 2
    lengths = [len(post(server, "/tokenize", {"prompt": p}).json()["tokens"]) for p in prompts]
    assert answer.usage.prompt_tokens == sum(lengths)


def test_completion_fields(server):
    client = server.client()
    echoed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       echo=True).choices[0].text
    assert echoed.startswith("The capital of France is Paris")
    ids = post(server, "/tokenize", {"prompt": "The capital of France is"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0).choices[0].text
    assert echoed == "The capital of France is" + by_ids
    for field, value in (("suffix", "!"), ("best_of", 3)):
        answer = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", field: value})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field


# ---- tokenizer endpoints, fingerprint -------------------------------------------------------------------------------

def test_tokenize_detokenize_and_fingerprint(server, oracle):
    tokens = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["tokens"] == oracle.tokenizer.encode("Hello world", bos=True, eos=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert post(server, "/detokenize", {"tokens": [10 ** 9]}).status_code == 400
    first, second = chat(server.client(), max_tokens=2), chat(server.client(), max_tokens=2)
    assert first.system_fingerprint.startswith("fp_") and first.system_fingerprint == second.system_fingerprint


# ---- operating it ---------------------------------------------------------------------------------------------------

def test_health_says_loading_until_the_model_is_ready(server):
    assert (503, "loading", "loading weights") in server.statuses and server.statuses[-1] == (200, "ok", None)


def scrape(server) -> dict:
    """{(sample name, labels): value} of /metrics (which needs no API key)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_exactly_the_requests_made(server):
    client = server.client()
    before = scrape(server)
    answers = [chat(client, max_tokens=5), chat(client, max_tokens=3, n=2, temperature=1.0, seed=1),
               client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)]
    streamed = list(chat(client, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    usages = [a.usage for a in answers] + [streamed[-1].usage]
    after = scrape(server)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    finished = sum(moved("accessory_requests_total", (("finish_reason", r),)) for r in ("stop", "length"))
    assert finished == 4
    assert moved("accessory_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("accessory_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert moved(f"accessory_{histogram}_count") == 4, histogram
    assert moved("accessory_inter_token_latency_seconds_count") == sum(u.completion_tokens for u in usages) - 4
    assert after[("accessory_num_requests_running", ())] == 0 == after[("accessory_kv_cache_usage_perc", ())]
    computed, reused = moved("accessory_prefill_computed_tokens_total"), moved("accessory_prefix_cache_hit_tokens_total")
    assert computed + reused == sum(u.prompt_tokens for u in usages) + usages[1].prompt_tokens  # n=2: two rows
    assert reused > 0  # the same chat prompt, asked again


def test_request_id_comes_back_and_names_the_log_line(server):
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION,
                                                                    "max_tokens": 3, "user": "alice"},
                        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-42"}, timeout=60)
    assert answer.headers["x-request-id"] == "trace-42"
    usage = answer.json()["usage"]
    line = server.log_line("request trace-42:")
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[accessory rank 0\] INFO ", line), line
    assert f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} output tokens" in line
    assert "first token" in line and "user 'alice'" in line
    made = httpx.get(f"{server.url}/health").headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{16}", made)


def test_a_waiting_stream_gets_keep_alive_comments(server):
    client = server.client()
    # 10 tokens keep the 8 rows busy for seconds (a decode step at 3 ranks takes ~0.3 s): keep-alives come each 0.3 s
    long = dict(messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=10)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # they fill the batch's 8 rows
        busy = [pool.submit(chat, client, **long) for _ in range(8)]
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            lines = [line for line in response.iter_lines() if line]
        assert all(future.result().choices for future in busy)
    assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
