"""Checkpoint folders: every supported layout loads to the same model, and every bad folder gets an error that
names the file (or key) and what is wrong — before any weight is read where it can be."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from distributed import run_ranks
from tiny import TINY_CONFIGS


def logits_of(folder, **kwargs) -> torch.Tensor:
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=64, **kwargs)
    return model.llma(torch.tensor([[1, 415, 2936, 9060]]))


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "ckpt")


def shard_files(folder):
    return sorted(folder.glob("consolidated.*"))


# --- layouts that load -------------------------------------------------------------------------------------------

def test_meta_consolidated_pth_with_params_json(tiny_checkpoints, tmp_path):
    """Meta's release layout: consolidated.NN.pth (no `llma.` prefix, rope.freqs buffer) + params.json."""
    src = tiny_checkpoints["mha", 2]
    meta = tmp_path / "meta"
    meta.mkdir()
    for i, path in enumerate(shard_files(src)):
        tensors = {k.removeprefix("llma."): v for k, v in torch.load(path, weights_only=True).items()}
        tensors["rope.freqs"] = torch.zeros(4)
        torch.save(tensors, meta / f"consolidated.{i:02d}.pth")
    (meta / "params.json").write_text((src / "config.json").read_text())
    shutil.copy(src / "tokenizer.model", meta)
    assert torch.equal(logits_of(meta), logits_of(src))


def test_safetensors_shards_and_model_wrapper(tiny_checkpoints, tmp_path):
    from safetensors.torch import save_file

    src = tiny_checkpoints["gqa", 2]
    st, wrapped = copy_of(src, tmp_path), tmp_path / "wrapped"
    shutil.copytree(src, wrapped)
    for path in shard_files(st):
        tensors = torch.load(path, weights_only=True)
        save_file(tensors, path.with_suffix(".safetensors"))
        torch.save({"model": tensors}, wrapped / path.name)  # LLaMA2-Accessory's {"model": ...} wrapper
        path.unlink()
    assert torch.equal(logits_of(st), logits_of(src))
    assert torch.equal(logits_of(wrapped), logits_of(src))


def test_later_folders_override_earlier_ones(tiny_checkpoints, tmp_path):
    """pretrained_path as a list: a later folder's tensors (here, a finetuned norm) replace the earlier ones'."""
    base = tiny_checkpoints["mha", 1]
    delta = tmp_path / "delta"
    delta.mkdir()
    torch.save({"llma.norm.weight": torch.full((96,), 3.0)}, delta / "consolidated.00-of-01.model.pth")
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained([base, delta], max_seq_len=64)
    assert torch.equal(model.llma.norm.weight, torch.full((96,), 3.0))


def test_save_refuses_to_overwrite(tiny_checkpoints):
    from accessory.checkpoint.save import save_checkpoint
    from accessory.errors import CheckpointError

    folder = tiny_checkpoints["mha", 1]
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(folder, {}, TINY_CONFIGS["mha"], 1)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


# --- bad folders ---------------------------------------------------------------------------------------------------

def expect_error(folder, *fragments, **kwargs):
    from accessory.errors import AccessoryError

    with pytest.raises(AccessoryError) as info:
        logits_of(folder, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_missing_shard(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 3], tmp_path)
    (folder / "consolidated.01-of-03.model.pth").unlink()
    expect_error(folder, "missing shard file(s) ['consolidated.01-of-03.model.pth']", str(folder))


def test_shards_of_two_counts(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 3], tmp_path)
    shutil.copy(tiny_checkpoints["mha", 2] / "consolidated.00-of-02.model.pth", folder)
    expect_error(folder, "shards of different counts [2, 3]", "consolidated.00-of-02.model.pth")


def test_truncated_shard(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 2], tmp_path)
    shard = folder / "consolidated.01-of-02.model.pth"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    expect_error(folder, str(shard), "truncated or corrupt")


class RunsCode:
    def __reduce__(self):
        return (print, ("this pickle ran code",))


def test_pickle_that_would_run_code(tiny_checkpoints, tmp_path, capsys):
    folder = copy_of(tiny_checkpoints["mha", 1], tmp_path)
    shard = folder / "consolidated.00-of-01.model.pth"
    tensors = torch.load(shard, weights_only=True)
    torch.save({**tensors, "llma.payload": RunsCode()}, shard)
    expect_error(folder, str(shard), "refusing to load", "could run code")
    assert "this pickle ran code" not in capsys.readouterr().out


def test_unknown_config_key(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_experts": 8}))
    expect_error(folder, str(folder / "config.json"), "unknown model config key(s) ['n_experts']")


def test_unknown_key_in_explicit_llama_config(tiny_checkpoints, tmp_path):
    extra = tmp_path / "override.json"
    extra.write_text(json.dumps({"rope_thetaa": 1.0}))
    expect_error(tiny_checkpoints["mha", 1], str(extra), "['rope_thetaa']", llama_config=[extra])


def test_fewer_heads_than_ranks(tiny_checkpoints, tmp_path):
    """1 head at 2 ranks: every rank raises the same error, naming both numbers, before reading weights."""
    folder = copy_of(tiny_checkpoints["mha", 1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dim": 80, "n_heads": 1, "n_kv_heads": 1}))
    for shard in shard_files(folder):
        shard.write_bytes(b"not read")  # proves no weight is read before the check
    errors = run_ranks(2, logits_of, folder)
    for error in errors:
        assert "n_heads (1) is less than the model-parallel size (2)" in str(error), error


def test_key_missing_from_checkpoint(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 2], tmp_path)
    for shard in shard_files(folder):
        tensors = torch.load(shard, weights_only=True)
        del tensors["llma.layers.1.feed_forward.w2.weight"]
        torch.save(tensors, shard)
    expect_error(folder, "lacks 1 tensor(s)", "layers.1.feed_forward.w2.weight")


def test_unexpected_key_in_checkpoint(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 1], tmp_path)
    shard = folder / "consolidated.00-of-01.model.pth"
    torch.save({**torch.load(shard, weights_only=True), "llma.visual.proj.weight": torch.zeros(2)}, shard)
    expect_error(folder, "does not use", "visual.proj.weight")


def test_shape_that_does_not_match_config(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 2], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_dim": 120}))
    expect_error(folder, "layers.0.feed_forward.w1.weight", "do not assemble into the model's shape [120, 96]")


def test_unknown_llama_type(tiny_checkpoints, tmp_path):
    folder = copy_of(tiny_checkpoints["mha", 1], tmp_path)
    (folder / "meta.json").write_text(json.dumps({"llama_type": "llama_moe"}))
    expect_error(folder, str(folder / "meta.json"), "unknown llama_type 'llama_moe'",
                 "['llama', 'llama_peft', 'llava', 'qwen2', 'qwen3', 'mistral', 'gemma3', 'mixtral', 'qwen3_moe']")
    expect_error(tiny_checkpoints["mha", 1], "llama_type argument", "'llama_moe'", llama_type="llama_moe")


def load_with_rank1_read_error(folder):
    """Rank 1's reads fail (as a bad disk or an out-of-memory on one node would); rank 0's succeed."""
    import torch.distributed as dist

    import accessory.checkpoint.load as load

    if dist.get_rank() == 1:
        def failing_copy(*args):
            raise OSError("Input/output error reading shard")
        load.copy_slice = failing_copy
    return logits_of(folder)


def test_one_rank_failing_to_load_fails_every_rank(tiny_checkpoints):
    """Rank 1 fails while loading: it raises its own error, rank 0 raises one naming rank 1; neither hangs."""
    errors = run_ranks(2, load_with_rank1_read_error, tiny_checkpoints["mha", 2])
    assert "model-parallel rank 1 failed: OSError: Input/output error reading shard" in str(errors[0])
    assert isinstance(errors[1], OSError)


def test_explicit_tokenizer_path_wins(tiny_checkpoints, tmp_path, llama_tokenizer):
    folder = copy_of(tiny_checkpoints["mha", 1], tmp_path)
    (folder / "tokenizer.model").unlink()
    expect_error(folder, "no tokenizer.model or tokenizer.json", "pass tokenizer_path")
    assert torch.equal(logits_of(folder, tokenizer_path=llama_tokenizer), logits_of(tiny_checkpoints["mha", 1]))
