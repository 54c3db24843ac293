"""Compile once, run many (generation/packaged_steps.py): the CPU's compiled decode step, and speculative decoding's
verify step, are AOTInductor packages in the cache that `accessory compile` makes ahead of time, or a first run
compiles, and later processes load instead of compiling; they compute as eager steps do (the same logits and tokens);
a model whose code differs (another quantized format) gets packages of its own, while new weights of the same shapes
reuse them (they compute with the live model's weights); a corrupt package is reported and compiled again.

Each process is a real subprocess with an $ACCESSORY_CACHE of the tests' own (one for the module: the float packages
`accessory compile` makes are compiled once for every test); its `kernels` folder links to this process's, so the CPU
kernels are not built again (the link is followed, and the folder it reaches is still private)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tiny import TINY_CONFIGS, tiny_state_dict
from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="compiling the decode step needs a C++ compiler")

PROMPTS = ["Hi", "The quick brown fox"]

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}

# One process: the compiled model's decode step against eager decoding on the same KV cache (logits, at as many rows
# as there are prompts), and its greedy tokens against an eager model's, at 1 row and, with two prompts, at 2 rows;
# with a speculative config, its verify step of one row and 3 slots against eager verify too, and its tokens at one
# row only (several rows verify under torch.compile: tests/generation/test_speculative.py). Prints what its steps
# made or loaded.
PROCESS = """
import json, logging, sys, torch
from accessory.model.meta import MetaModel
from accessory.network.components import decode_mask
from accessory.network.kv_caches import KVCaches

logging.basicConfig(level=logging.INFO)
folder, quant, prompts, speculative = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3]), json.loads(sys.argv[4])
compiled = MetaModel.from_pretrained(folder, max_seq_len=256, compile=True, quant=quant, speculative_config=speculative)
eager = MetaModel.from_pretrained(folder, max_seq_len=256, quant=quant)
for model in (compiled, eager):
    model.stop_ids = set()
same_tokens = all(compiled.generate(prompts[:n], max_gen_len=8) == eager.generate(prompts[:n], max_gen_len=8)
                  for n in ([1] if speculative else range(1, len(prompts) + 1)))
model, engine = compiled.llma, compiled.engine

def error_of(step, reference, tokens, positions):
    with torch.inference_mode():
        caches = KVCaches.allocate(model, 3, 256)
        torch.manual_seed(0)
        for cache in caches.layers:
            cache.k.normal_(), cache.v.normal_()
        saved = [(cache.k.clone(), cache.v.clone()) for cache in caches.layers]
        packaged = step(tokens, positions, decode_mask(positions, 256), caches)
        for cache, (k, v) in zip(caches.layers, saved):
            cache.k.copy_(k), cache.v.copy_(v)
        expected = reference(tokens, positions, decode_mask(positions, 256), caches)
    return (packaged - expected).abs().max().item() / expected.abs().max().item()

steps = [engine.decode_step]
errors = [error_of(engine.decode_step, model.decode, torch.tensor([5, 900][:len(prompts)]),
                   torch.tensor([7, 30][:len(prompts)]))]
if speculative:
    steps.append(engine.verify_step)
    errors.append(error_of(engine.verify_step, model.verify, torch.tensor([[5, 900, 17]]), torch.tensor([[7, 8, 9]])))
print(json.dumps({"builds": sum(s.builds for s in steps), "loads": sum(s.loads for s in steps),
                  "reasons": [s.reason for s in steps], "same_tokens": same_tokens, "errors": errors}))
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
    """One cache for the module: each AOT compilation costs tens of seconds, so the float packages `accessory
    compile` makes are compiled once for every test (the int8 test needs only their key)."""
    return new_cache(tmp_path_factory.mktemp("compiled"))


def run_process(cache: Path, folder: Path, quant: str = "", prompts=PROMPTS, speculative=SPECULATIVE) -> dict:
    env = dict(os.environ, ACCESSORY_CACHE=str(cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROCESS, str(folder), quant, json.dumps(prompts),
                           json.dumps(speculative)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["log"] = done.stderr
    return result


def packages(cache: Path) -> dict[str, list[str]]:
    """{key: its package names} in the cache."""
    return {key.name: sorted(p.name for p in key.glob("*.pt2"))
            for key in sorted((cache / "compiled").iterdir()) if key.is_dir()}  # not the build lock


def assert_decodes_as_eager(result: dict) -> None:
    assert not any(result["reasons"]), result["log"][-3000:]
    assert result["same_tokens"]
    assert max(result["errors"]) <= 1e-4, result


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
def compiled_ahead(cache, folders) -> tuple[list[str], dict[str, list[str]]]:
    """`accessory compile` of the float model with a speculative config, in the module's empty cache: its output
    lines, and the packages it left there."""
    env = dict(os.environ, ACCESSORY_CACHE=str(cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "accessory", "compile", "--pretrained_path", str(folders[0]),
                           "--max_seq_len", "256", "--max_batch_size", "4", "--speculative-config",
                           json.dumps(SPECULATIVE)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines(), packages(cache)


def test_accessory_compile_makes_the_packages_later_processes_load(cache, folders, compiled_ahead):
    """`accessory compile` compiles the decode step's packages for every row count up to --max_batch_size, and the
    verify step's for one row of up to 1 + num_speculative_tokens slots, and prints them. A --compile run with the
    same model then compiles nothing, loads all three, and its steps compute as eager ones. New weights of the same
    shapes (another seed) load the same packages and compute as eager steps do with those weights."""
    lines, made = compiled_ahead
    [(key, names)] = made.items()
    assert names == ["decode-rows-1-1.pt2", "decode-rows-2-16.pt2", "verify-slots-2-16.pt2"]
    assert lines == [f"key {key}: 3 compiled, 0 already there", *(str(cache / "compiled" / key / name)
                                                                  for name in names)]
    for seed in (0, 1):
        run = run_process(cache, folders[seed])
        assert_decodes_as_eager(run)  # (packages made ahead of time once swapped the step's tokens and positions)
        assert (run["builds"], run["loads"]) == (0, 3)
        assert "loaded the compiled decode step for rows 1 from" in run["log"]
        assert "loaded the compiled verify step for slots 2..16 from" in run["log"]
    assert packages(cache) == made


def test_another_format_compiles_its_own_and_a_corrupt_package_is_compiled_again(cache, folders, compiled_ahead):
    """int8 weights are other code: a package under another key, compiled by the first run that needs it. A package
    cut short is reported, removed and compiled again, and the run's output is still right."""
    float_keys = set(compiled_ahead[1])
    int8 = run_process(cache, folders[0], quant="int8", prompts=PROMPTS[:1], speculative=None)
    assert_decodes_as_eager(int8)
    assert (int8["builds"], int8["loads"]) == (1, 0)
    assert "compiled the decode step for rows 1 into" in int8["log"]
    [int8_key] = set(packages(cache)) - float_keys

    package = cache / "compiled" / int8_key / "decode-rows-1-1.pt2"
    package.write_bytes(package.read_bytes()[:1000])
    again = run_process(cache, folders[0], quant="int8", prompts=PROMPTS[:1], speculative=None)
    assert_decodes_as_eager(again)
    assert f"the compiled decode step {package} does not load" in again["log"]
    assert (again["builds"], again["loads"]) == (1, 0)


def test_exporting_a_step_leaves_the_live_caches_marked(folders):
    """torch.export strips dynamo's size markings from its inputs, the live KV caches: they get them back (heads and
    head_dim static), or a torch.compile graph traced after a package was exported (several rows' verify step)
    takes those sizes for symbolic, and compiles again when the next run's cache comes, after the warm-up."""
    from accessory.generation.steps import export_step
    from accessory.model.meta import MetaModel
    from accessory.network.components import decode_mask
    from accessory.network.kv_caches import KVCaches

    model = MetaModel.from_pretrained(folders[0], max_seq_len=64).llma
    caches = KVCaches.allocate(model, 2, 64)
    positions = torch.tensor([3, 4])
    with torch.inference_mode():
        export_step(model, "decode", torch.ones_like(positions), positions, decode_mask(positions, 64), caches)
    assert [getattr(c.k, "_dynamo_static_indices", None) for c in caches.layers] == [{1, 3}] * len(model.layers)


def test_the_source_fingerprint_is_the_code_the_process_started_with(monkeypatch):
    """A source file edited while a process runs does not change that process's package key: the code it runs is
    what it read at its start (a live engine's key once changed mid-run)."""
    from accessory.generation.package_key import source_fingerprint

    before = source_fingerprint()
    monkeypatch.setattr(Path, "read_bytes", lambda self: b"edited")
    assert source_fingerprint() == before


def test_a_killed_build_s_scratch_folder_is_swept_by_a_later_build(tmp_path):
    """Builds work in tmp-<pid>-* folders: one whose process is gone and that is older than STALE_S is removed by
    the next build there; a live process's, and a dead one's that is still recent, are left alone."""
    from accessory.cache_dir import STALE_S, scratch_folder

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    old = time.time() - STALE_S - 60
    stale, recent, live = (tmp_path / f"tmp-{dead}-a", tmp_path / f"tmp-{dead}-b", tmp_path / f"tmp-{os.getppid()}-c")
    for folder in (stale, recent, live):
        (folder / "part").mkdir(parents=True)
    for folder in (stale, live):
        os.utime(folder, (old, old))
    with scratch_folder(tmp_path) as work:
        assert work.name.startswith(f"tmp-{os.getpid()}-") and work.is_dir()
    assert not stale.exists() and recent.is_dir() and live.is_dir() and not work.exists()
