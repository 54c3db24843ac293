"""What a hostile probe of the server found (issue 20), each refused by name or fixed, against the app over a
service in this process: grammar-engine refusals and constraints that admit no output are 400s naming the field
(whole or streamed), /tokenize is held to the prompt's limit, runs off the event loop and gives its memory back,
a body that is not UTF-8 is a 400, a 413 names the limit applied, a bad logit_bias names its field, and a group that
fails mid-stream says how many tokens were sent, without this machine's file paths."""
from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

NESTED_FOREVER = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                  "$ref": "#/$defs/n"}
ITSELF = {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}
TOO_MANY_BRANCHES = {"anyOf": [{"type": "object", "properties": {f"k{j}": {"type": "integer"} for j in range(11)},
                                "required": [f"k{j}" for j in range(11)]} for _ in range(2000)]}
LATE = {"$defs": NESTED_FOREVER["$defs"], "type": "object",  # decoding reaches the fields that nest forever
        "properties": {"a": {"enum": ["x", "y"]}, "n": {"$ref": "#/$defs/n"}}, "required": ["a", "n"]}
NO_EOS = {"2": -100}  # the tiny model's random weights may end early: they must not, for the streams below


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=128)


@pytest.fixture(scope="module")
def api(tiny):
    """The app with its default limits over a running service on the tiny model."""
    from starlette.testclient import TestClient

    from accessory.serve.api import create_app
    from accessory.serve.service import GenerationService

    service = GenerationService(tiny, heartbeat_s=0.2)
    runner = threading.Thread(target=service.run, daemon=True)
    runner.start()
    with TestClient(create_app(service, "tiny")) as client:
        yield client
    service.shutdown()
    runner.join(timeout=30)


def completion(client, **fields):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 8, **fields})


def refused(answer, param: str, status: int = 400) -> str:
    """The message of an OpenAI-shaped refusal naming `param`."""
    error = answer.json()["error"]
    assert answer.status_code == status and error["param"] == param, answer.text
    assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{param}: "), error
    return error["message"]


def sse_lines(client, body: dict) -> list[str]:
    with client.stream("POST", "/v1/completions", json=body) as streamed:
        return [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]


def test_an_empty_assistant_message_alone_is_a_400_naming_messages(api):
    """Was a 500 (an IndexError once the empty turn was dropped), found by tests/serve/test_fuzz.py's schemathesis."""
    answer = api.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                    "messages": [{"role": "assistant", "content": ""}]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"] == "messages: an empty assistant message alone leaves nothing to reply to"


# ---- structured output ---------------------------------------------------------------------------------------------

def test_grammar_engine_refusals_are_400s_naming_the_field(api):
    """These were 500s ("Too many items (limit 50000)") or 200s with "" and finish_reason "stop"."""
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": NESTED_FOREVER}}
    assert "gave up" in refused(completion(api, response_format=schema), "response_format")
    assert "schema too large" in refused(completion(api, guided_json=TOO_MANY_BRANCHES), "guided_json")
    assert "admits no output" in refused(completion(api, guided_json=ITSELF), "guided_json")
    assert "admits no output" in refused(completion(api, guided_regex=r"[^\x00-\x{10FFFF}]"), "guided_regex")
    assert completion(api, guided_regex="[0-9]{3}").json()["choices"][0]["finish_reason"] == "stop"


def test_a_grammar_given_up_on_while_decoding_is_a_400_or_a_streamed_error_naming_the_field(api):
    late = {"type": "json_schema", "json_schema": {"name": "late", "schema": LATE}}
    message = refused(completion(api, response_format=late, max_tokens=40), "response_format")
    assert "gave up on the json_schema constraint past its first" in message
    lines = sse_lines(api, {"model": "tiny", "prompt": "Hi", "max_tokens": 40, "stream": True, "response_format": late})
    error = json.loads(lines[-2])["error"]
    assert lines[-1] == "[DONE]" and (error["param"], error["type"]) == ("response_format", "invalid_request_error")


def test_a_control_tokens_text_as_a_pattern_is_refused_where_output_cannot_write_it(smollm2_api):
    """ChatML's <|im_end|> is a control token: llguidance offered only it, so the output was "" and "stop"."""
    client, _ = smollm2_api
    answer = client.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 8,
                                                  "guided_regex": r"<\|im_end\|>"})
    assert "a special token's text" in refused(answer, "guided_regex")


# ---- /tokenize -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_api(smollm2_checkpoint):
    """The app over a service (not running: /tokenize needs no step) on the built-in model, whose HF tokenizer held
    the GIL while it encoded."""
    from starlette.testclient import TestClient

    from accessory.model.meta import MetaModel
    from accessory.serve.api import create_app
    from accessory.serve.service import GenerationService

    service = GenerationService(MetaModel.from_pretrained(smollm2_checkpoint, max_seq_len=256))
    with TestClient(create_app(service, "smol")) as client:
        yield client, service


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2 ** 20


def test_tokenize_is_held_to_the_prompts_limit_without_tokenizing(api, tiny, monkeypatch):
    """A 6.9M-character prompt was tokenized whole (8 s, with /health waiting)."""
    monkeypatch.setattr(tiny.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    error = api.post("/tokenize", json={"prompt": "ab" * 500_000}).json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded") and "max_seq_len is 128" in \
        error["message"]


@pytest.mark.alone  # times /health's answers
def test_tokenize_lets_health_answer_and_gives_its_memory_back(smollm2_api, monkeypatch):
    """A text as long as the limit allows (here raised to 3M characters) is tokenized in a worker thread that lets go
    of the GIL, and the megabytes it freed go back to the system (they stayed with glibc: +660 MB for 7M)."""
    client, service = smollm2_api
    monkeypatch.setattr(service, "columns", 3_000_000 // service.model.tokenizer.max_token_chars + 1)
    text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * (3_000_000 // 57)
    assert client.post("/tokenize", json={"prompt": text[:100_001]}).status_code == 200  # the allocator warmed up
    before, answers, waits = rss_mb(), [], []

    def tokenize():
        answers.append(client.post("/tokenize", json={"prompt": text}))

    worker = threading.Thread(target=tokenize)
    worker.start()
    while worker.is_alive():
        asked = time.monotonic()
        assert client.get("/health").status_code == 200
        waits.append(time.monotonic() - asked)
        time.sleep(0.05)
    worker.join()
    assert answers[0].status_code == 200 and b'"count":' in answers[0].content
    answers.clear()
    assert len(waits) > 3 and max(waits) < 1.0, waits  # the GIL held: one wait as long as the whole tokenizing
    assert rss_mb() - before < 100


# ---- the body ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_body_that_is_not_utf8_is_a_400(api, encoding):
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode(encoding)
    answer = api.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "not UTF-8" in answer.json()["error"]["message"], answer.text
    assert completion(api).status_code == 200


def declared(server, length: int) -> tuple[int, dict]:
    """(status, body) of the answer to a POST that declares a body of `length` bytes and sends none."""
    from serving import KEY

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        for name, value in (("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
                            ("Content-Length", str(length))):
            connection.putheader(name, value)
        connection.endheaders()
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_a_413_names_the_limit_applied_to_a_text_model(server):
    """`accessory serve` gave a text model the room of one image too (36 MB), while its 413 blamed 8 MB."""
    status, body = declared(server, 8_000_001)
    message = body["error"]["message"]
    assert status == 413 and "over 8000000 bytes" in message and "for a model that reads text" in message


def test_a_logit_bias_for_a_token_the_model_lacks_names_the_field(api):
    assert "not a token id" in refused(completion(api, logit_bias={"99999999": 1}), "logit_bias")


# ---- a failing group -----------------------------------------------------------------------------------------------

def test_a_group_failing_mid_stream_counts_the_tokens_sent_and_shows_no_paths(tiny, monkeypatch):
    """What a killed rank looked like to a client: "after 0 token(s)" once 27 chunks had come, and gloo's source
    path. Here the step fails with gloo's message once the stream has had some chunks."""
    from starlette.testclient import TestClient

    from accessory.generation.scheduler import Scheduler
    from accessory.serve.api import create_app
    from accessory.serve.service import GenerationService

    service, broken = GenerationService(tiny, heartbeat_s=0.2), threading.Event()
    step = Scheduler.step

    def failing_step(self, logits, proposals=()):
        if broken.is_set():
            raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                               "peer [127.0.0.1]:29500")
        return step(self, logits, proposals)

    monkeypatch.setattr(Scheduler, "step", failing_step)
    runner = threading.Thread(target=lambda: pytest.raises(RuntimeError, service.run), daemon=True)
    runner.start()
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 60, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    chunks = []
    with TestClient(create_app(service, "tiny")) as client:
        with client.stream("POST", "/v1/completions", json=body) as streamed:
            for line in streamed.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                if len(chunks) == 5:
                    broken.set()
    runner.join(timeout=30)
    message = json.loads(chunks[-2])["error"]["message"]
    sent = int(message.split("after ")[1].split(" token")[0])
    assert chunks[-1] == "[DONE]" and sent >= 5, message
    assert "Connection closed by peer" in message and "/pytorch" not in message and "pair.cc" not in message
    assert service.health() == (False, {"status": "failed", "running": 0, "waiting": 0,
                                        "error": message.split(f"after {sent} token(s): ")[1]})
