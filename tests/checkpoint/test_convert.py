"""`accessory convert` in every direction and `accessory inspect`, with transformers and direct loads as oracles.

- hf -> accessory (2 shards) -> hf: the final folder loads in transformers (LlamaForCausalLM and AutoTokenizer) and
  gives the original's logits; untied with llama3 RoPE, tied with linear RoPE, and a sharded safetensors index.
- meta -> accessory: a Meta release folder split as Meta splits gives the same logits as loading it directly.
- dcp -> accessory: a torch.distributed.checkpoint save of a state dict gives the source model's logits.
- inspect: the facts of a healthy checkpoint; a truncated shard, a missing key and inconsistent shard shapes each
  exit 1 naming the file and the key.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tiny import TINY_CONFIGS, tiny_state_dict

IDS = [[1, 415, 2936, 9060, 285, 1142, 754, 272]]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! 123", "ünïcödé and emoji 😀"]
DIM, N_HEADS, N_KV_HEADS, HIDDEN = 64, 4, 2, 96
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def cli(*argv) -> None:
    from accessory.cli import main
    main([str(a) for a in argv])


def our_logits(folder) -> torch.Tensor:
    from accessory.model.meta import MetaModel
    return MetaModel.from_pretrained(folder, max_seq_len=64).llma(torch.tensor(IDS))


def tiny_hf(tied: bool, rope_scaling: dict):
    """A random LlamaForCausalLM with GQA and LLaMA's 32000-token vocabulary (for the real tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=2, num_attention_heads=N_HEADS,
                         num_key_value_heads=N_KV_HEADS, vocab_size=32000, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(rope_scaling),
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at ones: randomize everything so a swapped name cannot pass
        for p in model.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied, rope, shard_size", [
    (False, LLAMA3, None),
    (True, {"rope_type": "linear", "factor": 2.0}, "1MB"),
], ids=["untied-llama3", "tied-linear-sharded"])
def test_hf_to_accessory_to_hf_round_trip(tmp_path, llama_tokenizer, tied, rope, shard_size):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from accessory.text.tokenizer import Tokenizer

    original = tiny_hf(tied, rope)
    original.save_pretrained(tmp_path / "hf")
    shutil.copy(llama_tokenizer, tmp_path / "hf" / "tokenizer.model")
    cli("convert", "hf", tmp_path / "hf", tmp_path / "acc", "--shards", 2)
    cli("convert", "accessory", tmp_path / "acc", tmp_path / "back", "--to", "hf",
        *(["--max_shard_size", shard_size] if shard_size else []))
    back = tmp_path / "back"
    assert (back / "model.safetensors.index.json").is_file() == bool(shard_size)
    assert ("lm_head.weight" in json.dumps(sorted(_hf_names(back)))) != tied

    loaded = LlamaForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        expected, got = original(torch.tensor(IDS)).logits, loaded(torch.tensor(IDS)).logits
    assert (expected - got).abs().max().item() < 1e-5
    assert loaded.config.tie_word_embeddings == tied and loaded.config.num_key_value_heads == N_KV_HEADS
    assert loaded.config.rope_parameters["rope_type"] == rope["rope_type"]
    assert (our_logits(tmp_path / "acc") - expected).abs().max().item() < 1e-4  # our runtime agrees too

    theirs, ours = AutoTokenizer.from_pretrained(back), Tokenizer.from_path(llama_tokenizer)
    for text in TEXTS:
        assert theirs(text).input_ids == ours.encode(text, bos=True, eos=False), text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)


def _hf_names(folder) -> list[str]:
    from safetensors import safe_open
    names = []
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names += list(f.keys())
    return names


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_config_to_hf_inverts_config_from_hf(name):
    """The two halves of the HF adapter are one mapping: ours -> HF -> ours is the identity on the model."""
    from accessory.checkpoint.importers.hf import config_from_hf, config_to_hf
    from accessory.network.LLM.llama import ModelArgs

    config = TINY_CONFIGS[name]
    back = ModelArgs(**config_from_hf(config_to_hf(config, torch.float32), "test"))
    args = ModelArgs(**config)
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "norm_eps",
                  "rope_theta", "tie_word_embeddings", "max_seq_len"):
        assert getattr(back, field) == getattr(args, field), field
    scaling = config["rope_scaling"]
    assert back.rope_scaling == ({"rope_type": "linear", "factor": scaling} if isinstance(scaling, float)
                                 else scaling)


# --- Meta's release -----------------------------------------------------------------------------------------------

# How Meta's reference code splits each tensor across model-parallel ranks (fairscale): column-parallel by rows,
# row-parallel by columns; the embedding by features (LLaMA-1/2) or by vocabulary (LLaMA-3); norms replicated.
META_SPLIT = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}


def write_meta_release(folder, config: dict, state_dict: dict, shards: int, tokenizer, embedding_dim: int) -> None:
    folder.mkdir()
    split = {**META_SPLIT, "tok_embeddings": embedding_dim}
    for rank in range(shards):
        part = {"rope.freqs": torch.zeros(4)}  # LLaMA-1/2 shards carry the RoPE table; it is recomputed
        for key, tensor in state_dict.items():
            dim = split.get(key.split(".")[-2])
            part[key] = tensor if dim is None else tensor.chunk(shards, dim)[rank].clone()
        torch.save(part, folder / f"consolidated.{rank:02d}.pth")
    (folder / "params.json").write_text(json.dumps({**config, "vocab_size": -1}))  # -1 as Meta's LLaMA-2 says
    shutil.copy(tokenizer, folder / "tokenizer.model")


@pytest.mark.parametrize("embedding_dim", [1, 0], ids=["llama2-split", "llama3-split"])
def test_meta_release_to_accessory_and_hf(tmp_path, llama_tokenizer, embedding_dim):
    from transformers import LlamaForCausalLM

    config = dict(TINY_CONFIGS["mha"], hidden_dim=96)  # 96: Meta's split needs an even FFN size
    write_meta_release(tmp_path / "meta", config, tiny_state_dict(config), 2, llama_tokenizer, embedding_dim)
    cli("convert", "meta", tmp_path / "meta", tmp_path / "acc", "--shards", 3)
    assert sorted(p.name for p in (tmp_path / "acc").glob("consolidated.*")) == [
        f"consolidated.{i:02d}-of-03.model.pth" for i in range(3)]
    assert json.loads((tmp_path / "acc" / "config.json").read_text())["vocab_size"] == 32000
    direct = our_logits(tmp_path / "meta")
    assert torch.equal(our_logits(tmp_path / "acc"), direct)
    # Straight to HF as well (any source reaches any target): transformers gives the same logits.
    cli("convert", "meta", tmp_path / "meta", tmp_path / "hf", "--to", "hf")
    with torch.no_grad():
        hf_logits = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(torch.tensor(IDS)).logits
    assert (hf_logits - direct).abs().max().item() < 1e-4


# --- torch.distributed.checkpoint ---------------------------------------------------------------------------------

def test_dcp_to_accessory(tmp_path, llama_tokenizer):
    import torch.distributed.checkpoint as dcp

    from accessory.checkpoint.save import save_checkpoint

    config = TINY_CONFIGS["gqa"]
    state_dict = tiny_state_dict(config)
    tokenizer = shutil.copy(llama_tokenizer, tmp_path / "tokenizer.model")
    reference = save_checkpoint(tmp_path / "ref", state_dict, config, 1, [tokenizer])
    saved = {**{f"model.{k}": v for k, v in state_dict.items()}, "optimizer.step": torch.tensor(7)}
    dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # one process, no process group
    (tmp_path / "config.json").write_text(json.dumps(config))
    cli("convert", "dcp", tmp_path / "dcp", tmp_path / "acc", "--shards", 2,
        "--llama_config", tmp_path / "config.json", "--tokenizer_path", llama_tokenizer)
    assert torch.equal(our_logits(tmp_path / "acc"), our_logits(reference))


def test_dcp_wrong_shape_is_named(tmp_path, llama_tokenizer):
    import torch.distributed.checkpoint as dcp

    from accessory.errors import CheckpointError

    config = TINY_CONFIGS["gqa"]
    state_dict = tiny_state_dict(config)
    state_dict["layers.1.attention.wk.weight"] = state_dict["layers.1.attention.wk.weight"][:8]
    dcp.save(state_dict, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "dcp" / "config.json").write_text(json.dumps(config))
    shutil.copy(llama_tokenizer, tmp_path / "dcp" / "tokenizer.model")
    from accessory.checkpoint.convert import convert
    with pytest.raises(CheckpointError, match=r"layers\.1\.attention\.wk\.weight: \(8, 96\), expected \(16, 96\)"):
        convert("dcp", tmp_path / "dcp", tmp_path / "acc", 1)
    assert not (tmp_path / "acc").exists()


# --- refusals -----------------------------------------------------------------------------------------------------

def test_convert_refusals(tmp_path, tiny_checkpoints):
    from accessory.checkpoint.convert import convert
    from accessory.errors import CheckpointError

    src = tiny_checkpoints["gqa", 2]
    with pytest.raises(CheckpointError, match="already exists"):
        convert("accessory", src, src, target="hf")
    with pytest.raises(CheckpointError, match="accessory reshard"):
        convert("accessory", src, tmp_path / "out")
    with pytest.raises(CheckpointError, match="not tensor-parallel"):
        convert("accessory", src, tmp_path / "out", 2, target="hf")
    with pytest.raises(CheckpointError, match="holds accessory shards, not meta ones"):
        convert("meta", src, tmp_path / "out")
    with pytest.raises(CheckpointError, match="carries its own config"):
        convert("hf", src, tmp_path / "out", llama_type="llama")
    assert not (tmp_path / "out").exists()


# --- inspect ------------------------------------------------------------------------------------------------------

def inspect_cli(path, capsys) -> tuple[int, str]:
    code = 0
    try:
        cli("inspect", path)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


def test_inspect_healthy(tiny_checkpoints, capsys):
    from accessory.checkpoint.inspect import inspect_checkpoint

    folder = tiny_checkpoints["mha", 3]
    code, out = inspect_cli(folder, capsys)
    assert code == 0 and "integrity:   OK" in out
    report = inspect_checkpoint(folder).to_dict()
    config = TINY_CONFIGS["mha"]
    per_layer = 4 * 96 * 96 + 3 * 96 * 100 + 2 * 96  # wq wk wv wo (MHA), w1 w2 w3, two norms
    assert report["parameters"] == 2 * 32000 * 96 + 96 + 2 * per_layer  # embeddings + output (untied), norm
    assert (report["format"], report["shards"], report["dtypes"], report["llama_type"]) == (
        "accessory", 3, ["float32"], "llama")
    assert report["config"]["n_heads"] == config["n_heads"] and report["config"]["hidden_dim"] == 100
    assert report["tokenizer"] == {"file": "tokenizer.model", "kind": "sentencepiece", "vocab_size": 32000,
                                   "bos_id": 1, "eos_id": 2, "chat_template": False}
    assert report["healthy"] and not report["problems"]
    cli("inspect", folder, "--json")
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))


def _broken_copy(tiny_checkpoints, tmp_path):
    folder = shutil.copytree(tiny_checkpoints["mha", 2], tmp_path / "ckpt")
    return folder, folder / "consolidated.00-of-02.model.pth", folder / "consolidated.01-of-02.model.pth"


def test_inspect_truncated_shard(tiny_checkpoints, tmp_path, capsys):
    folder, _, second = _broken_copy(tiny_checkpoints, tmp_path)
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])
    code, out = inspect_cli(folder, capsys)
    assert code == 1 and f"{second}: cannot be read" in out and "truncated or corrupt" in out


def test_inspect_missing_key(tiny_checkpoints, tmp_path, capsys):
    folder, first, second = _broken_copy(tiny_checkpoints, tmp_path)
    for shard in (first, second):
        tensors = torch.load(shard, weights_only=True)
        del tensors["llma.layers.1.feed_forward.w3.weight"]
        torch.save(tensors, shard)
    code, out = inspect_cli(folder, capsys)
    assert code == 1 and "lacks 1 tensor(s) the model needs: layers.1.feed_forward.w3.weight" in out


def test_inspect_key_in_one_shard_only(tiny_checkpoints, tmp_path, capsys):
    folder, _, second = _broken_copy(tiny_checkpoints, tmp_path)
    tensors = torch.load(second, weights_only=True)
    del tensors["llma.norm.weight"]
    torch.save(tensors, second)
    code, out = inspect_cli(folder, capsys)
    assert code == 1 and f"{second}: holds other tensors than consolidated.00-of-02.model.pth: " \
                         f"missing [norm.weight], extra []" in out


def test_inspect_inconsistent_shapes(tiny_checkpoints, tmp_path, capsys):
    folder, _, second = _broken_copy(tiny_checkpoints, tmp_path)
    tensors = torch.load(second, weights_only=True)
    tensors["llma.layers.0.attention.wq.weight"] = tensors["llma.layers.0.attention.wq.weight"][:40].clone()
    torch.save(tensors, second)
    code, out = inspect_cli(folder, capsys)
    assert code == 1 and "tensor 'layers.0.attention.wq.weight': shard shape(s) [48, 96], [40, 96] do not " \
                         "assemble into the model's shape [96, 96]" in out


def test_inspect_dcp_and_hf(tmp_path, llama_tokenizer, capsys):
    import torch.distributed.checkpoint as dcp

    from accessory.checkpoint.inspect import inspect_checkpoint

    config = TINY_CONFIGS["gqa"]
    dcp.save({f"llma.{k}": v for k, v in tiny_state_dict(config).items()}, checkpoint_id=str(tmp_path / "dcp"),
             no_dist=True)
    (tmp_path / "dcp" / "config.json").write_text(json.dumps(config))
    shutil.copy(llama_tokenizer, tmp_path / "dcp" / "tokenizer.model")
    report = inspect_checkpoint(tmp_path / "dcp")
    assert report.format == "dcp" and not report.problems and report.dtypes == ["float32"]
    assert report.parameters == sum(t.numel() for t in tiny_state_dict(config).values())
    data = next((tmp_path / "dcp").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    code, out = inspect_cli(tmp_path / "dcp", capsys)
    assert code == 1 and f"{data}: 100 bytes; the metadata reads up to byte" in out

    tiny_hf(True, LLAMA3).save_pretrained(tmp_path / "hf")
    shutil.copy(llama_tokenizer, tmp_path / "hf" / "tokenizer.model")
    report = inspect_checkpoint(tmp_path / "hf")
    assert report.format == "hf" and not report.problems and report.config["tie_word_embeddings"] is True


def test_dcp_truncated_data_file_is_named(tmp_path, llama_tokenizer):
    import torch.distributed.checkpoint as dcp

    from accessory.checkpoint.convert import convert
    from accessory.errors import CheckpointError

    config = TINY_CONFIGS["gqa"]
    dcp.save(tiny_state_dict(config), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "dcp" / "config.json").write_text(json.dumps(config))
    shutil.copy(llama_tokenizer, tmp_path / "dcp" / "tokenizer.model")
    data = next((tmp_path / "dcp").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'dcp'}: reading tensor '.*' failed"):
        convert("dcp", tmp_path / "dcp", tmp_path / "acc", 1)
    assert not (tmp_path / "acc").exists()
