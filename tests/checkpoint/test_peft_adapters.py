"""Hugging Face PEFT LoRA adapters (checkpoint/peft_adapter.py): `from_pretrained(lora=...)`, `weights merge-lora`
of an adapter folder, and adapters chosen per request (`lora_modules`).

The oracle is `peft` itself: a tiny random transformers LlamaForCausalLM (GQA: 12 heads, 2 KV heads, so 2 ranks
split the KV heads), adapters made with `LoraConfig(init_lora_weights=False)` (random non-zero B, so the adapter
changes the tokens) and saved with `save_pretrained`; `PeftModel`'s greedy tokens are what ours must be, at 1 and 2
ranks, unmerged and merged.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from test_hf_oracle import hf_greedy, hf_model
from tiny import TINY_CONFIGS, greedy_ids

CONFIG = TINY_CONFIGS["gqa"]
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig arguments
    "plain": dict(r=4, lora_alpha=8, target_modules=ALL_MODULES),
    "rslora": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"]),
    "mlp": dict(r=2, lora_alpha=16, target_modules=["gate_proj", "up_proj", "v_proj"]),
}
# the first is longer than the prefix cache's shortest reuse (prefix.MIN_REUSE): rows of different adapters with
# the same prompt must not share its keys and values
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the dog sleeps on in the sun", "Once upon a time"]
GEN_STEPS = 8


def make_adapter(base_dir: Path, out: Path, seed: int, **lora) -> torch.nn.Module:
    """A PeftModel over the HF model in `base_dir` with LoRA factors random (B too), saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir).eval(),
                           LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # B's default init is small next to these weights: scaled so the tokens change
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4)
    model.save_pretrained(out)
    return model.eval()


@pytest.fixture(scope="module")
def fixture(tmp_path_factory, llama_tokenizer) -> dict:
    """The base (an HF folder and our import of it), each adapter's folder and PEFT's greedy tokens."""
    from accessory.checkpoint.convert import convert
    from accessory.text.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("peft")
    base = hf_model(CONFIG)
    base.save_pretrained(root / "hf")
    shutil.copy(llama_tokenizer, root / "hf" / "tokenizer.model")
    ckpt = convert("hf", root / "hf", root / "ckpt", shards=1)
    tokenizer = Tokenizer.from_path(llama_tokenizer)
    prompts = [tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    out = {"root": root, "ckpt": ckpt, "prompts": prompts,
           "base_tokens": [hf_greedy(base, ids, GEN_STEPS) for ids in prompts]}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        model = make_adapter(root / "hf", root / name, seed, **lora)
        out[name] = (root / name, [hf_greedy(model, ids, GEN_STEPS) for ids in prompts])
    # fan_in_fan_out: the base weight stored (in, out); PEFT's factors have the same shapes either way (only its
    # merged delta is transposed), so the same files with the flag set are the same adapter
    shutil.copytree(root / "plain", root / "fifo")
    config = json.loads((root / "fifo" / "adapter_config.json").read_text())
    (root / "fifo" / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    return out


def run_adapters(prompts, variants: dict) -> dict:
    """{variant: (greedy tokens, logits of the first prompt)} of each (checkpoint, adapter or None, quant)."""
    from accessory.model.meta import MetaModel

    out = {}
    for name, (ckpt, adapter, quant) in variants.items():
        model = MetaModel.from_pretrained(ckpt, max_seq_len=128, lora=adapter, quant=quant)
        out[name] = (greedy_ids(model, prompts, GEN_STEPS), model.llma(torch.tensor(prompts[:1]))[0])
    return out


def run_mixed(ckpt: Path, prompts, modules: dict, rows: list[tuple[int, int, int]]) -> list[list[int]]:
    """The tokens of requests (prompt index, adapter index, max_gen_len) run together, 3 rows at a time (rows leave
    and join), with `modules` (name -> folder) held unmerged."""
    from accessory.generation.requests import Request
    from accessory.generation.sampling import SamplingParams
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(ckpt, max_seq_len=128, lora_modules=modules, max_batch_size=3)
    engine = model.engine.configured(max_batch_size=3)
    engine.stop_ids = set()
    requests = [Request(i, prompts[p], SamplingParams(max_gen_len=steps), 0, adapter=adapter)
                for i, (p, adapter, steps) in enumerate(rows)]
    for _ in engine.stream(requests):
        pass
    return model.ctx.broadcast_object([request.generated for request in requests])


def run_all(prompts, variants: dict, ckpt: Path, modules: dict) -> dict:
    return {**run_adapters(prompts, variants), "mixed": run_mixed(ckpt, prompts, modules, MIXED)}


@pytest.fixture(scope="module")
def merged(fixture) -> Path:
    """`accessory weights merge-lora CKPT ADAPTER DST` of the plain adapter, at 2 shards."""
    from accessory.cli import main

    dst = fixture["root"] / "merged"
    main(["weights", "merge-lora", str(fixture["ckpt"]), str(fixture["root"] / "plain"), str(dst), "--shards", "2"])
    return dst


MODULES = ("plain", "rslora")  # lora_modules: adapters 1 and 2
MIXED = [(0, 0, 8), (0, 1, 5), (0, 2, 8), (1, 1, 8), (1, 0, 3), (1, 2, 6), (0, 1, 8)]  # (prompt, adapter, steps)


@pytest.fixture(scope="module")
def results(fixture, merged) -> dict:
    """{world: per-rank {variant: (tokens, logits)}} at 1 and 2 ranks, and "mixed": the MIXED requests' tokens."""
    root, ckpt = fixture["root"], fixture["ckpt"]
    variants = {"base": (ckpt, None, False), **{name: (ckpt, root / name, False) for name in (*ADAPTERS, "fifo")},
                "merged": (merged, None, False), "plain_int8": (ckpt, root / "plain", "int8"),
                "base_int8": (ckpt, None, "int8")}
    at_two = ("plain", "rslora", "mlp", "merged")  # (int8 at 2 ranks: wo's 48 inputs a rank are not whole blocks)
    modules = {name: root / name for name in MODULES}
    out = {1: [run_all(fixture["prompts"], variants, ckpt, modules)]}
    out[2] = run_ranks(2, run_all, fixture["prompts"], {k: variants[k] for k in at_two}, ckpt, modules)
    for rank_result in out[2]:
        if isinstance(rank_result, Exception):
            raise AssertionError(rank_result.rank_traceback)
    return out


def test_base_matches_transformers(fixture, results):
    assert results[1][0]["base"][0] == fixture["base_tokens"]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", [*ADAPTERS, "merged"])
def test_adapter_tokens_equal_peft_models(fixture, results, world, name):
    """Every block linear (q/k permuted to our RoPE layout), lora_alpha / r and rsLoRA's lora_alpha / sqrt(r), each
    rank its slice of A or B; and `weights merge-lora`'s checkpoint of the plain one (2 shards)."""
    peft_tokens = fixture["plain" if name == "merged" else name][1]
    assert peft_tokens != fixture["base_tokens"], "the adapter should change the tokens"
    for rank, rank_results in enumerate(results[world]):
        assert rank_results[name][0] == peft_tokens, f"rank {rank}"


def test_fan_in_fan_out_adapter_is_the_same_adapter(fixture, results):
    assert results[1][0]["fifo"][0] == fixture["plain"][1]


def test_quantized_base_with_float_adapter_is_close_to_float(results):
    """int8 base, float adapter: the adapter changes the int8 run as it changes the float one (mean |logit change|
    about 2.8 here), and int8 moves the adapted logits about as much as the base's (0.05 vs 0.04)."""
    def mean_gap(a, b):
        return (results[1][0][a][1] - results[1][0][b][1]).abs().mean().item()

    quantization_error = mean_gap("base_int8", "base")
    assert mean_gap("plain_int8", "plain") < 2 * quantization_error
    assert mean_gap("plain_int8", "base_int8") > 20 * quantization_error  # the adapter is applied


@pytest.mark.parametrize("world", [1, 2])
def test_base_and_two_adapters_in_one_batch_equal_their_own_runs(fixture, results, world):
    """lora_modules: rows of the base and of two adapters decode together (the same prompt under different
    adapters too), rows leave and others join: each request's tokens are PEFT's (or transformers') alone."""
    alone = {0: fixture["base_tokens"], **{i: fixture[name][1] for i, name in enumerate(MODULES, start=1)}}
    for rank, rank_results in enumerate(results[world]):
        for (prompt, adapter, steps), tokens in zip(MIXED, rank_results["mixed"]):
            assert tokens == alone[adapter][prompt][:steps], f"rank {rank}, adapter {adapter}, prompt {prompt}"


@pytest.fixture(scope="module")
def served(fixture):
    from accessory.model.meta import MetaModel

    modules = {name: fixture["root"] / name for name in MODULES}
    return MetaModel.from_pretrained(fixture["ckpt"], max_seq_len=128, lora_modules=modules, max_batch_size=4)


def service_texts(model, jobs: list[tuple[int, int]], prompts) -> list[str]:
    """The texts of (prompt, adapter) completions submitted together to a GenerationService, then run."""
    from accessory.serve.service import GenerationService

    service = GenerationService(model)
    handles = [service.submit_prompts([prompts[p]], {"max_gen_len": GEN_STEPS, "temperature": 0.0}, adapter=a)
               for p, a in jobs]
    service.shutdown()
    service.run()
    return [[event.text for event in handle][-1] for handle in handles]


def test_service_batches_adapters_as_requests_alone(fixture, served):
    jobs = [(0, 0), (0, 1), (0, 2), (1, 2)]
    together = service_texts(served, jobs, fixture["prompts"])
    assert together == [service_texts(served, [job], fixture["prompts"])[0] for job in jobs]
    assert len(set(together[:3])) == 3, "the same prompt under the base and two adapters"


def test_http_models_lists_adapters_and_refuses_unknown_names(served):
    from fastapi.testclient import TestClient

    from accessory.serve.api import create_app
    from accessory.serve.service import GenerationService

    service = GenerationService(served)
    client = TestClient(create_app(service, "tiny"))
    cards = client.get("/v1/models").json()["data"]
    assert [(card["id"], card.get("parent")) for card in cards] == [("tiny", None), ("plain", "tiny"),
                                                                    ("rslora", "tiny")]
    assert client.get("/v1/models/rslora").json()["parent"] == "tiny"
    answer = client.post("/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 2})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    assert "plain" in answer.json()["error"]["message"]
    service.shutdown()
    service.run()


def edited_adapter(root: Path, name: str, config: dict = None, tensors: dict = None) -> Path:
    """A copy of the plain adapter with adapter_config.json entries and tensors replaced."""
    from safetensors.torch import load_file, save_file

    folder = root / name
    if not folder.exists():
        shutil.copytree(root / "plain", folder)
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **(config or {})}))
        weights = load_file(folder / "adapter_model.safetensors")
        save_file({**weights, **(tensors or {})}, folder / "adapter_model.safetensors")
    return folder


LM_HEAD = "base_model.model.lm_head.lora_A.weight"
REFUSED = {  # name -> (config changes, tensors added, words the error must hold)
    "dora": ({"use_dora": True}, {}, "use_dora"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, {}, "modules_to_save"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, {}, "rank_pattern"),
    "bias": ({"bias": "all"}, {}, "bias"),
    "lm_head": ({}, {LM_HEAD: torch.zeros(4, 96)}, LM_HEAD),
    "other_model": ({"r": 8}, {}, "do not fit the base model"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_peft_can_do_but_we_cannot_is_refused_by_name(fixture, case):
    from accessory.checkpoint.peft_adapter import read_adapter
    from accessory.errors import AccessoryError
    from accessory.network.LLM.llama import ModelArgs

    config, tensors, words = REFUSED[case]
    folder = edited_adapter(fixture["root"], case, config, tensors)
    with pytest.raises(AccessoryError, match=words.replace(".", r"\.")) as error:
        read_adapter(folder, ModelArgs(**CONFIG))
    assert str(folder) in str(error.value)


def test_refused_at_load_before_generating(fixture):
    from accessory.errors import ConfigError
    from accessory.model.meta import MetaModel

    with pytest.raises(ConfigError, match="use_dora"):
        MetaModel.from_pretrained(fixture["ckpt"], max_seq_len=128,
                                  lora=edited_adapter(fixture["root"], "dora", {"use_dora": True}))
    with pytest.raises(ConfigError, match="compile"):
        MetaModel.from_pretrained(fixture["ckpt"], lora_modules={"a": fixture["root"] / "plain"}, compile=True)


def test_lora_flags_parse_as_vllm_spells_them():
    from accessory.cli import build_parser

    args = build_parser().parse_args(["serve", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--lora", "/a/x"])
    assert (args.lora_modules, args.lora) == ([("sql", "/a/sql"), ("chat", "/a/chat")], "/a/x")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "sql"])
