"""A compiled engine is ready only when every graph it runs is compiled: after `warm_up` (from_pretrained's
`warmup=True`, and `accessory serve --compile` before /health says ok) no request compiles anything, at one row
or several; the server says "compiling" meanwhile, and its first requests take about what later ones take."""
from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from serving import MODEL, Server
from tiny import CompiledSteps

PROMPTS = ["Hi", "The quick brown fox", "Tensor parallel inference is a way to", "Once upon a time there was"]


def test_after_warm_up_no_request_compiles_a_graph(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    torch._dynamo.reset()
    with CompiledSteps() as warm_up:  # the CPU's packages, compiled or loaded from the cache
        model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=256, compile=True, warmup=True)
    assert warm_up.count > 0
    model.stop_ids = set()
    with CompiledSteps() as requests:
        model.generate(PROMPTS[:1], max_gen_len=40)  # one row, past the warm-up's widths
        model.generate(PROMPTS, max_gen_len=30)  # four rows, ending together
        for _ in model.stream_generate(PROMPTS[:3], max_gen_len=20):  # three, then fewer as they end
            pass
    assert requests.count == 0


def timed_requests(client, prompts: list[str]) -> float:
    """Seconds until every prompt's completion (sent together) has come back."""
    def one(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, prompts))
    return time.perf_counter() - start


@pytest.mark.alone  # compares request times
def test_a_compiled_server_says_compiling_and_its_first_requests_wait_on_nothing(tiny_checkpoints, tmp_path):
    server = Server(tmp_path, "--pretrained_path", str(tiny_checkpoints["mha", 1]), "--compile",
                    "--model-name", MODEL, nproc=1)
    try:
        server.wait_ready()
        assert (503, "loading", "compiling") in server.statuses, server.statuses
        assert "compiled the decode step in" in server.read_log()
        client = server.client()
        first = [timed_requests(client, PROMPTS[:1]), timed_requests(client, PROMPTS)]
        later = [timed_requests(client, PROMPTS[:1]), timed_requests(client, PROMPTS)]
        assert first[0] < 5 * later[0] and first[1] < 5 * later[1], (first, later)
    finally:
        server.stop()


def test_a_step_first_traced_on_two_rows_then_runs_one_row_as_eager_does(tiny_checkpoints):
    """Without a warm-up, the graph first traced at 2 rows (when the KV cache also had 2 rows) runs 1 row, then 4:
    the rows decoded and the cache's rows are separate sizes in the graph (a graph that took them for one failed
    its size check at 1 row)."""
    from accessory.model.meta import MetaModel

    torch._dynamo.reset()
    folder = tiny_checkpoints["gqa", 1]
    compiled = MetaModel.from_pretrained(folder, max_seq_len=256, compile=True, prefix_cache=False)
    eager = MetaModel.from_pretrained(folder, max_seq_len=256, prefix_cache=False)
    for model in (compiled, eager):
        model.stop_ids = set()
    for prompts in (PROMPTS[:2], PROMPTS[:1], PROMPTS):
        assert compiled.generate(prompts, max_gen_len=12) == eager.generate(prompts, max_gen_len=12)


def test_warm_up_refuses_a_model_whose_first_token_is_nan(tiny_checkpoints):
    """Weights that are not finite (here the final norm's) make NaN logits: warm_up (before serving, and batch
    jobs) is a ConfigError naming it, not a server whose every request fails; finite weights warm up as before."""
    from accessory.errors import ConfigError
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=64)
    assert model.warm_up() == 0.0
    with torch.no_grad():
        model.llma.norm.weight.fill_(float("nan"))
    with pytest.raises(ConfigError, match="the model's first token failed: SamplingError: the logits hold NaN; its weights"):
        model.warm_up()
