"""Compile once, run many (generation/packaged_decode.py): the CPU's compiled decode step is an AOTInductor package in
the cache that a second process loads instead of compiling; it decodes as eager decoding does (the same logits and
tokens); a model whose code differs (another quantized format) gets packages of its own, while new weights of the
same shapes reuse the package (it computes with the live model's weights); a corrupt package is reported and
compiled again; and `accessory compile` makes the packages ahead of time.

Each process is a real subprocess with an $ACCESSORY_CACHE of the tests' own (the float and int8 tests share one, so
the float packages are compiled once for both; `accessory compile` starts from an empty one); its `kernels` folder
links to this process's, so the CPU kernels are not built again (the link is followed, and the folder it reaches is
still private)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import TINY_CONFIGS, tiny_state_dict

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="compiling the decode step needs a C++ compiler")

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Hi", "The quick brown fox"]

# One process: the compiled model's decode step against eager decoding on the same KV cache (logits), and its
# greedy tokens against an eager model's, at 1 row and, with two prompts, at 2 rows. Prints what the step made.
# The logits are compared at as many rows as there are prompts.
PROCESS = """
import json, logging, sys, torch
from accessory.model.meta import MetaModel
from accessory.network.components import decode_mask

logging.basicConfig(level=logging.INFO)
folder, quant, prompts = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3])
compiled = MetaModel.from_pretrained(folder, max_seq_len=256, compile=True, quant=quant)
eager = MetaModel.from_pretrained(folder, max_seq_len=256, quant=quant)
for model in (compiled, eager):
    model.stop_ids = set()
same_tokens = all(compiled.generate(prompts[:n], max_gen_len=8) == eager.generate(prompts[:n], max_gen_len=8)
                  for n in range(1, len(prompts) + 1))
model, step = compiled.llma, compiled.engine.decode_step
torch.manual_seed(0)
with torch.inference_mode():
    model.setup_caches(3, 256)
    caches = [layer.attention.cache for layer in model.layers]
    for cache in caches:
        cache.k.normal_(), cache.v.normal_()
    saved = [(cache.k.clone(), cache.v.clone()) for cache in caches]
    tokens, positions = torch.tensor([5, 900][:len(prompts)]), torch.tensor([7, 30][:len(prompts)])
    packaged = step(tokens, positions, decode_mask(positions, 256))
    for cache, (k, v) in zip(caches, saved):
        cache.k.copy_(k), cache.v.copy_(v)
    reference = model.decode(tokens, positions, decode_mask(positions, 256))
print(json.dumps({"builds": step.builds, "loads": step.loads, "fallback": step.fallback is not None,
                  "same_tokens": same_tokens, "logits_error": (packaged - reference).abs().max().item(),
                  "logits_scale": reference.abs().max().item()}))
"""


def new_cache(root: Path) -> Path:
    """An empty $ACCESSORY_CACHE under `root` for the subprocesses, its kernels this process's."""
    from accessory.cache_dir import cache_dir
    from accessory.kernels.build import cpu_kernels

    assert cpu_kernels()
    cache = root / "cache"
    cache.mkdir(mode=0o700)
    (cache / "kernels").symlink_to(cache_dir() / "kernels")
    return cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache for the tests of the float and int8 packages: each AOT compilation costs tens of seconds, so the
    float packages the first run compiles are compiled once for both (the int8 test needs only their key)."""
    return new_cache(tmp_path_factory.mktemp("compiled"))


def run_process(cache: Path, folder: Path, quant: str = "", prompts=PROMPTS) -> dict:
    env = dict(os.environ, ACCESSORY_CACHE=str(cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROCESS, str(folder), quant, json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["log"] = done.stderr
    return result


def packages(cache: Path) -> dict[str, list[str]]:
    """{key: its package names} in the cache."""
    return {key.name: sorted(p.name for p in key.glob("*.pt2")) for key in sorted((cache / "compiled").iterdir())}


def assert_decodes_as_eager(result: dict) -> None:
    assert not result["fallback"], result["log"][-3000:]
    assert result["same_tokens"]
    assert result["logits_error"] <= 1e-4 * result["logits_scale"], result


def checkpoint(root: Path, tokenizer: Path, seed: int) -> Path:
    from accessory.checkpoint.save import save_checkpoint

    config = TINY_CONFIGS["gqa"]
    shutil.copy(tokenizer, root / "tokenizer.model")
    return save_checkpoint(root / f"gqa-{seed}", tiny_state_dict(config, seed), config, 1, [root / "tokenizer.model"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory, llama_tokenizer) -> dict[int, Path]:
    """{seed: a tiny GQA checkpoint}: two sets of weights of the same shapes."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {seed: checkpoint(root, llama_tokenizer, seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def first_float_run(cache, folders) -> tuple[dict, dict[str, list[str]]]:
    """The first --compile process of the float model in the empty cache, and the packages it left there."""
    return run_process(cache, folders[0]), packages(cache)


def test_a_second_process_loads_the_package_and_decodes_as_eager(cache, folders, first_float_run):
    """The first process compiles a package for one row and one for several; the second compiles nothing and
    loads both; both decode as eager decoding does. New weights of the same shapes (another seed) load the same
    packages and decode as eager decoding does with those weights."""
    first, made = first_float_run
    assert_decodes_as_eager(first)
    assert (first["builds"], first["loads"]) == (2, 0)
    assert "compiled the decode step for rows 1 into" in first["log"]
    [(key, names)] = made.items()
    assert names == ["rows-1-1.pt2", "rows-2-16.pt2"]

    second = run_process(cache, folders[0])
    assert_decodes_as_eager(second)
    assert (second["builds"], second["loads"]) == (0, 2)
    assert "loaded the compiled decode step for rows 1 from" in second["log"]

    before = packages(cache)
    other_weights = run_process(cache, folders[1])
    assert_decodes_as_eager(other_weights)
    assert (other_weights["builds"], other_weights["loads"]) == (0, 2)
    assert packages(cache) == before and before[key] == names


def test_another_format_compiles_its_own_and_a_corrupt_package_is_compiled_again(cache, folders, first_float_run):
    """int8 weights are other code: a package under another key. A package cut short is reported, removed and
    compiled again, and the run's output is still right."""
    float_keys = set(first_float_run[1])
    int8 = run_process(cache, folders[0], quant="int8", prompts=PROMPTS[:1])
    assert_decodes_as_eager(int8)
    assert (int8["builds"], int8["loads"]) == (1, 0)
    [int8_key] = set(packages(cache)) - float_keys

    package = cache / "compiled" / int8_key / "rows-1-1.pt2"
    package.write_bytes(package.read_bytes()[:1000])
    again = run_process(cache, folders[0], quant="int8", prompts=PROMPTS[:1])
    assert_decodes_as_eager(again)
    assert f"the compiled decode step {package} does not load" in again["log"]
    assert (again["builds"], again["loads"]) == (1, 0)


def test_accessory_compile_makes_the_packages_a_run_loads(tmp_path, folders):
    """`accessory compile` compiles the packages for every row count up to --max_batch_size and prints them; a
    --compile run with the same model then compiles nothing and decodes as eager. (A cache of its own: the float
    packages made here.)"""
    cache = new_cache(tmp_path)
    env = dict(os.environ, ACCESSORY_CACHE=str(cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "accessory", "compile", "--pretrained_path", str(folders[0]),
                           "--max_seq_len", "256", "--max_batch_size", "4"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [(key, names)] = packages(cache).items()
    assert done.stdout.splitlines() == [f"key {key}: 2 compiled, 0 already there",
                                        *(str(cache / "compiled" / key / name) for name in names)]
    run = run_process(cache, folders[0])
    assert (run["builds"], run["loads"]) == (0, 2)
    assert_decodes_as_eager(run)  # (packages made ahead of time once swapped the step's tokens and positions)
