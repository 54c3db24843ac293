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
def oracle(gemma3_gguf, gemma3_reader, prompt_ids) -> list[list[int]]:
    """transformers' greedy tokens for the prompts, from the GGUF dequantized to float32 by transformers itself
    (the prompts' ids are ours: our tokenizer is the one transformers rebuilds from the GGUF's metadata). The file's
    layout is parsed once for the suite (conftest.gguf_read_once)."""
    from conftest import hf_model_of_gguf

    model = hf_model_of_gguf(gemma3_gguf, gemma3_reader)
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


def test_kept_kquant_bits_loaded_from_the_file_start_as_transformers(gemma3_gguf, oracle):
    """`from_pretrained("model.gguf")`: imported once into the cache with its Q4_K / Q6_K / Q5_0 / Q8_0 bits, then
    loaded; the greedy text starts as the float32 oracle's."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(str(gemma3_gguf), max_seq_len=256)
    assert set(model.llma.quantization.values()) == {"q4_k", "q6_k", "q5_0", "int8"}
    texts = model.generate(PROMPTS, max_gen_len=GEN_STEPS)
    for text, start in zip(texts, STARTS):
        assert text.startswith(start), text
