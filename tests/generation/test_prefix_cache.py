"""Prefix caching, against the engine with the cache off as the oracle: the same greedy and seeded tokens whether
prompts reuse cached prefixes or not (a shared system prompt, a multi-turn chat, rows that moved during compaction,
compiled decoding, a quantized model, 3 ranks, the real built-in model), and exactly the expected number of prompt
tokens reused instead of prefilled."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_ranks

SYSTEM = ("You are a careful assistant. Answer in full sentences, cite what you know, and say so plainly when you "
          "do not know the answer to a question.")
QUESTIONS = ["Why is the sky blue?", "How do bees make honey?", "What is a comet?", "Where do owls live?",
             "When did the Nile flood?"]
GEN_LENGTHS = [9, 3, 14, 6, 11]  # rows finish at different steps: they leave, move, and waiting prompts join


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=128)


def drive(engine, script, rows: int) -> tuple[list, object]:
    """Run `engine` on this rank; on the source rank, `script(step, add)` before each step adds requests (via
    add(request)) and returns True once it will add no more. Returns (the source's requests, the engine's stats)."""
    scheduler, requests = engine.scheduler(rows), []
    if scheduler is not None:
        step_of, steps = scheduler.step, iter(range(10 ** 6))

        def add(r):
            requests.append(r)
            scheduler.add(r)

        def scripted(logits, proposals=()):
            if not scheduler.intake.closed and script(next(steps), add):
                scheduler.close()  # read from the inbox by the step below: `closed` is set then
            return step_of(logits, proposals)

        scheduler.step = scripted
    for _ in engine.run(scheduler, rows, engine.max_seq_len):
        pass
    return requests, engine.stats


def request(row, tokens, max_gen_len, seed=0, **sampling):
    from accessory.generation.sampling import SamplingParams
    from accessory.generation.requests import Request

    return Request(row, list(tokens), SamplingParams(max_gen_len, **sampling), seed)


def configured(model, **settings):
    engine = model.engine.configured(**settings)
    engine.stop_ids = set()  # every request runs to its max_gen_len
    return engine


def shared_prompts(tokenizer) -> list[list[int]]:
    system = tokenizer.encode(SYSTEM, bos=True, eos=False)
    questions = [tokenizer.encode(q, bos=False, eos=False) for q in QUESTIONS]
    assert len({q[0] for q in questions}) == len(questions)  # prompts diverge right after the system prompt
    return [system + q for q in questions]


def shared_system_prompt(engine, tokenizer, rows=2, **sampling) -> tuple[list[list[int]], object]:
    """QUESTIONS after one system prompt, all queued at once, `rows` at a time: the second reuses the first's
    prefix in the same step, later ones a live or a finished row's."""
    prompts = shared_prompts(tokenizer)
    script = lambda step, add: [add(request(i, p, n, seed=i, **sampling))  # noqa: E731
                                for i, (p, n) in enumerate(zip(prompts, GEN_LENGTHS))]
    requests, stats = drive(engine, script, rows)
    return [r.generated for r in requests], stats


def chat(engine, tokenizer, turns=3, gen=8) -> tuple[list[list[int]], list[list[int]], object]:
    """A conversation: each turn's prompt is the last one, its reply and a new question; a turn starts when the last
    one has finished (the engine keeps running in between). Returns (prompts, replies, stats)."""
    first = tokenizer.encode(SYSTEM, bos=True, eos=False) + tokenizer.encode(QUESTIONS[0], False, False)
    turns_run = []

    def script(step, add):
        if not turns_run or turns_run[-1].finish_reason is not None:
            tokens = first if not turns_run else (turns_run[-1].tokens + turns_run[-1].generated
                                                  + tokenizer.encode(QUESTIONS[len(turns_run)], False, False))
            turns_run.append(request(len(turns_run), tokens, gen))
            add(turns_run[-1])
        return len(turns_run) == turns

    requests, stats = drive(engine, script, rows=2)
    return [r.tokens for r in requests], [r.generated for r in requests], stats


# ---- the pure parts: which row a prompt copies from, which rows keep finished sequences --------------------------

def test_a_prompt_reuses_its_longest_cached_prefix_but_never_its_last_token():
    from accessory.generation.prefix import MIN_REUSE, RetainedRows, Reuse, common_prefix, plan_reuse, waves

    base = list(range(100, 100 + 2 * MIN_REUSE))
    assert common_prefix(base, base + [1]) == len(base) and common_prefix([1, 2, 3], [1, 5]) == 1
    retained = RetainedRows(first=4, count=2)
    assert retained.keep(base + [7, 8]) == 4
    live = [base[:MIN_REUSE] + [9], [5] * 40]
    prompts = [base + [7, 8], base[:MIN_REUSE + 3] + [6], base[:MIN_REUSE + 3] + [6, 1], [5] * 3]
    plans = plan_reuse(prompts, live, retained)
    assert plans[0] == Reuse(source=4, length=len(base) + 1)  # the kept sequence, all but the prompt's last token
    assert plans[1] == Reuse(source=4, length=MIN_REUSE + 3)  # longer there than in live row 0
    assert plans[2] == Reuse(source=3, length=MIN_REUSE + 4, after=1)  # from prompt 1, admitted with it into row 3
    assert plans[3] is None  # 2 shared tokens are too few
    assert waves(plans) == [[0, 1, 3], [2]]


def test_kept_sequences_replace_the_turn_they_extend_then_the_least_recently_used():
    from accessory.generation.prefix import MIN_REUSE, RetainedRows

    turn = list(range(MIN_REUSE))
    retained = RetainedRows(first=2, count=2)
    assert retained.keep(turn[:-1]) is None  # too short to be worth keeping
    assert retained.keep(turn) == 2
    assert retained.keep(turn + [1, 2]) == 2  # the next turn extends it: same slot
    assert retained.keep(turn + [1]) is None  # already covered
    assert retained.keep([7] * MIN_REUSE) == 3
    retained.used(2)
    assert retained.keep([8] * MIN_REUSE) == 3  # row 3 was used least recently
    assert [row for row, _ in retained.candidates()] == [2, 3]


# ---- the engine, tiny model ----------------------------------------------------------------------------------------

def test_a_shared_system_prompt_is_prefilled_once_with_the_same_greedy_tokens(model):
    prompts = shared_prompts(model.tokenizer)
    system = len(model.tokenizer.encode(SYSTEM, bos=True, eos=False))
    off, off_stats = shared_system_prompt(configured(model, prefix_cache=False), model.tokenizer)
    on, on_stats = shared_system_prompt(configured(model), model.tokenizer)
    assert on == off and [len(g) for g in on] == GEN_LENGTHS
    total = sum(map(len, prompts))
    assert (off_stats.prefilled_tokens, off_stats.reused_tokens) == (total, 0)
    assert on_stats.reused_tokens == (len(prompts) - 1) * system  # every prompt but the first
    assert on_stats.prefilled_tokens == total - on_stats.reused_tokens


def test_sampling_with_a_seed_gives_the_same_tokens_with_the_cache_on_and_off(model):
    sampling = dict(temperature=0.9, top_p=0.9, top_k=50)
    off, _ = shared_system_prompt(configured(model, prefix_cache=False), model.tokenizer, **sampling)
    on, stats = shared_system_prompt(configured(model), model.tokenizer, **sampling)
    assert on == off and stats.reused_tokens > 0
    assert on != shared_system_prompt(configured(model, prefix_cache=False), model.tokenizer)[0]  # it did sample


@pytest.mark.parametrize("kept_bytes", [256 << 20, 0], ids=["kept", "none-kept"])
def test_a_chat_turn_reuses_the_last_turn_and_its_reply_except_the_token_never_fed(model, kept_bytes):
    """The finished turn's row holds its prompt and its reply but the last token sampled (never fed through the
    model). With no bytes for finished sequences, nothing is kept, so nothing is reused."""
    prompts, off, _ = chat(configured(model, prefix_cache=False), model.tokenizer)
    prompts_on, on, stats = chat(configured(model, prefix_cache_bytes=kept_bytes), model.tokenizer)
    assert prompts_on == prompts and on == off
    cached = [len(p) + len(reply) - 1 for p, reply in zip(prompts, off)]
    assert stats.reused_tokens == (sum(cached[:-1]) if kept_bytes else 0)
    assert stats.prefilled_tokens == sum(map(len, prompts)) - stats.reused_tokens


def test_reuse_follows_rows_that_moved_when_requests_finished_out_of_order(model):
    """a, b, c start together; b finishes first, so c moves from row 2 to row 1. d then copies c's prefix from its
    new row while c still runs, and e from the row kept when c finished. The moved rows' record must follow."""
    tok = model.tokenizer
    other = tok.encode("Tensor parallel inference splits each layer's weights across several processes, which "
                       "exchange activations at every block.", bos=True, eos=False)
    prefix = tok.encode(SYSTEM, bos=True, eos=False)
    q = [tok.encode(x, False, False) for x in QUESTIONS]
    arrivals = {0: [("a", other + q[0], 20), ("b", other[:5] + q[1], 3), ("c", prefix + q[2], 14)],
                6: [("d", prefix + q[3], 6)], 22: [("e", prefix + q[4], 5)]}

    def script(step, add):
        for name, tokens, n in arrivals.get(step, []):
            add(request(name, tokens, n))
        return step == max(arrivals)

    results = {}
    for cache in (False, True):
        requests, stats = drive(configured(model, prefix_cache=cache, max_batch_size=3), script, rows=3)
        results[cache] = {r.id: r.generated for r in requests}, stats.reused_tokens
    assert results[True][0] == results[False][0]
    assert results[True][1] == 2 * len(prefix) and results[False][1] == 0


def test_compiled_decoding_with_reuse_gives_the_eager_tokens_and_compiles_at_most_twice(model):
    from tiny import CompiledSteps

    torch._dynamo.reset()
    with CompiledSteps() as made:  # torch.compile's graphs, or on the CPU the packages compiled or loaded
        compiled, stats = shared_system_prompt(configured(model, compile=True), model.tokenizer)
    assert made.count <= 2
    assert compiled == shared_system_prompt(configured(model, prefix_cache=False), model.tokenizer)[0]
    assert stats.reused_tokens > 0


def test_a_quantized_model_gives_the_same_tokens_with_the_cache_on_and_off(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=128, quant="int8")
    on, stats = shared_system_prompt(configured(model), model.tokenizer)
    assert on == shared_system_prompt(configured(model, prefix_cache=False), model.tokenizer)[0]
    assert stats.reused_tokens > 0


def _both_scenarios(folder) -> tuple:
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    shared, shared_stats = shared_system_prompt(configured(model), model.tokenizer)
    _, replies, chat_stats = chat(configured(model), model.tokenizer)
    # the tokens are the source rank's (sampled there); each rank counts its own reuse
    return model.ctx.broadcast_object((shared, replies)), (shared_stats.reused_tokens, chat_stats.reused_tokens)


def test_three_ranks_reuse_alike_and_give_the_tokens_of_one_rank(model, tiny_checkpoints):
    """Each rank decides reuse by itself from the plans: the same rows, so the same tokens as one rank."""
    shared, _ = shared_system_prompt(configured(model, prefix_cache=False), model.tokenizer)
    _, replies, _ = chat(configured(model, prefix_cache=False), model.tokenizer)
    one_rank = _both_scenarios(tiny_checkpoints["mha", 1])
    for rank, result in enumerate(run_ranks(3, _both_scenarios, tiny_checkpoints["mha", 3])):
        assert not isinstance(result, Exception), result.rank_traceback
        assert result[0] == (shared, replies) and result[1] == one_rank[1], f"rank {rank}"
        assert min(result[1]) > 0


# ---- the real built-in model ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(smollm2_checkpoint, max_seq_len=1024)


def chat_prompt(model, messages) -> list[int]:
    from accessory.generation.chat import render_chat

    return model.tokenizer.encode(render_chat(model.tokenizer, messages)[0], bos=True, eos=False)


def real_chat(engine, model, system: str, questions: list[str]) -> tuple[list[str], object]:
    """Rows of 2: the questions after one system prompt in the chat template, all at once; then a second turn of
    the first conversation, in the template, once its first answer is done."""
    first = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    started = []

    def script(step, add):
        if not started:
            started.extend(request(i, chat_prompt(model, m), 16) for i, m in enumerate(first))
            [add(r) for r in started]
        elif started[0].finish_reason is not None and len(started) == len(first):
            reply = model.tokenizer.decode(started[0].generated)
            follow = first[0] + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And why?"}]
            started.append(request(len(started), chat_prompt(model, follow), 16))
            add(started[-1])
        return len(started) > len(first)

    requests, stats = drive(engine, script, rows=2)
    return [model.tokenizer.decode(r.generated) for r in requests], stats


def test_the_real_model_answers_the_same_with_a_shared_system_prompt_and_a_second_turn(smollm2):
    system = "You are a geography teacher. " * 12 + "Answer in one short sentence."
    questions = ["What is the capital of France?", "What is the capital of Italy?", "Which river flows through Cairo?"]
    off, off_stats = real_chat(smollm2.engine.configured(prefix_cache=False), smollm2, system, questions)
    on, on_stats = real_chat(smollm2.engine.configured(), smollm2, system, questions)
    assert on == off and "Paris" in on[0] and "Rome" in on[1]
    prompts = [chat_prompt(smollm2, [{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    # each later question reuses what it shares with an earlier one (the system prompt at least); the second turn
    # at least its whole first turn's prompt (and its reply, where the reply's text encodes to the same tokens)
    shared = sum(max(len(os.path.commonprefix([p, q])) for q in prompts[:i]) for i, p in enumerate(prompts) if i)
    assert shared > 2 * len(smollm2.tokenizer.encode(system, bos=False, eos=False))
    assert on_stats.reused_tokens >= shared + len(prompts[0])
    assert on_stats.prefilled_tokens + on_stats.reused_tokens == off_stats.prefilled_tokens


def test_the_memory_bound_is_a_flag_and_a_loading_argument(tiny_checkpoints):
    from accessory.cli import build_parser
    from accessory.model.meta import MetaModel

    args = build_parser().parse_args(["serve", "--prefix-cache-bytes", "1GB", "--no-prefix-cache"])
    assert args.prefix_cache_bytes == 10 ** 9 and args.prefix_cache is False
    model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=128, prefix_cache_bytes=12345)
    assert model.engine.settings.prefix_cache_bytes == 12345
