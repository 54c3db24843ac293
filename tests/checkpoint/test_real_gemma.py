"""Google's real Gemma 3 270M (base), from its Q4_K_M GGUF: in float32 it gives transformers' greedy continuation of
the same GGUF at 1 and 2 ranks (transformers reads the file itself, the independent oracle); loaded directly from
the file with its K-quant bits kept, its greedy text starts as transformers' does.

The float32 checkpoint is the file's import with its bits kept, dequantized (to exactly the gguf package's values:
tests/quant/test_kquants.py) and saved: the same weights `convert gguf` without --keep-quantized writes, made without a
second pass over the 262k-token file's metadata (about 30 s of the suite)."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

PROMPTS = ["The capital of France is", "The three primary colours are"]
# Prompts past GGUF_INT8X_ROWS tokens, whose products take x in int8 by default; at the second one's 5th token
# transformers' top two logits are 0.2 apart (" Light" 9.49, " Photos" 9.28), and x's rounding turns them over.
LONG_PROMPTS = ["The history of the city of Paris, told year by year, from its first settlers to the present day. " * 4
                + "In the year 1200,",
                "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
                "synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves the green "
                "pigment chlorophyll and generates oxygen as a byproduct. The main stages are"]
# What transformers' greedy continuation starts with (its first 8 tokens are compared whole below)
STARTS = [" the capital of the country of France. It is the largest city", " red, yellow and blue."]
GEN_STEPS = 16


@pytest.fixture(scope="module")
def float_import(gemma3_gguf, tmp_path_factory):
    from accessory.checkpoint.config import read_spec
    from accessory.checkpoint.direct import imported
    from accessory.checkpoint.save import save_checkpoint
    from accessory.model.meta import MetaModel
    from accessory.text.tokenizer import find_tokenizer_for
    from accessory.quant.formats import dequantize

    kept = imported(gemma3_gguf)
    llma = MetaModel.from_pretrained(str(kept), max_seq_len=256).llma
    tensors, quantized = llma.saved_tensors(), llma.quantization
    state_dict = {name: t for name, t in tensors.items() if name.rpartition(".")[0] not in quantized}
    for name, fmt in quantized.items():
        state_dict[name] = dequantize({p.rpartition(".")[2]: t for p, t in tensors.items()
                                       if p.rpartition(".")[0] == name}, fmt)
    spec = read_spec([kept])
    return save_checkpoint(tmp_path_factory.mktemp("gemma3") / "float32", state_dict, spec.config, 1,
                           find_tokenizer_for([kept]).files, spec.llama_type)


@pytest.fixture(scope="module")
def prompt_ids(float_import) -> list[list[int]]:
    from accessory.text.tokenizer import Tokenizer, find_tokenizer

    tokenizer = Tokenizer.from_path(find_tokenizer([float_import]))
    return [tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def transformers_model(gemma3_gguf, gemma3_reader):
    """transformers' model of the GGUF, dequantized to float32 by transformers itself. The file's layout is parsed
    once for the suite (conftest.gguf_read_once)."""
    from conftest import hf_model_of_gguf

    return hf_model_of_gguf(gemma3_gguf, gemma3_reader)


@pytest.fixture(scope="module")
def oracle(transformers_model, prompt_ids) -> list[list[int]]:
    """transformers' greedy tokens for the prompts (their ids are ours: our tokenizer is the one transformers
    rebuilds from the GGUF's metadata)."""
    model = transformers_model
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=GEN_STEPS, do_sample=False)[0, len(ids):].tolist()
                for ids in prompt_ids]


def greedy_tokens_of(folder, prompt_ids) -> list[list[int]]:
    from accessory.model.meta import MetaModel
    from tiny import greedy_ids

    return greedy_ids(MetaModel.from_pretrained(str(folder), max_seq_len=256), prompt_ids, GEN_STEPS)


def test_float32_equals_transformers_at_1_and_2_ranks(float_import, prompt_ids, oracle):
    assert greedy_tokens_of(float_import, prompt_ids) == oracle
    for rank, result in enumerate(run_ranks(2, greedy_tokens_of, float_import, prompt_ids)):
        assert not isinstance(result, Exception), result.rank_traceback
        assert result == oracle, f"rank {rank}"


@pytest.fixture(scope="module")
def kept_model(gemma3_gguf):
    """`from_pretrained("model.gguf")`: imported once into the cache with its bits kept, then loaded."""
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(str(gemma3_gguf), max_seq_len=256)


def test_kept_kquant_bits_loaded_from_the_file_start_as_transformers(kept_model, oracle):
    """The file's Q4_K / Q6_K / Q5_0 / Q8_0 bits kept; the greedy text starts as the float32 oracle's."""
    model = kept_model
    assert set(model.llma.quantization.values()) == {"q4_k", "q6_k", "q5_0", "int8"}
    texts = model.generate(PROMPTS, max_gen_len=GEN_STEPS)
    for text, start in zip(texts, STARTS):
        assert text.startswith(start), text


def test_long_prompts_exact_products_equal_transformers_and_int8_x_starts_as_it(kept_model, transformers_model):
    """Prompts of more than 40 tokens: with exact products (from_pretrained's exact_products) every product is
    float32 and the greedy tokens are transformers'; by default the prompt's products quantize x to int8 (the
    kernel runs), and the tokens are transformers' up to the near tie of the second prompt (LONG_PROMPTS)."""
    from accessory.kernels import dispatch
    from tiny import greedy_ids

    ids = [kept_model.tokenizer.encode(p, bos=True, eos=False) for p in LONG_PROMPTS]
    assert all(len(i) > 40 for i in ids)
    with torch.no_grad():
        oracle = [transformers_model.generate(torch.tensor([i]), max_new_tokens=8, do_sample=False)[0, len(i):].tolist()
                  for i in ids]
    dispatch.exact_products(True)
    try:
        assert greedy_ids(kept_model, ids, 8) == oracle
    finally:
        dispatch.exact_products(False)
    with torch.profiler.profile() as profiled:
        fast = greedy_ids(kept_model, ids, 8)
    assert "accessory::gguf_int8x_linear_cpu" in {event.name for event in profiled.events()}
    assert fast[0] == oracle[0] and fast[1][:4] == oracle[1][:4] and fast[1][4] != oracle[1][4]
