"""The CUDA path, on a GPU. Every test here skips without CUDA (CI has none: the file costs nothing there); on a GPU
machine `python -m pytest -q tests/kernels/test_cuda.py` runs them (benchmarks/README.md, "GPU", says where they last
ran).

- The Triton quantized products (accessory/kernels/cuda.py), int8 and int4, 1 to 64 rows, bfloat16 and float16,
  against x @ dequantize(W)^T in float64; torch's tinygemm (measured beside them by benchmarks/gpu.py) too.
- The built-in model (SmolLM2-135M-Instruct, float weights): bfloat16 on CUDA against float32 on the CPU (logits
  within BF16_LOGITS_TOL relative; greedy tokens equal, except that a row may part where float32's own top two
  are within NEAR_TIE, after at least MIN_COMMON equal tokens: bf16 rounding flips such ties, and the first run on
  an H100 parted once, at token 16 of 32 of one prompt of 4); float32 on CUDA (logits within 1e-4, tokens equal);
  the compiled decode step (CUDA graphs) against eager; int4 (the GGUF's own bits) and int8 on CUDA against the
  CPU run of the same quantized weights.
- NCCL at world size 1 (torchrun and the CLI, as a user runs it); tensor parallelism at 2 and 3 ranks on the one
  GPU through gloo with CUDA tensors (NCCL refuses two ranks on one device): the logits and tokens of 1 rank.
- `accessory serve` on CUDA answers a chat request with the text `MetaModel.chat` gives.

With ACCESSORY_CUDA_REPORT=FILE the measured errors are written there (JSON), for the benchmarks' README.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from distributed import free_port, run_ranks
from tiny import greedy_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

QUESTION = "What is the capital of France?"
PROMPTS = ["The history of the printing press begins", "def fibonacci(n):",
           "Paris is the capital of France, Berlin is the capital of Germany, and Rome is"]
GEN_STEPS = 32
BF16_LOGITS_TOL = 0.05  # relative (L2) error of bfloat16 logits against float32 through SmolLM2's 30 layers
NEAR_TIE = 0.5  # logits: where float32's top choice leads bf16's by less, bf16 may take the other
MIN_COMMON = 8  # greedy tokens every row must share with the float32 run before any such parting


@pytest.fixture(scope="module")
def report():
    figures = {}
    yield figures
    path = os.environ.get("ACCESSORY_CUDA_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


# ---- the kernels --------------------------------------------------------------------------------------------------

KERNEL_CASES = [(fmt, dtype) for fmt in ("int8", "int4") for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("fmt,dtype", KERNEL_CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in KERNEL_CASES])
def test_quantized_products_match_the_dequantized_weight(fmt, dtype, report):
    """Fresh random weights and inputs for every shape; sizes that no tile divides (N 200, K 352), and a 7B one."""
    from accessory.kernels.cuda import _launch, quantized_linear_cuda
    from accessory.quant.formats import dequantize, quantize

    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3  # the output's rounding, and W's to dtype
    worst = 0.0
    for n, k in ((200, 352), (4096, 4096), (96, 11008)):
        parts = {name: t.cuda() for name, t in quantize(torch.randn(n, k) * 0.02, fmt).items()}
        weight = dequantize(parts, fmt, dtype).double()
        for rows in (1, 2, 7, 16, 33, 64):
            x = torch.randn(rows, k, device="cuda").to(dtype)
            ref = x.double() @ weight.T
            for out in (quantized_linear_cuda(x, fmt, parts["q"], parts["scale"], parts.get("min")),  # autotuned
                        _launch(x, fmt, parts["q"], parts["scale"], parts.get("min"),
                                {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2})):
                assert out.dtype == dtype and out.shape == (rows, n)
                assert torch.isfinite(out).all()
                error = relative_error(out, ref)
                worst = max(worst, error)
                assert error < tolerance, f"{fmt} {dtype} {n}x{k}, {rows} rows: relative error {error:.2e}"
    report[f"kernel {fmt} {str(dtype)[6:]} worst relative error"] = worst


def test_dispatch_uses_the_kernel_for_few_rows_and_cublas_beyond():
    from accessory.kernels.dispatch import quantized_linear
    from accessory.quant.formats import dequantize, quantize

    parts = {name: t.cuda() for name, t in quantize(torch.randn(256, 512) * 0.02, "int4").items()}
    weight = dequantize(parts, "int4", torch.bfloat16).double()
    for rows in (1, 64, 65, 300):  # the kernel up to 64 rows, then chunks dequantized for cuBLAS
        x = torch.randn(3, rows, 512, device="cuda", dtype=torch.bfloat16)[1]
        out = quantized_linear(x, "int4", parts["q"], parts["scale"], parts["min"])
        assert relative_error(out, x.double() @ weight.T) < 1e-2


def test_tinygemm_candidate_computes_the_same_product(report):
    """benchmarks/gpu.py times torch's tinygemm on our int4 weights; its layout conversion must be right for that
    to mean anything (its bfloat16 scale and zero point round ours: a larger, stated error)."""
    from accessory.kernels.cuda import tinygemm_linear, tinygemm_pack
    from accessory.quant.formats import dequantize, quantize

    parts = {name: t.cuda() for name, t in quantize(torch.randn(4096, 4096) * 0.02, "int4").items()}
    packed = tinygemm_pack(parts["q"], parts["scale"], parts["min"])
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    error = relative_error(tinygemm_linear(x, *packed), x.double() @ dequantize(parts, "int4").double().cuda().T)
    report["tinygemm int4 relative error"] = error
    assert error < 2e-2


# ---- the built-in model --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    """Greedy tokens and logits of the float32 CPU run: the reference of everything on CUDA."""
    return reference_run(smollm2_checkpoint)


def reference_run(folder, **load) -> dict:
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=512, device="cpu", dtype=torch.float32, **load)
    return {**run_model(model), "model": model}


def run_model(model, engine=None) -> dict:
    ids = prompt_ids(model)
    return {"tokens": greedy_ids(model, ids, GEN_STEPS, engine=engine),
            "logits": [row.cpu() for row in model.compute_logits(ids)]}


def prompt_ids(model) -> list[list[int]]:
    return [model.tokenizer.encode_chat(QUESTION)] + [model.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]


def assert_greedy_matches(run: dict, ref: dict, report: dict, name: str) -> None:
    """Greedy tokens equal to the float32 run's, or parting only at a near tie of float32's own logits (after at
    least MIN_COMMON equal tokens)."""
    partings = []
    for ids, got, want in zip(prompt_ids(ref["model"]), run["tokens"], ref["tokens"]):
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is None:
            continue
        logits = ref["model"].compute_logits([ids + want[:k]])[0][-1]
        margin = (logits[want[k]] - logits[got[k]]).item()
        partings.append({"at": k, "float32_margin": round(margin, 4)})
        assert k >= MIN_COMMON and margin < NEAR_TIE, f"{name}: parts at token {k}, float32 margin {margin:.3f}"
    report[f"{name} greedy partings"] = partings


def logits_error(run: dict, ref: dict) -> float:
    return relative_error(torch.cat(run["logits"]), torch.cat(ref["logits"]))


def cuda_model(folder, dtype, **options):
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=512, device="cuda", dtype=dtype, **options)
    assert model.llma.device.type == "cuda"
    return model


def test_bf16_on_cuda_matches_float32_on_the_cpu(smollm2_checkpoint, smollm2, report):
    model = cuda_model(smollm2_checkpoint, torch.bfloat16)
    run = run_model(model)
    report["smollm2 bf16 cuda vs fp32 cpu logits relative error"] = error = logits_error(run, smollm2)
    assert error < BF16_LOGITS_TOL
    assert_greedy_matches(run, smollm2, report, "smollm2 bf16 cuda")


def test_float32_on_cuda_matches_the_cpu(smollm2_checkpoint, smollm2, report):
    run = run_model(cuda_model(smollm2_checkpoint, torch.float32))
    report["smollm2 fp32 cuda vs fp32 cpu logits relative error"] = error = logits_error(run, smollm2)
    assert error < 1e-4
    assert run["tokens"] == smollm2["tokens"]


def test_compiled_step_with_cuda_graphs_matches_eager(smollm2_checkpoint, smollm2, report):
    """The decode step compiled (CUDA graphs, rows padded to powers of two) against the float32 CPU run, with
    rows of different lengths finishing at different steps (max_batch_size 2 for 4 prompts: rows leave and join)."""
    model = cuda_model(smollm2_checkpoint, torch.bfloat16, compile=True)
    assert_greedy_matches(run_model(model), smollm2, report, "smollm2 bf16 cuda compiled")
    ids = [model.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS + [QUESTION]]
    eager = model.engine.configured(compile=False, max_batch_size=2)
    compiled = model.engine.configured(max_batch_size=2)
    steps = [5, 17, 9, 12]
    assert [greedy_ids(model, [i], n, engine=compiled)[0] for i, n in zip(ids, steps)] == \
        [greedy_ids(model, [i], n, engine=eager)[0] for i, n in zip(ids, steps)]


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_model_on_cuda_matches_the_cpu(fmt, report):
    """int4: the GGUF's own Q4_1 bits (imported with them kept); int8: quantized while loading (on the GPU here,
    on the CPU for the reference: the same values)."""
    from accessory.checkpoint.default_model import ensure_default_model

    folder = ensure_default_model(keep_quantized=fmt == "int4")
    quant = None if fmt == "int4" else "int8"
    ref = reference_run(folder, quant=quant)
    for compile in (False, True):
        run = run_model(cuda_model(folder, torch.bfloat16, quant=quant, compile=compile))
        report[f"smollm2 {fmt} bf16 cuda vs fp32 cpu logits relative error"] = error = logits_error(run, ref)
        assert error < BF16_LOGITS_TOL
        assert_greedy_matches(run, ref, report, f"smollm2 {fmt} compile={compile}")


# ---- process groups ------------------------------------------------------------------------------------------------

NCCL_SCRIPT = """
import sys
import torch.distributed as dist
from accessory.model.meta import MetaModel

model = MetaModel.from_pretrained(sys.argv[1], max_seq_len=512)  # joins torchrun's group itself
print(dist.get_backend(), model.llma.device.type, repr(model.generate([sys.argv[2]], max_gen_len=24)[0]))
"""


def test_nccl_at_world_size_one(smollm2_checkpoint, tmp_path):
    """Under `torchrun --nproc-per-node=1` on a GPU, from_pretrained joins an NCCL group (the runtime's choice with
    CUDA) and generates what the same model generates in process; the CLI's generate runs there too."""
    script = tmp_path / "nccl_one.py"
    script.write_text(NCCL_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    result = subprocess.run(torchrun + [str(script), str(smollm2_checkpoint), PROMPTS[2]], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = cuda_model(smollm2_checkpoint, torch.bfloat16).generate([PROMPTS[2]], max_gen_len=24)[0]
    assert result.stdout.strip().splitlines()[-1] == f"nccl cuda {expected!r}"
    cli = subprocess.run(torchrun + ["-m", "accessory", "generate", "--pretrained_path", str(smollm2_checkpoint),
                                     "--prompt", PROMPTS[2], "--max_gen_len", "24"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip() == expected.strip()


def sharded_run(folder, dtype) -> dict:
    """On one rank of a gloo group: the model on CUDA (every rank on the one GPU)."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=256, device="cuda", dtype=dtype)
    assert next(model.llma.parameters()).is_cuda
    prompts = [model.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    return {"tokens": greedy_ids(model, prompts, GEN_STEPS),
            "logits": [row.cpu() for row in model.compute_logits(prompts)]}


def assert_ranks_match_one(folder, world: int, report: dict) -> None:
    """float32: the all-reduce changes the order of the sums, so logits within 1e-4 and the same greedy tokens."""
    single = sharded_run(folder, torch.float32)
    for rank, result in enumerate(run_ranks(world, sharded_run, folder, torch.float32)):
        assert not isinstance(result, Exception), result.rank_traceback
        error = logits_error(result, single)
        report[f"tp {world} ranks gloo cuda {folder.name} rank {rank} logits relative error"] = error
        assert error < 1e-4, f"rank {rank}"
        assert result["tokens"] == single["tokens"], f"rank {rank}"


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_on_one_gpu_through_gloo(tiny_checkpoints, world, report):
    """Tiny MHA (both counts, its FFN and vocabulary split unevenly at 3) and GQA (2 ranks; 3 is refused)."""
    for name in ("mha", "gqa") if world == 2 else ("mha",):
        assert_ranks_match_one(tiny_checkpoints[name, 1], world, report)


def test_tensor_parallel_built_in_model_at_3_ranks(smollm2_checkpoint, report):
    assert_ranks_match_one(smollm2_checkpoint, 3, report)


# ---- serving -------------------------------------------------------------------------------------------------------

def test_server_answers_on_cuda(smollm2_checkpoint, tmp_path):
    import httpx

    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "accessory", "serve", "--pretrained_path", str(smollm2_checkpoint),
                               "--port", str(port), "--max_seq_len", "512", "--max_batch_size", "4"],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                "temperature": 0}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    assert "Paris" in text
    model = cuda_model(smollm2_checkpoint, torch.bfloat16)
    assert text == model.chat([{"role": "user", "content": QUESTION}], max_gen_len=24)
    assert "cuda" in (tmp_path / "serve.log").read_text()
