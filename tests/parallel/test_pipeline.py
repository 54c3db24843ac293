"""Pipeline stages (`--pp`, accessory/parallel/pipeline.py) against one process: greedy tokens, streams and scores of
the built-in model and of tiny random Gemma 3 (sliding windows, a tied head), Qwen3 and Mixtral, at 2 and 3 stages,
even and uneven splits, 2 stages x 2 tensor ranks at 4 ranks, eager and compiled; each rank holding only its stage's
tensors. The memory refusal names what would fit; the plan is what `accessory inspect --pp` prints."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from distributed import free_port, run_ranks
from test_stream_ranks import seed_loop
from tiny import build_tiny_family, greedy_ids, save_lively

GEN_STEPS = 16
FAMILIES = ("gemma3", "qwen3", "mixtral")


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [[1] + torch.randint(10, 32000, (n,), generator=generator).tolist() for n in (5, 40)]


def build_mixtral(folder, tokenizer):
    import transformers

    config = transformers.MixtralConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        max_position_embeddings=256, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    return save_lively(transformers.MixtralForCausalLM(config).eval(), "mixtral", folder, tokenizer)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, llama_tokenizer) -> dict:
    """family -> the folder `accessory convert hf` made of a 4-layer tiny random model of it."""
    from accessory.checkpoint.convert import convert

    root, out = tmp_path_factory.mktemp("pipeline"), {}
    for family in FAMILIES:
        hf = root / f"{family}-hf"
        if family == "mixtral":
            build_mixtral(hf, llama_tokenizer)
        else:
            build_tiny_family(family, hf, llama_tokenizer, num_hidden_layers=4)
        out[family] = str(convert("hf", hf, root / family, shards=2))
    return out


def tokens_and_tensors(folder: str, **options) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of `prompts()`, and the tensor names this rank holds."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=128, **options)
    return greedy_ids(model, prompts(), GEN_STEPS), set(model.llma.state_dict())


def every_family(folders: dict, **options) -> dict:
    return {family: tokens_and_tensors(folder, **options) for family, folder in folders.items()}


@pytest.fixture(scope="module")
def one_process(tiny_models) -> dict:
    return every_family(tiny_models)


def assert_stages_hold_their_part(held: list[set[str]], whole: set[str], stages: list[range]) -> None:
    """Each stage's ranks hold only their layers (and the embedding first, the head last), and together all."""
    assert set().union(*held) == whole
    for names, layers in zip(held, stages):
        indices = {int(name.split(".")[1]) for name in names if name.startswith("layers.")}
        assert indices == set(layers)


@pytest.mark.parametrize("ranks, options, split, pieces", [
    (2, {"pipeline_parallel_size": 2}, [range(0, 2), range(2, 4)], None),
    (3, {"pipeline_parallel_size": 3, "pipeline_layers": "1,2,1"}, [range(0, 1), range(1, 3), range(3, 4)], 16),
    (4, {"pipeline_parallel_size": 2, "pipeline_layers": "3,1"}, [range(0, 3)] * 2 + [range(3, 4)] * 2, 16),
], ids=["pp2", "pp3-uneven-pieces", "pp2-x-tp2-pieces"])
def test_stages_equal_one_process(tiny_models, one_process, ranks, options, split, pieces):
    """`pieces`: the prompts prefilled through the stages in pieces of so many tokens (STAGE_PREFILL_TOKENS), the
    41-token one cut in three, the windowed family's pieces attending across the window into earlier ones."""
    results = run_ranks(ranks, _every_family_with, tiny_models, options, pieces)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        for family in FAMILIES:
            assert result[family][0] == one_process[family][0], f"{family} at rank {rank}"
    for family in FAMILIES:
        whole = one_process[family][1]
        if family == "gemma3":  # tied: one process holds the table once, the last stage a head of its own
            whole = whole | {"output.weight"}
        assert_stages_hold_their_part([result[family][1] for result in results], whole, split)
    assert "tok_embeddings.weight" not in results[-1]["qwen3"][1] and "output.weight" not in results[0]["qwen3"][1]


def _every_family_with(folders: dict, options: dict, pieces: int = None) -> dict:
    if pieces is not None:
        from accessory.generation import model_runner

        model_runner.STAGE_PREFILL_TOKENS = pieces
    return every_family(folders, **options)


def test_prompts_are_packed_into_passes_and_cut_where_a_pass_is_full():
    """`_passes`: spans (start, end) packed in order; a prompt cut where a pass is full goes on first in the next
    (from its `past` on); one with an image starts a pass of its own instead, even past the budget."""
    from accessory.generation.model_runner import _passes

    assert _passes([(0, 6), (0, 41)], 16, set()) == [[(0, 0, 6), (1, 0, 10)], [(1, 10, 26)], [(1, 26, 41)]]
    assert _passes([(3, 10), (0, 9)], 16, set()) == [[(0, 3, 10), (1, 0, 9)]]  # 16 tokens: one full pass
    assert _passes([(0, 10), (0, 30), (0, 4)], 16, {1}) == [[(0, 0, 10)], [(1, 0, 30)], [(2, 0, 4)]]
    assert _passes([(0, 5)], 4096, set()) == [[(0, 0, 5)]]


def test_compiled_stages_equal_one_process(tiny_models, one_process):
    """Each stage's compiled decode step (the sliding-window family: rings in the graph)."""
    results = run_ranks(2, _every_family_with, {"gemma3": tiny_models["gemma3"]},
                        {"pipeline_parallel_size": 2, "compile": True})
    for result in results:
        assert not isinstance(result, Exception), result.rank_traceback
        assert result["gemma3"][0] == one_process["gemma3"][0]


def smollm2_at_stages(checkpoint, **options) -> dict:
    """The built-in model's greedy answer, the seed's break-on-separator stream, and scores, as each rank sees them."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(str(checkpoint), max_seq_len=512, **options)
    texts = model.generate(["The capital of France is", "def fib(n):"], max_gen_len=24)
    events = [event["text"] for event in model.stream_generate("Name three colors:", max_gen_len=24)]
    scores = model.evaluate_examples(["The sky is blue."])["log_likelihood"]
    return {"texts": texts, "events": events, "seed loop": seed_loop(model), "scores": scores, **in_lanes(model),
            "point to point": model.ctx.star}


LANE_PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,", "The moon is",
                "The capital of France is"]


def in_lanes(model) -> dict:
    """What micro-batches in flight (a lane of rows per stage) must leave as one process has it: several prompts,
    greedy and sampled; more requests than rows (continuous batching across lanes, a prompt repeated for the
    prefix cache) with log-probabilities; a stream of several prompts left early on every rank, then the next call."""
    from accessory.generation.requests import Request
    from accessory.generation.sampling import SamplingParams

    greedy = model.generate(LANE_PROMPTS, max_gen_len=16)
    sampled = model.generate(LANE_PROMPTS[:4], max_gen_len=16, temperature=0.8, seed=5)
    engine = model.engine.configured(max_batch_size=3)
    params = [SamplingParams(6 + 3 * i, prompt_logprobs=2 if i == 1 else None, logprobs=1 if i == 2 else None,
                             temperature=0.7 if i == 3 else 0.0) for i in range(len(LANE_PROMPTS))]
    requests = [Request(i, model.tokenizer.encode(prompt, True, False), params[i], seed=i)
                for i, prompt in enumerate(LANE_PROMPTS)]
    ended, logprobs = {}, {}
    for events in engine.stream(requests):
        for event in events:
            logprobs.setdefault(event.id, []).extend((p.token, p.logprob) for p in
                                                     event.logprobs + (event.prompt_logprobs or ()))
            if event.end_of_content:
                ended[event.id] = (event.text, event.finish_reason)
    left = []
    for events in model.stream_generate(LANE_PROMPTS[:4], max_gen_len=32):
        left.append([event.text for event in events])
        if len(left) == 5:
            break
    return {"greedy": greedy, "sampled": sampled, "queued": ended, "logprobs": logprobs, "left early": left,
            "after": model.generate(LANE_PROMPTS[2:3], max_gen_len=16)}


@pytest.fixture(scope="module")
def smollm2_alone(smollm2_checkpoint) -> dict:
    return smollm2_at_stages(smollm2_checkpoint)


@pytest.mark.parametrize("ranks, options", [
    (2, {"pipeline_parallel_size": 2, "transport": "gloo"}),  # point to point, as across machines: headers sent ahead
    (3, {"pipeline_parallel_size": 3, "pipeline_layers": "12,8,10"}),  # shared memory
], ids=["pp2-gloo", "pp3-uneven"])
def test_builtin_model_streams_equal_on_every_rank(smollm2_checkpoint, smollm2_alone, ranks, options):
    results = run_ranks(ranks, _smollm2_with, smollm2_checkpoint, options)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        for key in ("texts", "events", "seed loop", "greedy", "sampled", "queued", "after"):
            assert result[key] == smollm2_alone[key], f"{key} at rank {rank}"
        # lanes advance on alternate steps, so the stream's chunks differ from one process's; not its text
        assert result["left early"] == results[0]["left early"]
        assert all(greedy.startswith(text) for text, greedy in zip(result["left early"][-1], result["greedy"]))
        assert result["scores"] == pytest.approx(smollm2_alone["scores"], abs=1e-3)
        for request, expected in smollm2_alone["logprobs"].items():
            got = result["logprobs"][request]
            assert [token for token, _ in got] == [token for token, _ in expected]
            assert [p for _, p in got] == pytest.approx([p for _, p in expected], abs=2e-2)
    assert "Paris" in results[0]["texts"][0]
    assert results[0]["point to point"] == (options.get("transport") == "gloo")


def _smollm2_with(checkpoint, options: dict) -> dict:
    from accessory.parallel.shared_memory import TRANSPORT_VARIABLE

    options = dict(options)
    os.environ[TRANSPORT_VARIABLE] = options.pop("transport", "auto")
    return smollm2_at_stages(checkpoint, **options)


def refused(folder: str, **options) -> str:
    from accessory.errors import ConfigError
    from accessory.model.meta import MetaModel

    try:
        MetaModel.from_pretrained(folder, max_seq_len=128, **options)
    except ConfigError as e:
        return str(e)
    return "loaded"


def test_a_model_too_big_for_a_rank_is_refused_naming_the_stages_that_fit(smollm2_checkpoint, monkeypatch):
    """A budget a bit above half the built-in model's float weights: one process is refused before loading, naming
    --pp 2; two stages load under the same budget each."""
    from accessory.network.memory import BUDGET_ENV

    monkeypatch.setenv(BUDGET_ENV, str(330 << 20))  # the float model: ~540 MB
    message = refused(str(smollm2_checkpoint))
    assert "needs 0.5 GiB" in message and "only 0.3 GiB is available" in message
    assert "--pp 2 (pipeline stages, 2 ranks" in message
    assert run_ranks(2, refused_at_two_stages, str(smollm2_checkpoint)) == ["loaded", "loaded"]


def refused_at_two_stages(folder: str) -> str:
    return refused(folder, pipeline_parallel_size=2)


# ---- two machines: network namespaces joined by a veth pair (root) ------------------------------------------------

NAMESPACES, ADDRESSES = ("acc-pp0", "acc-pp1"), ("10.214.0.1", "10.214.0.2")
LINK_TIMEOUT_S = 6


@pytest.fixture
def two_machines():
    """Two network namespaces joined by a veth pair (veth0 in the first, veth1 in the second); removed after."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    for namespace in NAMESPACES:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        run("ip", "netns", "add", namespace)
    try:
        run("ip", "link", "add", "veth0", "netns", NAMESPACES[0], "type", "veth", "peer", "name", "veth1", "netns",
            NAMESPACES[1])
        for node, namespace in enumerate(NAMESPACES):
            run("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{ADDRESSES[node]}/24", "dev", f"veth{node}")
            run("ip", "netns", "exec", namespace, "ip", "link", "set", f"veth{node}", "up")
            run("ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield NAMESPACES
    finally:
        for namespace in NAMESPACES:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def test_a_dropped_link_between_stages_ends_every_rank_naming_the_lost_one(two_machines, smollm2_checkpoint,
                                                                           tmp_path):
    """`--pp 2` with a stage in each namespace; `ip link set veth0 down` mid-generation: both machines' ranks end
    within --rank-timeout + 10 s, the first machine's naming the second's stage; nothing hangs. (The namespaces share
    a host name, so the first machine's watchdog also kills the second's rank, as it would a frozen rank on its own
    machine; on two real machines the second's watchdog ends it, the store being out of its reach.)"""
    port, procs, logs = free_port(), [], []
    for node, namespace in enumerate(two_machines):
        logs.append(tmp_path / f"node{node}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                 f"--node-rank={node}", "--nproc-per-node=1", f"--master-addr={ADDRESSES[0]}",
                 f"--master-port={port}", "-m", "accessory", "generate", "--pretrained_path", str(smollm2_checkpoint),
                 "--prompt", "Tell a story.", "--max_gen_len", "3000", "--max_seq_len", "4096", "--pp", "2",
                 "--rank-timeout", str(LINK_TIMEOUT_S)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=f"veth{node}")))
    try:
        deadline = time.time() + 120
        while "loaded" not in logs[0].read_text() and time.time() < deadline:
            assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
            time.sleep(0.5)
        time.sleep(2)  # decoding
        subprocess.run(["ip", "netns", "exec", two_machines[0], "ip", "link", "set", "veth0", "down"], check=True)
        dropped = time.time()
        for proc in procs:
            proc.wait(timeout=LINK_TIMEOUT_S + 10 - (time.time() - dropped) + 1)
        assert all(proc.returncode != 0 for proc in procs)
        assert "rank 1 (pipeline stage 1 of 2, layers 15-29, tensor rank 0) has not answered" in \
            logs[0].read_text(), logs[0].read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/sys/fs/cgroup/memory/cgroup.procs").exists(),
                    reason="needs root and cgroup v1's memory controller")
def test_two_stages_fit_where_one_process_is_refused_each_rank_in_its_own_cgroup(tmp_path, smollm2_checkpoint):
    """benchmarks/memory.py at 2 ranks: each rank limited to an idle rank's RSS + 0.6 x the weights, through a
    memory cgroup of its own; one process under that limit is refused naming the limit's file and --pp 2, and the
    two stages generate one unlimited process's text."""
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory.py"), "--ranks", "2", "--max-gen-len",
                           "12", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    refused = results["refused_alone"]
    assert refused["exit"] == 2
    assert "accessory-memory-0/memory.limit_in_bytes); --quant int8 (" in refused["message"]
    assert "would fit; --pp 2 (pipeline stages" in refused["message"]
    alone, staged = results["runs"]
    assert staged["exit"] == 0 and staged["same_text"], staged
    assert max(staged["anonymous_rss_by_rank"]) < results["limit_bytes"] < alone["anonymous_rss_by_rank"][0]


def test_the_server_answers_at_two_stages_as_one_process(tmp_path, smollm2_alone):
    """`accessory serve --pp 2` under torchrun: a chat completion and a streamed completion give the text the
    built-in model gives alone."""
    import httpx

    from serving import KEY, MODEL, Server

    server = Server(tmp_path, "--pp", "2", nproc=2)
    try:
        server.wait_ready()
        headers = {"Authorization": f"Bearer {KEY}"}
        answer = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=120, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == smollm2_alone["texts"][0]
        chat = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0})
        assert chat.status_code == 200 and "Paris" in chat.json()["choices"][0]["message"]["content"], chat.text
    finally:
        server.stop()
