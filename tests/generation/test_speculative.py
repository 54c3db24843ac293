"""Speculative decoding (n-gram prompt lookup, a draft model, the model as its own int4 draft) gives plain decoding's
output token for token, greedy or sampled with a seed, with what a request asks for (stop strings, log-probs,
structured output, the prefix cache) unchanged; at 1 and 3 ranks; and, over many seeds on a tiny model, the same
token distribution as plain sampling (a two-sample chi-square test)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from distributed import run_ranks
from tiny import greedy_ids

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick "
        "daft zebras jump! Sphinx of black quartz, judge my vow.")
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SELF_INT4 = {"model": "self", "quant": "int4", "num_speculative_tokens": 4}


# ---- the parts, by hand ------------------------------------------------------------------------------------------

def test_ngram_lookup_proposes_what_followed_the_longest_match_latest_among_equals():
    from accessory.generation.speculative import NgramProposer, SpeculativeConfig

    lookup = NgramProposer(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=1)).lookup
    # the end [7, 8, 9] occurs at 0..2 (3 tokens match) and [8, 9] at 5..6 (2): the longest wins
    assert lookup([7, 8, 9, 1, 2, 8, 9, 3, 7, 8, 9], 3) == (1, 2, 8)
    # [5] alone, twice: the latest occurrence; and no more tokens than follow it
    assert lookup([5, 1, 5, 2, 5], 4) == (2, 5)
    assert lookup([1, 2, 3], 4) == ()  # the last token never occurred before
    strict = NgramProposer(SpeculativeConfig(prompt_lookup_max=4, prompt_lookup_min=2)).lookup
    assert strict([5, 1, 6, 5], 2) == ()  # one token matches, two are needed
    assert strict([6, 5, 1, 6, 5], 2) == (1, 6)


def test_a_row_proposes_the_count_that_pays_most_and_only_probes_where_none_pays():
    from accessory.generation.speculative import PROBE_EVERY, RowBudget, best_size

    # tokens expected per cost, hand-computed: at rate 0.5, k = 0..3 give 1/1, 1.5/1.1, 1.75/1.2, 1.875/1.3
    # (1, 1.36, 1.46, 1.44): two; at 0.9, 2.71/1.2 = 2.26 < 3.44/1.3 = 2.65: three
    assert best_size(0.5, (1.0, 1.1, 1.2, 1.3)) == 2
    assert best_size(0.9, (1.0, 1.1, 1.2, 1.3)) == 3
    assert best_size(0.1, (1.0, 1.2, 1.4)) == 0  # 1.1 / 1.2 < 1: plain decoding pays most
    assert best_size(0.99, (1.0, 2.5, 4.0)) == 0  # steps dearer than the tokens they add

    budget = RowBudget((1.0, 1.3, 1.5, 1.7))
    assert budget.rate == 0.5 and budget.next() == 2  # the even prior: 1.75 / 1.5 = 1.17 beats 1.15 and 1.10
    budget.observe(2, 2)  # both kept: rate (0.8 + 2) / (0.8 + 2 + 0.8)
    assert budget.rate == pytest.approx(2.8 / 3.6) and budget.next() == 3
    sizes = []
    for _ in range(4):  # each step kept none of three
        budget.observe(3, 0)
        sizes.append(best_size(budget.rate, budget.costs))
    assert sizes == [2, 1, 1, 0]  # fewer as the rate falls (0.58, 0.44, 0.33, 0.26), then none
    assert [budget.next() for _ in range(PROBE_EVERY + 1)] == [0] * (PROBE_EVERY - 1) + [1, 0]  # one probe

    budget = RowBudget((1.0, 1.6, 2.0))  # at the even prior nothing pays (1.5 / 1.6): a new row probes at once
    assert [budget.next() for _ in range(PROBE_EVERY + 1)] == [1] + [0] * (PROBE_EVERY - 1) + [1]
    budget.observe(1, 1)  # rate 1.8 / 2.6: 2.17 / 2.0 pays most
    assert budget.next() == 2


@pytest.mark.parametrize("values,message", [
    ({"method": "eagle"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min (5) must be at most"),
    ({"method": "draft_model"}, 'needs "model"'),
    ({"method": "ngram", "quant": "int4"}, "draft model's format"),
    ({"method": "ngram", "lookahead": 3}, "unknown key(s) ['lookahead']"),
])
def test_a_config_vllm_would_refuse_is_refused_by_name(values, message):
    from accessory.errors import ConfigError
    from accessory.generation.speculative import SpeculativeConfig

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SpeculativeConfig.from_dict(values)
    assert SpeculativeConfig.from_dict({"model": "self"}).method == "draft_model"  # as vLLM infers it


# ---- the built-in model, one process -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_checkpoint):
    """The built-in model (float32), and beside it the same weights with n-gram speculation, and with the model
    itself in int4 as the draft."""
    from accessory.model.meta import MetaModel

    plain = MetaModel.from_pretrained(smollm2_checkpoint, max_seq_len=512, max_batch_size=4)
    drafted = MetaModel.from_pretrained(smollm2_checkpoint, max_seq_len=512, max_batch_size=4,
                                        speculative_config=SELF_INT4)
    return {"plain": plain, "ngram": speculating(plain, NGRAM), "self-int4": drafted}


def speculating(model, config: dict, draft=None):
    """`model`'s weights with speculative decoding configured (a MetaModel of its own, sharing them)."""
    from dataclasses import replace

    from accessory.generation.speculative import SpeculativeConfig
    from accessory.model.meta import MetaModel

    settings = replace(model.engine.settings, speculative=SpeculativeConfig.from_dict(config))
    return MetaModel(model.llma, model.tokenizer, model.llama_type, settings, draft)


def fixed_costs(*models):
    """Give each model's engine fixed speculation costs (a step proposing k tokens costs 1 + k / 10 plain ones), so
    that its rows propose the same in every run: measured costs vary from run to run, and with them the counts of
    proposed and accepted tokens (never the tokens)."""
    for model in models:
        most = model.engine.settings.speculative.num_speculative_tokens
        model.engine.speculation.step_costs = tuple(1.0 + k / 10 for k in range(most + 1))
    return models


def prompts_of(model) -> list[str]:
    """A copy task (proposals mostly accepted), a chat question (mostly not) and a plain continuation."""
    chat = lambda text: model.tokenizer.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    return [chat("Repeat this text exactly:\n" + TEXT), chat("What is the capital of France? Answer in a sentence."),
            "Once upon a time"]


@pytest.mark.parametrize("method", ["ngram", "self-int4"])
def test_greedy_output_is_plain_decodings_token_for_token(smol, method, monkeypatch):
    plain, model = smol["plain"], smol[method]
    if method == "self-int4":  # the target's own weights as the draft take its keys and values: never a prefill,
        # and never a pass of several tokens to catch up (only the target's next token is fed, then each proposal)
        monkeypatch.setattr(model.engine.draft_model, "prefill", lambda *_: pytest.fail("the self-draft prefilled"))
        monkeypatch.setattr(model.engine.speculation.draft, "verify_step",
                            lambda *_: pytest.fail("the self-draft caught up"))
    tokens = [model.tokenizer.encode(p, bos=True, eos=False) for p in prompts_of(model)]
    expected, stats = greedy_ids(plain, tokens, 40), []
    assert greedy_ids(model, tokens, 40, stats=stats) == expected  # batched: rows that accept and rows that do not
    assert 0 < stats[0].accepted_tokens <= stats[0].proposed_tokens, stats
    if method == "ngram":  # (the int4 draft agrees with float32 on all of these: the tiny draft below does not)
        assert stats[0].accepted_tokens < stats[0].proposed_tokens, stats
    assert [greedy_ids(model, [row], 40)[0] for row in tokens] == expected  # and each row alone


def test_a_model_drafting_for_itself_in_its_own_format_is_refused_by_name(smollm2_checkpoint):
    from accessory.errors import ConfigError
    from accessory.model.meta import MetaModel

    with pytest.raises(ConfigError, match="held in int4 already"):
        MetaModel.from_pretrained(smollm2_checkpoint, quant="int4", speculative_config=SELF_INT4)


def test_the_int4_draft_multiplies_with_x_in_int8(smol):
    """Where the kernels have it (AVX-512 VNNI or AVX2), each int4 product of the draft (a fused projection, or a lone
    weight; not the fused layers' own views) holds the int8-x kernel's copy of its weight, unsaved, which changes the
    compiled step's package key; its few-row products are within x's int8 rounding of the exact ones, prefill's
    exact. The greedy test above runs these products and gives plain decoding's tokens."""
    from accessory.generation.package_key import model_key
    from accessory.kernels.build import int8x_kernels
    from accessory.kernels.dispatch import INT8X_MAX_ROWS
    from accessory.parallel.layers import FusedColumns, repack_int4_for_int8x
    from accessory.parallel.quantized_weight import INT8X_PARTS
    from accessory.quant.formats import dequantize

    if not int8x_kernels():
        pytest.skip("the CPU kernels here have no int8-x product (neither AVX-512 VNNI nor AVX2)")
    draft = smol["self-int4"].engine.draft_model
    fused = {id(layer.weight) for m in draft.modules() if isinstance(m, FusedColumns) for layer in m.layers}
    int4 = [m for m in draft.modules() if getattr(m, "fmt", None) == "int4" and id(m) not in fused]
    assert int4 and all(hasattr(m, INT8X_PARTS[0]) for m in int4)
    assert not any(hasattr(m, INT8X_PARTS[0]) for m in draft.modules() if id(m) in fused)
    assert not any(name.endswith(INT8X_PARTS) for name in draft.state_dict())
    w13 = draft.layers[0].feed_forward.w13
    x = torch.randn(INT8X_MAX_ROWS + 1, w13.q.shape[1] * 2, generator=torch.Generator().manual_seed(0))
    exact = x @ dequantize({"q": w13.q, "scale": w13.scale, "min": w13.min}, "int4").T
    for rows in (1, INT8X_MAX_ROWS, INT8X_MAX_ROWS + 1):  # the last: the exact path
        error = (torch.cat(w13(x[:rows]), dim=-1) - exact[:rows]).abs().max() / exact.abs().max()
        assert 1e-4 < error <= 2e-2 if rows <= INT8X_MAX_ROWS else error <= 1e-5, (rows, error)
    before = model_key(draft)
    try:
        for m in int4:
            for name in INT8X_PARTS:
                delattr(m, name)
        assert model_key(draft) != before
    finally:
        repack_int4_for_int8x(draft)
    assert model_key(draft) == before


@pytest.mark.parametrize("method", ["ngram", "self-int4"])
def test_sampled_output_with_a_seed_is_plain_samplings(smol, method):
    plain, model = smol["plain"], smol[method]
    sampling = dict(max_gen_len=40, temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1)
    expected = plain.generate(prompts_of(plain), seed=11, **sampling)
    assert model.generate(prompts_of(model), seed=11, **sampling) == expected
    assert model.generate(prompts_of(model), seed=12, **sampling) != expected


def finals(model, submit) -> list:
    """The last event of each request `submit(service)` queues on a GenerationService of `model`, and the
    log-probs of all its events."""
    from accessory.serve.service import GenerationService

    service = GenerationService(model)
    handles = submit(service)
    service.shutdown()
    service.run()
    events = [list(handle) for handle in handles]
    return [([e for e in each if e.end_of_content][0], [lp for e in each for lp in e.logprobs]) for each in events]


@pytest.mark.parametrize("method", ["ngram", "self-int4"])
def test_stop_strings_logprobs_structured_output_and_the_prefix_cache_work_as_without_it(smol, method):
    from accessory.generation.constraints import Constraint

    copy = prompts_of(smol["plain"])[0]

    def submit(service):
        tokens = service.encode(copy)
        return [service.submit_tokens(tokens, {"max_gen_len": 40, "logprobs": 2}, stop=["zebras"]),
                service.submit_tokens(tokens, {"max_gen_len": 40, "temperature": 0.8, "seed": 3},
                                      constraint=Constraint("regex", r"The quick [a-z]+ fox( [a-z]+)*\.")),
                service.submit_tokens(tokens, {"max_gen_len": 7})]  # reuses the others' prompt from the cache

    (plain, lp_plain), (fast, lp_fast) = zip(*finals(smol["plain"], submit)), zip(*finals(smol[method], submit))
    assert plain[0].text.endswith("daft ") and plain[0].finish_reason == "stop"
    assert plain[1].text.startswith("The quick") and plain[2].finish_reason == "length"
    for a, b in zip(plain, fast):
        assert (b.text, b.finish_reason, b.completion_tokens) == (a.text, a.finish_reason, a.completion_tokens)
    lp_plain, lp_fast = lp_plain[0], lp_fast[0]
    assert [t.token for t in lp_fast] == [t.token for t in lp_plain] and len(lp_plain) == plain[0].completion_tokens
    assert max(abs(x.logprob - y.logprob) for x, y in zip(lp_plain, lp_fast)) < 1e-3
    assert smol[method].engine.stats.reused_tokens > 0


def test_max_gen_len_is_exact_when_proposals_reach_past_it(smol):
    tokens = [smol["ngram"].tokenizer.encode(prompts_of(smol["plain"])[0], bos=True, eos=False)]
    for steps in (1, 2, 3, 9):
        assert greedy_ids(smol["ngram"], tokens, steps) == greedy_ids(smol["plain"], tokens, steps)


def test_sliding_window_models_are_refused_by_name(smol):
    from accessory.errors import ConfigError
    from accessory.generation.engine import Engine

    model = smol["plain"]
    windows = model.llma.windows
    model.llma.windows = [64] * len(windows)
    try:
        with pytest.raises(ConfigError, match="sliding-window layers"):
            speculating(model, NGRAM)
    finally:
        model.llma.windows = windows
    assert isinstance(speculating(model, NGRAM).engine, Engine)


def test_metrics_count_proposals_and_the_request_line_names_them(caplog):
    from prometheus_client import generate_latest

    from accessory.generation.engine import EngineStats
    from accessory.generation.requests import Request
    from accessory.generation.sampling import SamplingParams
    from accessory.serve.metrics import Metrics, Timing

    metrics = Metrics(lambda: 0, lambda: 0, lambda: 0.0, EngineStats(proposed_tokens=50, accepted_tokens=31))
    scraped = generate_latest(metrics.registry).decode()
    assert "accessory_spec_decode_num_draft_tokens_total 50.0" in scraped
    assert "accessory_spec_decode_num_accepted_tokens_total 31.0" in scraped
    row = Request("r", [1, 2], SamplingParams(), 0, proposed_tokens=12, accepted_tokens=9)
    with caplog.at_level("INFO", logger="accessory.requests"):
        metrics.ended(Timing("req-1", 2, [row]), "stop", 1e9)
    assert "9 of 12 proposed tokens accepted" in caplog.text


# ---- three ranks, on the tiny model ------------------------------------------------------------------------------

TINY_PROMPTS = [[1, 450, 4996, 17354, 1701, 29916], [1, 306, 763, 306, 763, 306], [1, 3118]]
SAMPLING = dict(temperature=0.9, top_k=8)


@pytest.fixture(scope="module")
def tiny_draft(tiny_checkpoints, tmp_path_factory):
    """A draft for the tiny "mha" model: its weights with noise added, so it guesses right only some of the time."""
    from accessory.checkpoint.save import save_checkpoint
    from tiny import TINY_CONFIGS, tiny_state_dict

    noisy = {name: w + 0.15 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(7))
             if w.dim() == 2 else w for name, w in tiny_state_dict(TINY_CONFIGS["mha"]).items()}
    folder = tiny_checkpoints["mha", 3]
    return save_checkpoint(tmp_path_factory.mktemp("draft") / "mha-noisy", noisy, TINY_CONFIGS["mha"], 3,
                           [folder / "tokenizer.model"])


def tiny_runs(folder, draft) -> dict:
    """Greedy and sampled tokens of the tiny model's prompts, plain, with n-gram, with itself as the draft (its
    hidden size of 100 splits into no int8 blocks at 3 ranks, so the draft is float) and with the noisy draft; and
    how many proposals each accepted and rejected."""
    from accessory.model.meta import MetaModel

    plain = MetaModel.from_pretrained(folder, max_seq_len=128, max_batch_size=3)
    drafted = MetaModel.from_pretrained(folder, max_seq_len=128, max_batch_size=3,
                                        speculative_config={"model": "self"})
    noisy = MetaModel.from_pretrained(folder, max_seq_len=128, max_batch_size=3,
                                      speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    ngram = speculating(plain, NGRAM)
    fixed_costs(ngram, drafted, noisy)
    out = {}
    for name, model in (("plain", plain), ("ngram", ngram), ("self", drafted), ("noisy draft", noisy)):
        stats = []
        out[name] = (greedy_ids(model, TINY_PROMPTS, 24, stats=stats),
                     greedy_ids(model, TINY_PROMPTS, 24, stats=stats, **SAMPLING),
                     sum(s.accepted_tokens for s in stats), sum(s.proposed_tokens - s.accepted_tokens for s in stats))
    return out


def test_three_ranks_give_one_processs_tokens(tiny_checkpoints, tiny_draft):
    alone = tiny_runs(tiny_checkpoints["mha", 3], tiny_draft)
    for name in ("ngram", "self", "noisy draft"):
        assert alone[name][:2] == alone["plain"][:2], name
        assert alone[name][2] > 0, f"{name}: no proposal was accepted, so nothing was verified"
    assert alone["noisy draft"][3] > 0 and alone["ngram"][3] > 0  # and rejected ones
    for rank, result in enumerate(run_ranks(3, tiny_runs, tiny_checkpoints["mha", 3], tiny_draft)):
        if isinstance(result, Exception):
            raise AssertionError(result.rank_traceback)
        assert result == alone, f"rank {rank}"


# ---- the distribution, over many seeds ---------------------------------------------------------------------------

def chi_square_p(a: Counter, b: Counter) -> float:
    """The p-value of a two-sample chi-square test that counts `a` and `b` come from one distribution (categories
    with fewer than 10 draws in all are pooled)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    rare = [k for k in set(a) | set(b) if a[k] + b[k] < 10]
    a, b = Counter(a), Counter(b)
    for k in rare:
        a["rare"], b["rare"] = a["rare"] + a.pop(k, 0), b["rare"] + b.pop(k, 0)
    statistic = 0.0
    for k in set(a) | set(b):
        both = a[k] + b[k]
        for count, total in ((a[k], total_a), (b[k], total_b)):
            expected = both * total / (total_a + total_b)
            statistic += (count - expected) ** 2 / expected
    dof = len(set(a) | set(b)) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_tokens_follow_plain_samplings_distribution(tiny_checkpoints):
    """Draws with other seeds: speculation with a draft (the model in int8: its greedy guesses are accepted when the
    sample happens to be the most likely token) against plain sampling, for each of the first 3 tokens. With
    alpha = 1e-4 per test and 3 tests, a correct engine fails this with probability under 3e-4 over the choice of
    seeds (the seeds are fixed, so the outcome is too)."""
    from accessory.model.meta import MetaModel

    folder = tiny_checkpoints["mha", 1]
    plain = MetaModel.from_pretrained(folder, max_seq_len=64, max_batch_size=100)
    drafted = MetaModel.from_pretrained(folder, max_seq_len=64, max_batch_size=100,
                                        speculative_config={"model": "self", "quant": "int8",
                                                            "num_speculative_tokens": 3})
    fixed_costs(drafted)
    draws, stats = {}, []
    for name, model, seed in (("plain", plain, 1), ("drafted", drafted, 2)):
        rows = []
        for batch in range(4):  # 400 draws, 100 rows at a time, each row its own seed
            seeds = list(range(seed * 10 ** 6 + batch * 100, seed * 10 ** 6 + batch * 100 + 100))
            rows += greedy_ids(model, [[1, 306, 763]] * 100, 3, seeds=seeds, stats=stats, temperature=1.0, top_k=3)
        draws[name] = rows
    assert sum(s.accepted_tokens for s in stats) > 100
    for position in range(3):
        p = chi_square_p(Counter(r[position] for r in draws["plain"]), Counter(r[position] for r in draws["drafted"]))
        assert p > 1e-4, f"token {position}: p = {p:.2e}"
    assert not math.isnan(p)


def test_compiled_speculation_gives_eager_tokens_and_compiles_nothing_after_warm_up(tiny_checkpoints, tiny_draft):
    """The verify step compiled (symbolic rows and slots), the noisy draft's decode and verify steps too: after the
    warm-up, batches of 1 to 3 rows with proposals of every length compile no graph, and give plain eager tokens."""
    from accessory.model.meta import MetaModel
    from tiny import CompiledSteps

    torch._dynamo.reset()
    folder = tiny_checkpoints["mha", 1]
    eager = MetaModel.from_pretrained(folder, max_seq_len=128, max_batch_size=3)
    with CompiledSteps() as steps:
        compiled = MetaModel.from_pretrained(folder, max_seq_len=128, max_batch_size=3, compile=True, warmup=True,
                                             speculative_config={"model": str(tiny_draft), "num_speculative_tokens": 3})
        fixed_costs(compiled)  # a draft as big as the target never pays: measured costs would propose little
        warmed = steps.count
        for prompts in (TINY_PROMPTS[:1], TINY_PROMPTS, TINY_PROMPTS[1:]):
            assert engine_ids(compiled, prompts, 20) == greedy_ids(eager, prompts, 20)
        assert steps.count == warmed
    assert compiled.engine.stats.accepted_tokens > 0


def engine_ids(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """`steps` greedy tokens per prompt from model.engine itself (greedy_ids runs an engine configured anew)."""
    from accessory.generation.requests import Request
    from accessory.generation.sampling import SamplingParams

    requests = [Request(row, ids, SamplingParams(max_gen_len=steps), 0) for row, ids in enumerate(prompts)]
    stops, model.engine.stop_ids = model.engine.stop_ids, set()
    try:
        for _ in model.engine.stream(requests):
            pass
    finally:
        model.engine.stop_ids = stops
    return [request.generated for request in requests]


def test_the_command_line_flag_speculates_and_answers_as_plain_decoding(smol, smollm2_checkpoint):
    import subprocess
    import sys

    prompt = "Repeat this text exactly:\n" + TEXT
    result = subprocess.run([sys.executable, "-m", "accessory", "generate", "--pretrained_path",
                             str(smollm2_checkpoint), "--chat", "--prompt", prompt, "--max_gen_len", "40",
                             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    plain = smol["plain"]
    expected = plain.generate([plain.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])],
                              max_gen_len=40)[0]
    assert expected.strip() and expected.strip() in result.stdout
    bad = subprocess.run([sys.executable, "-m", "accessory", "generate", "--prompt", "x", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 0}'], capture_output=True, text=True)
    assert bad.returncode == 2 and "num_speculative_tokens must be an integer >= 1, got 0" in bad.stderr


def test_an_engine_configured_anew_shares_the_costs_measured_once(tiny_checkpoints, monkeypatch):
    """Step costs are measured on the engine a configured one comes from, once: later engines configured from it
    (greedy_ids makes one a run) take the same figures without timing any step again."""
    from accessory.generation import speculation
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=64, speculative_config=NGRAM)
    assert model.engine.speculation.step_costs is None
    first = model.engine.configured(max_batch_size=2)
    assert first.speculation.step_costs is model.engine.speculation.step_costs is not None
    monkeypatch.setattr(speculation, "step_seconds", lambda *_: pytest.fail("the costs were measured again"))
    assert model.engine.configured(max_batch_size=3).speculation.step_costs is model.engine.speculation.step_costs
