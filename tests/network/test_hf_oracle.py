"""Independent oracle: the same tiny weights run through HF transformers' LlamaForCausalLM give our logits within
1e-4 and the same greedy tokens; and `accessory convert hf` of that HF folder loads to the same model. Pins RoPE
(interleaved vs rotate-half, linear and llama3 scaling), GQA, tied embeddings, RMSNorm and SwiGLU."""
from __future__ import annotations

import pytest
import torch

from tiny import TINY_CONFIGS, greedy_ids, tiny_state_dict

GEN_STEPS = 32
PROMPT = "The quick brown fox jumps over"


def hf_model(config: dict):
    """LlamaForCausalLM holding tiny_state_dict(config), q/k permuted into HF's rotate-half layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from accessory.checkpoint.importers.hf import HF_TO_META, meta_to_hf_qk
    from accessory.network.LLM.llama import ModelArgs

    args = ModelArgs(**config)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, float):
        scaling = {"rope_type": "linear", "factor": scaling}
    hf_config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.tie_word_embeddings,
        rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": args.rope_theta})
    ours = tiny_state_dict(config)
    hf_state = {}
    for i in range(args.n_layers):
        for hf_name, name in HF_TO_META.items():
            hf_name, name = hf_name.format(i=i), name.format(i=i)
            if name in ours:
                weight = ours[name]
                if name.endswith("wq.weight"):
                    weight = meta_to_hf_qk(weight, args.n_heads)
                elif name.endswith("wk.weight"):
                    weight = meta_to_hf_qk(weight, args.n_kv_heads)
                hf_state[hf_name] = weight
    model = LlamaForCausalLM(hf_config).eval()
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or args.tie_word_embeddings)
    return model


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat([tokens, model(tokens).logits[:, -1:].argmax(-1)], dim=1)
    return tokens[0, len(ids):].tolist()


def converted_hf_models(names, build, root, tokenizer, prompts: list[list[int]], steps: int) -> dict:
    """name -> (the HF model `build(name, folder, tokenizer)` saved, the folder `accessory convert hf` made of it at
    2 shards, transformers' greedy tokens of each prompt)."""
    from accessory.checkpoint.convert import convert

    out = {}
    for name in names:
        model = build(name, root / f"{name}-hf", tokenizer)
        folder = convert("hf", root / f"{name}-hf", root / name, shards=2)
        out[name] = (model, folder, [hf_greedy(model, ids, steps) for ids in prompts])
    return out


def our_logits_and_tokens(folder):
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    ids = model.tokenizer.encode(PROMPT, bos=True, eos=False)
    [tokens] = greedy_ids(model, [ids], GEN_STEPS)
    return ids, model.llma(torch.tensor([ids]))[0], tokens


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_matches_hf_transformers(name, tiny_checkpoints):
    ids, logits, tokens = our_logits_and_tokens(tiny_checkpoints[name, 1])
    hf = hf_model(TINY_CONFIGS[name])
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0]
    assert (logits - hf_logits).abs().max().item() < 1e-4
    assert tokens == hf_greedy(hf, ids, GEN_STEPS)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_convert_hf_folder_loads_the_same_model(name, tiny_checkpoints, tmp_path, llama_tokenizer):
    from accessory.cli import main

    hf_dir = tmp_path / "hf"
    hf_model(TINY_CONFIGS[name]).save_pretrained(hf_dir)
    (hf_dir / "tokenizer.model").write_bytes(llama_tokenizer.read_bytes())
    main(["convert", "hf", str(hf_dir), str(tmp_path / "converted"), "--shards", "2"])
    _, converted_logits, converted_tokens = our_logits_and_tokens(tmp_path / "converted")
    _, logits, tokens = our_logits_and_tokens(tiny_checkpoints[name, 1])
    assert (converted_logits - logits).abs().max().item() < 1e-5
    assert converted_tokens == tokens


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_repetition_penalty_matches_hf_generate(name, tiny_checkpoints):
    """Greedy decoding with a repetition penalty: the same tokens as HF's RepetitionPenaltyLogitsProcessor gives."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(tiny_checkpoints[name, 1], max_seq_len=128)
    prompts = [model.tokenizer.encode(p, bos=True, eos=False) for p in (PROMPT, "A B A B A B A B")]
    ours = greedy_ids(model, prompts, GEN_STEPS, repetition_penalty=1.5)
    assert ours != greedy_ids(model, prompts, GEN_STEPS), "the penalty should change something"
    hf = hf_model(TINY_CONFIGS[name])
    for ids, tokens in zip(prompts, ours):
        out = hf.generate(torch.tensor([ids]), do_sample=False, repetition_penalty=1.5, max_new_tokens=GEN_STEPS,
                          min_new_tokens=GEN_STEPS, pad_token_id=0)
        assert out[0, len(ids):].tolist() == tokens
