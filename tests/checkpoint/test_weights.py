"""Weight tools on disk: delta extract / apply (and the delta loading stacked after its base), and reshard.

The oracle is the fine-tuned checkpoint itself: extracting a delta and applying it again must give back its tensors
(bit for bit with an fp32 delta over bf16 weights) and its logits, at any shard counts on either side.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from conftest import REPO
from tiny import TINY_CONFIGS, tiny_state_dict

TOKENS = [[1, 415, 2936, 9060, 338]]
BASE_BF16 = {}  # the base's full tensors, as saved (filled by the `tuned` fixture)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, llama_tokenizer):
    """bf16 base at 2 shards, and fine-tuned = base + small noise at 3 shards; (base, ft, ft's full tensors)."""
    from accessory.checkpoint.save import save_checkpoint

    root = tmp_path_factory.mktemp("weights")
    tokenizer = root / "tokenizer.model"
    tokenizer.write_bytes(llama_tokenizer.read_bytes())
    config, base = TINY_CONFIGS["mha"], tiny_state_dict(TINY_CONFIGS["mha"])
    BASE_BF16.update({key: value.to(torch.bfloat16) for key, value in base.items()})
    noise = torch.Generator().manual_seed(1)
    finetuned = {key: value + 0.02 * torch.randn(value.shape, generator=noise) for key, value in base.items()}
    base_dir = save_checkpoint(root / "base", base, config, 2, [tokenizer], dtype=torch.bfloat16)
    ft_dir = save_checkpoint(root / "ft", finetuned, config, 3, [tokenizer], dtype=torch.bfloat16)
    return base_dir, ft_dir, {key: value.to(torch.bfloat16) for key, value in finetuned.items()}


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a 1-shard folder, by Meta name."""
    [shard] = folder.glob("consolidated.00-of-01.*")
    return {key.removeprefix("llma."): value for key, value in torch.load(shard, weights_only=True).items()}


def logits_of(folders, **kwargs) -> torch.Tensor:
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(folders, max_seq_len=64, **kwargs).llma(torch.tensor(TOKENS))


def test_extract_then_apply_is_exact_with_an_fp32_delta(tuned, tmp_path):
    """base 2 shards, fine-tuned 3, delta 2 (the base's count), output 1: the fine-tuned tensors, bit for bit."""
    from accessory.checkpoint.delta import apply_delta, extract_delta

    base, ft, expected = tuned
    delta = extract_delta(base, ft, tmp_path / "delta", dtype=torch.float32)
    assert sorted(p.name for p in delta.glob("consolidated.*")) == [
        "consolidated.00-of-02.model-diff.pth", "consolidated.01-of-02.model-diff.pth"]
    out = apply_delta(base, delta, tmp_path / "out", shards=1)
    got = tensors_of(out)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == torch.bfloat16, key  # the base's dtype is kept
        assert torch.equal(got[key], value), key
    # config, meta.json and tokenizer come along, so both folders load on their own
    assert {p.name for p in delta.iterdir()} >= {"config.json", "meta.json", "tokenizer.model"}
    assert {p.name for p in out.iterdir()} >= {"config.json", "meta.json", "tokenizer.model"}


def test_bf16_delta_is_within_one_rounding(tuned, tmp_path):
    """A delta in the weights' own bf16: one rounding of the delta and one of the sum, no more."""
    from accessory.checkpoint.delta import apply_delta, extract_delta

    base, ft, expected = tuned
    delta = extract_delta(base, ft, tmp_path / "delta")
    assert all(t.dtype == torch.bfloat16 for t in torch.load(next(delta.glob("*.model-diff.pth"))).values())
    got = tensors_of(apply_delta(base, delta, tmp_path / "out", shards=1))
    step = 2.0 ** -8  # bf16 unit roundoff
    for key, f in expected.items():
        f, b, out = f.float(), BASE_BF16[key].float(), got[key].float()
        bound = step * ((f - b).abs() + f.abs()) * 1.001  # |delta error| <= u|f - b|, |sum error| <= u|f|
        assert ((out - f).abs() <= bound).all(), key
    assert any(not torch.equal(got[key], expected[key]) for key in expected)  # bf16 rounding did happen


def stacked_logits_match(base, delta, ft) -> bool:
    return torch.equal(logits_of([base, delta]), logits_of(ft))


def test_delta_loads_stacked_after_its_base(tuned, tmp_path):
    """from_pretrained([base, delta]) adds the delta: the fine-tuned logits, at 1 rank and at 2."""
    from accessory.checkpoint.delta import extract_delta

    base, ft, _ = tuned
    delta = extract_delta(base, ft, tmp_path / "delta", shards=3, dtype=torch.float32)
    assert stacked_logits_match(base, delta, ft)
    assert run_ranks(2, stacked_logits_match, base, delta, ft) == [True, True]
    assert not torch.equal(logits_of(base), logits_of(ft))  # the delta is not a no-op


def test_loader_and_apply_round_alike(tuned, tmp_path):
    """A bf16 delta loaded in bf16 gives the weights apply writes: both sum in float32 and round once."""
    from accessory.checkpoint.delta import apply_delta, extract_delta
    from accessory.model.meta import MetaModel

    base, ft, _ = tuned
    delta = extract_delta(base, ft, tmp_path / "delta")
    applied = apply_delta(base, delta, tmp_path / "out")
    stacked = MetaModel.from_pretrained([base, delta], max_seq_len=64, dtype="bf16").llma.state_dict()
    written = MetaModel.from_pretrained(applied, max_seq_len=64, dtype="bf16").llma.state_dict()
    assert all(torch.equal(stacked[key], written[key]) for key in written)


# --- keys, shapes and outputs that are refused -------------------------------------------------------------------

def rewrite_shards(folder: Path, edit) -> None:
    for shard in sorted(folder.glob("consolidated.*")):
        torch.save(edit(torch.load(shard, weights_only=True)), shard)


def copy_of(folder: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, dst))


def test_key_missing_is_named(tuned, tmp_path):
    from accessory.checkpoint.delta import apply_delta, extract_delta
    from accessory.errors import CheckpointError

    base, ft, _ = tuned
    partial = copy_of(ft, tmp_path / "partial")
    rewrite_shards(partial, lambda t: {k: v for k, v in t.items() if k != "llma.layers.1.attention.wk.weight"})
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\) of the base .*layers\.1\.attention\.wk\.weight"):
        extract_delta(base, partial, tmp_path / "delta")
    delta = extract_delta(base, ft, tmp_path / "delta")
    rewrite_shards(delta, lambda t: {k: v for k, v in t.items() if k != "llma.norm.weight"})
    with pytest.raises(CheckpointError, match=r"the delta lacks 1 tensor\(s\) of the base .*: norm\.weight"):
        apply_delta(base, delta, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_is_named(tuned, tmp_path):
    from accessory.checkpoint.delta import extract_delta
    from accessory.errors import CheckpointError

    base, ft, _ = tuned
    other = copy_of(ft, tmp_path / "other")
    rewrite_shards(other, lambda t: {**t, "llma.layers.0.ffn_norm.weight": t["llma.layers.0.ffn_norm.weight"][:90]})
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.0\.ffn_norm\.weight'.*\[90\].*\[96\]"):
        extract_delta(base, other, tmp_path / "delta")


def test_new_keys_carried_over(tuned, tmp_path):
    """A tensor only the fine-tuned checkpoint has (a LoRA factor, a bias) goes into the delta and the output as it
    is; its split is unknown to the llama type, so resharding it is refused by name."""
    from accessory.checkpoint.delta import apply_delta, extract_delta
    from accessory.errors import CheckpointError

    base, ft, _ = tuned
    extra = copy_of(ft, tmp_path / "extra")
    lora = {i: torch.full((4, 96), float(i)) for i in range(3)}
    for i, shard in enumerate(sorted(extra.glob("consolidated.*"))):
        torch.save({**torch.load(shard, weights_only=True), "llma.wq_lora_a.weight": lora[i]}, shard)
    with pytest.raises(CheckpointError, match=r"'wq_lora_a\.weight' is not a parameter .* resharded to 2"):
        extract_delta(base, extra, tmp_path / "refused")
    delta = extract_delta(base, extra, tmp_path / "delta", shards=3)
    out = apply_delta(base, delta, tmp_path / "out", shards=3)
    for i in range(3):
        shard = torch.load(out / f"consolidated.{i:02d}-of-03.model.pth", weights_only=True)
        assert torch.equal(shard["llma.wq_lora_a.weight"], lora[i])


def test_output_that_is_an_input_or_exists_is_refused(tuned, tmp_path):
    from accessory.checkpoint.delta import extract_delta
    from accessory.checkpoint.reshard import reshard
    from accessory.errors import CheckpointError

    base, ft, _ = tuned
    before = {p: p.stat().st_mtime_ns for p in ft.iterdir()}
    with pytest.raises(CheckpointError, match="is the input folder"):
        extract_delta(base, ft, ft)
    with pytest.raises(CheckpointError, match="is the input folder"):
        reshard(ft, ft / "inside", 1)
    with pytest.raises(CheckpointError, match="already exists"):
        reshard(ft, base, 1)
    assert {p: p.stat().st_mtime_ns for p in ft.iterdir()} == before


def test_interrupted_write_leaves_nothing(tuned, tmp_path, monkeypatch):
    """The second shard's write fails: no output folder, and no temporary folder left beside it."""
    from accessory.checkpoint.delta import extract_delta

    base, ft, _ = tuned
    real_save, calls = torch.save, []

    def failing_save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        extract_delta(base, ft, tmp_path / "delta")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


# --- reshard -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,counts", [("mha", (3, 2, 1)), ("gqa", (2, 4, 1))])
def test_reshard_chain_keeps_every_tensor(tiny_checkpoints, tmp_path, name, counts):
    """3 -> 2 -> 1 (uneven splits) and, with 2 KV heads, 2 -> 4 (KV heads copied) -> 1: the original tensors."""
    from accessory.checkpoint.reshard import reshard

    folder = tiny_checkpoints[name, counts[0]]
    for count in counts[1:]:
        folder = reshard(folder, tmp_path / f"{name}-{count}", count)
        assert len(list(folder.glob("consolidated.*"))) == count
    expected = tensors_of(tiny_checkpoints[name, 1])
    got = tensors_of(folder)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)
    assert torch.equal(logits_of(folder), logits_of(tiny_checkpoints[name, 1]))


def test_llama2_accessory_flags(tuned, tmp_path):
    """`python tools/weight_operate.py` with LLaMA2-Accessory's flags: extract (here with an fp32 delta), then
    apply with exactly its four flags, gives the fine-tuned model."""
    base, ft, _ = tuned
    delta, out = tmp_path / "delta", tmp_path / "out"
    for flags in (["--pretrained_path", base, "--delta_path", ft, "--output_path", delta, "--operate_type", "extract",
                   "--dtype", "fp32"],
                  ["--pretrained_path", base, "--delta_path", delta, "--output_path", out, "--operate_type", "apply"]):
        subprocess.run([sys.executable, str(REPO / "tools" / "weight_operate.py"), *map(str, flags)], check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True)
    assert len(list(out.glob("consolidated.*-of-02.model.pth"))) == 2  # the base's shard count
    assert torch.equal(logits_of(out), logits_of(ft))


def test_reshard_meta_layout(tiny_checkpoints, tmp_path):
    """Meta's consolidated.NN.pth (rope.freqs, params.json with vocab_size -1) resharded 2 -> 3: a plain
    checkpoint (rope.freqs dropped, the vocabulary taken from the tokenizer) with the same logits."""
    import json
    import shutil

    from accessory.checkpoint.reshard import reshard

    src, meta = tiny_checkpoints["mha", 2], tmp_path / "meta"
    meta.mkdir()
    for i, shard in enumerate(sorted(src.glob("consolidated.*"))):
        tensors = {k.removeprefix("llma."): v for k, v in torch.load(shard, weights_only=True).items()}
        torch.save({**tensors, "rope.freqs": torch.zeros(4)}, meta / f"consolidated.{i:02d}.pth")
    (meta / "params.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), "vocab_size": -1}))
    shutil.copy(src / "tokenizer.model", meta)
    out = reshard(meta, tmp_path / "out", 3)
    assert "llma.rope.freqs" not in torch.load(out / "consolidated.00-of-03.model.pth", weights_only=True)
    assert torch.equal(logits_of(out), logits_of(src))
