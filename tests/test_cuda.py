"""The CUDA path, on a GPU. Every test here skips without CUDA (CI has none: the file costs nothing there); on a GPU
machine `python -m pytest -q tests/test_cuda.py` runs them (benchmarks/README.md, "GPU", says where they last ran).

- The Triton quantized products (accessory/kernels/cuda.py), int8 and int4, 1 to 64 rows, bfloat16 and float16,
  against x @ dequantize(W)^T in float64; torch's tinygemm (measured beside them by benchmarks/gpu.py) too.
- The built-in model (SmolLM2-135M-Instruct, float weights): bfloat16 on CUDA against float32 on the CPU (logits
  within BF16_LOGITS_TOL relative, the same 32 greedy tokens); float32 on CUDA (logits within 1e-4); the compiled
  decode step (CUDA graphs) against eager; int4 (the GGUF's own bits) and int8 on CUDA against the CPU run of the
  same quantized weights.
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
    return run_model(model)


def run_model(model, engine=None) -> dict:
    ids = [model.tokenizer.encode_chat(QUESTION)] + [model.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    return {"tokens": greedy_ids(model, ids, GEN_STEPS, engine=engine),
            "logits": [row.cpu() for row in model.compute_logits(ids)]}


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
    assert run["tokens"] == smollm2["tokens"]


def test_float32_on_cuda_matches_the_cpu(smollm2_checkpoint, smollm2, report):
    run = run_model(cuda_model(smollm2_checkpoint, torch.float32))
    report["smollm2 fp32 cuda vs fp32 cpu logits relative error"] = error = logits_error(run, smollm2)
    assert error < 1e-4
    assert run["tokens"] == smollm2["tokens"]


def test_compiled_step_with_cuda_graphs_matches_eager(smollm2_checkpoint, smollm2):
    """The decode step compiled (CUDA graphs, rows padded to powers of two) against the float32 CPU run, with
    rows of different lengths finishing at different steps (max_batch_size 2 for 4 prompts: rows leave and join)."""
    model = cuda_model(smollm2_checkpoint, torch.bfloat16, compile=True)
    assert run_model(model)["tokens"] == smollm2["tokens"]
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
        assert run["tokens"] == ref["tokens"], f"compile={compile}"


# ---- process groups ------------------------------------------------------------------------------------------------

def test_nccl_at_world_size_one(smollm2_checkpoint):
    """`torchrun --nproc-per-node=1 -m accessory generate` on a GPU joins an NCCL group (the runtime's choice with
    CUDA) and prints what the same model prints in process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "accessory", "generate", "--pretrained_path",
               str(smollm2_checkpoint), "--prompt", PROMPTS[2], "--max_gen_len", "24", "--log-level", "debug"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(nccl)" in result.stderr
    expected = cuda_model(smollm2_checkpoint, torch.bfloat16).generate([PROMPTS[2]], max_gen_len=24)[0]
    assert result.stdout.strip() == expected.strip()


def sharded_run(folder, dtype) -> dict:
    """On one rank of a gloo group: the model on CUDA (every rank on the one GPU)."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=256, device="cuda", dtype=dtype)
    assert next(model.llma.parameters()).is_cuda
    prompts = [model.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    return {"tokens": greedy_ids(model, prompts, GEN_STEPS),
            "logits": [row.cpu() for row in model.compute_logits(prompts)]}


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_on_one_gpu_through_gloo(tiny_checkpoints, smollm2_checkpoint, world, report):
    """Tiny MHA (both counts) and GQA (2 ranks; 3 is refused) checkpoints, and at 3 ranks the built-in model, in
    float32 (the all-reduce changes the order of the sums: within 1e-4, the same greedy tokens)."""
    cases = [tiny_checkpoints["mha", 1]] + ([tiny_checkpoints["gqa", 1]] if world == 2 else [smollm2_checkpoint])
    for folder in cases:
        single = sharded_run(folder, torch.float32)
        ranks = run_ranks(world, sharded_run, folder, torch.float32)
        for rank, result in enumerate(ranks):
            assert not isinstance(result, Exception), result.rank_traceback
            error = logits_error(result, single)
            report[f"tp {world} ranks gloo cuda {folder.name} logits relative error"] = error
            assert error < 1e-4, f"rank {rank}"
            assert result["tokens"] == single["tokens"], f"rank {rank}"


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
