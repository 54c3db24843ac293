"""Every family (qwen2, qwen3, mistral, gemma3) against transformers: a tiny random model of each, built and saved by
transformers, imported by `accessory convert hf`, gives transformers' greedy tokens at 1 and 2 ranks, eager (and
compiled: qwen2 and gemma3), on a short prompt and on one that crosses the sliding window (and removing the window
changes the tokens, so the window is what is tested); the prefix cache and int8 quantization work on them."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from test_hf_oracle import converted_hf_models, hf_greedy
from tiny import FAMILY_CONFIGS, WINDOW, build_tiny_family, greedy_ids

GEN_STEPS = 24
FAMILIES = list(FAMILY_CONFIGS)
WINDOWED = ("mistral", "gemma3")
# compiled: the families whose steps differ from llama's in what a graph holds (qwen2's biases; gemma3's windows, q/k
# norms, sandwich norms and GeGLU, which cover mistral's window and qwen3's norms; each compile takes 20-60 s)
COMPILED = ("qwen2", "gemma3")


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [[1] + torch.randint(10, 32000, (n,), generator=generator).tolist() for n in (7, 60)]


@pytest.fixture(scope="module")
def families(tmp_path_factory, llama_tokenizer) -> dict:
    """family -> (its HF model, the folder `accessory convert hf` made of it, transformers' greedy tokens)."""
    return converted_hf_models(FAMILIES, build_tiny_family, tmp_path_factory.mktemp("families"), llama_tokenizer,
                               prompts(), GEN_STEPS)


def our_tokens(folder, **options) -> list[list[int]]:
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(str(folder), max_seq_len=128, **options)
    return greedy_ids(model, prompts(), GEN_STEPS)


@pytest.mark.parametrize("family", FAMILIES)
def test_equals_transformers_greedy_tokens(family, families):
    _, folder, expected = families[family]
    assert our_tokens(folder) == expected


@pytest.mark.parametrize("family", COMPILED)
def test_compiled_equals_transformers(family, families):
    _, folder, expected = families[family]
    assert our_tokens(folder, compile=True) == expected


def every_family_at_two_ranks(folders: dict) -> dict:
    return {family: our_tokens(folder) for family, folder in folders.items()}


def test_two_ranks_equal_transformers(families):
    """At 2 ranks the KV heads are split (2 of them), or replicated (Gemma's one)."""
    results = run_ranks(2, every_family_at_two_ranks, {f: folder for f, (_, folder, _) in families.items()})
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        for family, (_, _, expected) in families.items():
            assert result[family] == expected, f"{family} at rank {rank}"


@pytest.mark.parametrize("family", WINDOWED)
def test_the_window_matters(family, families, tmp_path, llama_tokenizer):
    """The same weights without a window (one far beyond the prompt) give other tokens for the prompt that crosses
    it: the windowed tokens above are the window's doing."""
    unwindowed = build_tiny_family(family, tmp_path / "hf", llama_tokenizer, sliding_window=4096)
    long_prompt = prompts()[1]
    assert hf_greedy(unwindowed, long_prompt, GEN_STEPS) != families[family][2][1]


class ReusedCounted:
    """An engine whose configured copies add up the prompt tokens they reused."""
    tokens = 0

    def __init__(self, engine):
        self.engine = engine

    def configured(self, **changes):
        engine = self.engine.configured(**changes)
        stream = engine.stream

        def counted(requests):
            yield from stream(requests)
            ReusedCounted.tokens += engine.stats.reused_tokens
        engine.stream = counted
        return engine


def test_prefix_cache_reuses_through_a_ring(families):
    """A prompt sharing 18 tokens with one admitted beside it copies them from that row's ring (which holds all of
    them: the row is shorter than the window) and gives the tokens it gives alone, decoding well past the window;
    and the KV cache of the windowed layers holds only the window. (A row that went on past the window gives none:
    `reusable_prefix`.)"""
    from accessory.model.meta import MetaModel

    _, folder, _ = families["gemma3"]
    model = MetaModel.from_pretrained(str(folder), max_seq_len=128)
    first = prompts()[1][:WINDOW - 2]  # its row's ring still holds all of it
    second = first[:18] + [11, 12, 13, 14, 15]
    ReusedCounted.tokens = 0  # test_moe.py counts with it too, before this test when a worker runs that file first
    together = greedy_ids(model, [first, second], GEN_STEPS, engine=ReusedCounted(model.engine))
    assert ReusedCounted.tokens == 18
    alone = [greedy_ids(model, [p], GEN_STEPS, engine=model.engine.configured(prefix_cache=False))[0]
             for p in (first, second)]
    assert together == alone
    from accessory.network.kv_caches import KVCaches

    assert [c.k.shape[2] for c in KVCaches.allocate(model.llma, 2, 128).layers] == [WINDOW] * 3 + [128]


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_keeps_the_logits(family, families):
    """quant="int8" on every family (biases, q/k norms and sandwich norms stay float): logits close to float's."""
    from accessory.model.meta import MetaModel

    _, folder, _ = families[family]
    ids = torch.tensor([prompts()[1]])
    reference = MetaModel.from_pretrained(str(folder), max_seq_len=128).llma(ids)
    quantized = MetaModel.from_pretrained(str(folder), max_seq_len=128, quant="int8").llma(ids)
    cosine = torch.nn.functional.cosine_similarity(reference.flatten(), quantized.flatten(), dim=0)
    assert cosine > 0.999, cosine


def test_an_hf_folder_loads_directly(families, tmp_path, monkeypatch, caplog):
    """`from_pretrained` of the HF folder itself: imported once into the cache, then read from there."""
    import logging

    from accessory.model.meta import MetaModel

    monkeypatch.setenv("ACCESSORY_CACHE", str(tmp_path))
    hf_folder = families["qwen2"][1].parent / "qwen2-hf"
    with caplog.at_level(logging.INFO, logger="accessory.checkpoint.direct"):
        first = greedy_ids(MetaModel.from_pretrained(str(hf_folder), max_seq_len=128), prompts(), GEN_STEPS)
        second = greedy_ids(MetaModel.from_pretrained(str(hf_folder), max_seq_len=128), prompts(), GEN_STEPS)
    assert first == second == families["qwen2"][2]
    said = [r.getMessage() for r in caplog.records]
    assert sum("importing it once" in m for m in said) == 1 and sum("loading its import" in m for m in said) == 1
    assert len(list((tmp_path / "imported").iterdir())) == 2  # the import and its lock file


def test_gemma3_for_conditional_generation_imports_its_language_model(tmp_path, llama_tokenizer):
    """A Gemma3ForConditionalGeneration folder (vision tower and projector beside the language model): its language
    model is imported, and gives the multimodal model's own greedy tokens on text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from accessory.checkpoint.convert import convert
    from accessory.model.meta import MetaModel
    from tiny import family_config, save_lively

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=family_config("gemma3"), vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = save_lively(Gemma3ForConditionalGeneration(config).eval(), "gemma3", tmp_path / "hf", llama_tokenizer)
    folder = convert("hf", tmp_path / "hf", tmp_path / "ours")
    model = MetaModel.from_pretrained(str(folder), max_seq_len=128)
    assert model.llama_type == "gemma3" and not hasattr(model.llma, "vision_tower")
    assert greedy_ids(model, prompts(), GEN_STEPS) == [hf_greedy(hf, ids, GEN_STEPS) for ids in prompts()]


def test_the_server_engine_with_structured_output(families):
    """The server's GenerationService on Gemma 3 (rings, q/k norm, soft-capping): JSON-schema output from sampled
    rows decoding together, each valid."""
    import json

    import jsonschema

    from accessory.generation.constraints import Constraint
    from accessory.model.meta import MetaModel
    from test_constraints import SCHEMA, complete

    model = MetaModel.from_pretrained(str(families["gemma3"][1]), max_seq_len=256, max_batch_size=8)
    for final in complete(model, Constraint.json_schema(SCHEMA), seeds=range(4)):
        assert final.finish_reason == "stop", final
        jsonschema.validate(json.loads(final.text), SCHEMA)
