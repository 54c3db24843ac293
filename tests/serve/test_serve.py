"""`accessory serve` as users run it: the default model at 3 ranks under torchrun (the conftest's shared `server`),
driven by the official `openai` client. Chat and completions, streamed and not; stop strings; seeds; the API key; bad input answered with errors
while the server keeps serving; a client that disconnects mid-stream; 8 concurrent streams each equal to the same
request alone; and SIGTERM, after which every rank exits 0."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import openai
import pytest

from serving import KEY, MODEL, QUESTION, chat, streamed_text

# ---- the four ways to ask ----------------------------------------------------------------------------------------

def test_models_lists_the_served_model(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]


def test_chat_answers_and_counts_tokens(server):
    reply = chat(server.client(), max_tokens=32)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens > 10 and 0 < reply.usage.completion_tokens <= 32
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streamed_equals_chat_whole(server):
    client = server.client()
    whole = chat(client, max_tokens=32).choices[0].message.content
    text, pieces, finish = streamed_text(chat(client, max_tokens=32, stream=True))
    assert text == whole and len(pieces) > 3 and finish == "stop"
    assert "<|im_end|>" not in text


def test_completion_whole_and_streamed_with_usage(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert whole.choices[0].text.startswith(" Paris") and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_strings_cut_the_text_streamed_or_not(server):
    client = server.client()
    reply = chat(client, max_tokens=32, stop=["Paris"])
    assert reply.choices[0].message.content == "The capital of France is "
    assert reply.choices[0].finish_reason == "stop"
    text, pieces, _ = streamed_text(chat(client, max_tokens=32, stop=["Paris"], stream=True))
    assert text == "The capital of France is " and not any("Par" in piece for piece in pieces)


def test_seed_makes_sampling_reproducible(server):
    client = server.client()
    ask = dict(messages=[{"role": "user", "content": "Write a sentence about a dragon."}], max_tokens=6,
               temperature=1.0, top_p=1.0)
    first = chat(client, seed=7, **ask).choices[0].message.content
    assert chat(client, seed=7, **ask).choices[0].message.content == first
    assert chat(client, seed=8, **ask).choices[0].message.content != first


# ---- refusals ------------------------------------------------------------------------------------------------------

def test_api_key_is_required_except_for_health(server):
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong-key").models.list()
    bare = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("body,status,param", [
    ({"messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ({"messages": QUESTION, "top_p": 1.5}, 400, "top_p"),
    ({"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": QUESTION, "n": 9}, 400, "n"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [*QUESTION, {"role": "system", "content": "hi"}]}, 400, None),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, None),
    ({"messages": QUESTION, "max_tokens": 500}, 400, None),
    ({"messages": QUESTION, "model": "gpt-4"}, 404, "model"),
], ids=["wrong-type", "out-of-range", "zero-tokens", "n", "bad-role", "no-messages", "system-last",
        "prompt-too-long", "prompt-plus-max-tokens-too-long", "unknown-model"])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    body = {"model": MODEL, **body}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"] and (param is None or error["param"] == param), error
    assert "Paris" in chat(server.client(), max_tokens=6).choices[0].message.content  # "Paris" is its 6th token


def test_malformed_json_and_the_openai_client_errors(server):
    answer = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "x", "prompt": ',
                        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert answer.status_code == 400 and "error" in answer.json()
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        server.client().completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    assert server.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                              temperature=0).choices[0].text.startswith(" Paris")


# ---- the batch -----------------------------------------------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_frees_its_row(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        received = []
        for line in response.iter_lines():  # two chunks of text (keep-alive comments between them are skipped)
            received += [line] if line.startswith("data:") else []
            if len(received) == 2:
                break
    assert len(received) == 2 and server.health()["running"] <= 1
    deadline = time.time() + 20  # 400 tokens would take far longer than this if the row kept decoding
    while server.health()["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert server.health()["running"] == 0
    assert "Paris" in chat(server.client(), max_tokens=32).choices[0].message.content


def test_eight_concurrent_streams_each_get_their_own_text(server):
    client = server.client()
    topics = ["France", "Italy", "Japan", "Egypt", "Canada", "Brazil", "Kenya", "Norway"]
    asks = [[{"role": "user", "content": f"Tell me one fact about {topic}."}] for topic in topics]
    # 5 tokens tell the 8 answers apart (each a decode step at 3 ranks: about 0.3 s alone on 2 cores)
    alone = [chat(client, messages, max_tokens=5).choices[0].message.content for messages in asks]

    def stream(messages):
        return streamed_text(chat(client, messages, max_tokens=5, stream=True))[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(stream, asks))
    assert together == alone
    assert len(set(alone)) == 8


# ---- shutting down (last: it ends the server; conftest runs it after every module that uses the server) ------------

def test_sigterm_finishes_the_running_request_and_every_rank_exits_0(server):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 32, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        workers = server.workers()
        assert len(workers) == 3
        for pid in workers:  # as torchrun does when it is told to stop
            os.kill(pid, signal.SIGTERM)
        draining = httpx.get(f"{server.url}/health", timeout=10)  # a load balancer stops sending requests here
        assert draining.status_code == 503 and draining.json()["status"] == "draining", draining.text
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert refused.status_code == 503
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content", "")
                   for line in [first, *rest[:-1]] if json.loads(line[5:])["choices"])
    assert "Paris" in text
    assert server.proc.wait(timeout=60) == 0, server.read_log()
    assert "generation service stopped" in server.read_log()
