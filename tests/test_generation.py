"""generate / stream_generate on the facade: batching of mixed lengths, stop strings, seeds, and rank agreement.
(The engine is covered in depth by its own issue; these pin what the runtime core promises.)"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

PROMPTS = ["The quick brown fox", "Tensor parallel inference is a way to", "Hi"]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=128)


def test_batch_of_mixed_lengths_equals_each_prompt_alone(model):
    batch = model.generate(PROMPTS, max_gen_len=24)
    assert batch == [model.generate([p], max_gen_len=24)[0] for p in PROMPTS]
    assert all(text for text in batch)


def test_max_gen_len_counts_tokens(model):
    text = model.generate([PROMPTS[0]], max_gen_len=5)[0]
    assert len(model.tokenizer.encode(text, bos=False, eos=False)) <= 6  # re-encoding may merge or split a piece
    assert len(model.generate([PROMPTS[0]], max_gen_len=20)[0]) > len(text)


def test_stop_string_cuts_text_and_never_streams(model):
    full = model.generate([PROMPTS[0]], max_gen_len=40)[0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "need a visible stop string from the middle of the answer"
    cut = model.generate([PROMPTS[0]], max_gen_len=40, additional_stop_symbols=[stop])[0]
    assert cut == full[: full.index(stop)]
    chunks = list(model.stream_generate(PROMPTS[0], max_gen_len=40, additional_stop_symbols=[stop]))
    assert chunks[-1] == {"text": cut, "end_of_content": True}
    assert all(stop not in c["text"] and cut.startswith(c["text"]) for c in chunks)
    assert [c["end_of_content"] for c in chunks].count(True) == 1


def test_stream_grows_to_the_generated_text(model):
    chunks = list(model.stream_generate(PROMPTS[1], max_gen_len=30))
    texts = [c["text"] for c in chunks]
    assert texts[-1] == model.generate([PROMPTS[1]], max_gen_len=30)[0]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and len(texts) > 5


def test_seed_makes_sampling_reproducible(model):
    runs = [model.generate(PROMPTS[:2], max_gen_len=24, temperature=1.0, top_p=0.9, seed=7) for _ in range(2)]
    assert runs[0] == runs[1]
    others = {tuple(model.generate(PROMPTS[:2], max_gen_len=24, temperature=1.0, seed=s)) for s in range(4)}
    assert len(others) > 1, "different seeds should sample differently"


def test_incremental_text_equals_full_decode(model):
    from accessory.generation.text import RowText

    text = "Café ünïcödé 東京 😀 tokens\n  spaced"
    ids = model.tokenizer.encode(text, bos=False, eos=False)
    row = RowText(model.tokenizer)
    for token in ids:
        row.push(token)
        assert "\ufffd" not in row.text
    row.finish()
    assert row.text == model.tokenizer.decode(ids)


def sample_with_divergent_global_rngs(folder):
    """Each rank seeds its global RNG differently and gets a different prompt; they must still agree."""
    import torch.distributed as dist

    from accessory.model.meta import MetaModel

    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    return model.generate([PROMPTS[rank]], max_gen_len=16, temperature=1.0, top_p=1.0)


def test_ranks_agree_without_caller_cooperation(tiny_checkpoints):
    results = run_ranks(2, sample_with_divergent_global_rngs, tiny_checkpoints["mha", 2])
    assert not isinstance(results[0], Exception), results[0].rank_traceback
    assert results[0] == results[1]
