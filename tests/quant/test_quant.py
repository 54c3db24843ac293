"""Weight-only quantization: the formats and CPU kernels against their dequantized float reference, GGUF bits kept
bit-exact against the gguf package, quantized models at 1, 3 and 9 ranks, quantized checkpoints written and
resharded, the memory they take, and their quality (perplexity of a fixed text; the answer to a chat question)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_ranks
from conftest import TESTS
from tiny import greedy_ids

PERPLEXITY_TEXT = TESTS / "data" / "perplexity.txt"
QUESTION = "What is the capital of France?"


# ---- formats and kernels ------------------------------------------------------------------------------------------

def test_cpu_kernels_build_here():
    """The CI machine has a C compiler: the kernels must build, or every quantized product silently runs the slow
    dequantize + matmul path."""
    from accessory.kernels import cpu_kernels, kernel_isa

    assert cpu_kernels()
    assert kernel_isa() in ("avx512", "avx2", "generic")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 40])
def test_quantized_linear_equals_its_dequantized_reference(fmt, rows):
    """Every row count the engine uses (the kernels up to 8 rows, the dequantizing path above), an odd number of
    outputs, and bf16 input: the product equals x @ dequantize(W)^T to float32 rounding."""
    from accessory.quant.formats import dequantize, quantize
    from accessory.kernels import quantized_linear

    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(203, 576, generator=generator) * 0.05
    x = torch.randn(rows, 576, generator=generator)
    parts = quantize(weight, fmt)
    reference = x.double() @ dequantize(parts, fmt).double().T
    out = quantized_linear(x, fmt, parts["q"], parts["scale"], parts.get("min"))
    assert out.dtype == torch.float32 and out.shape == (rows, 203)
    assert (out.double() - reference).abs().max() <= 2e-6 * reference.abs().max()
    low = quantized_linear(x.bfloat16(), fmt, parts["q"], parts["scale"], parts.get("min"))
    assert low.dtype == torch.bfloat16 and (low.double() - reference).abs().max() <= 2e-2 * reference.abs().max()


@pytest.mark.parametrize("march,isa", [("native", None), ("haswell", "avx2"), ("x86-64", "generic")])
def test_every_kernel_variant_equals_the_reference(tmp_path, march, isa):
    """Each instruction-set path of kernels.c, whatever this machine is: AVX-512 or AVX2 as -march=native picks,
    AVX2 + FMA + F16C (haswell), and plain C. Called through ctypes on the C code alone."""
    import ctypes
    import subprocess

    from accessory.quant.formats import dequantize, quantize
    from accessory.kernels.build import SOURCES

    library = tmp_path / f"kernels-{march}.so"
    subprocess.run(["cc", "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", str(SOURCES[0]), "-o",
                    str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.accessory_kernels_isa.restype = ctypes.c_char_p
    assert isa is None or lib.accessory_kernels_isa().decode() == isa
    generator = torch.Generator().manual_seed(1)
    # 11 groups of 32 inputs: the one-row loops take two groups a pass, and an odd one last
    weight, x = torch.randn(77, 352, generator=generator) * 0.1, torch.randn(6, 352, generator=generator)
    for fmt in ("int4", "int8"):
        parts = quantize(weight, fmt)
        for rows in (1, 2, 3, 4, 6):
            out = torch.empty(rows, 77)
            pointers = [x.data_ptr(), rows, 352, parts["q"].data_ptr(), parts["scale"].data_ptr()]
            pointers += [parts["min"].data_ptr()] if fmt == "int4" else []
            getattr(lib, f"accessory_linear_{fmt}")(*[ctypes.c_int64(p) for p in pointers], ctypes.c_int64(77),
                                                    ctypes.c_int64(out.data_ptr()))
            reference = x[:rows].double() @ dequantize(parts, fmt).double().T
            assert (out.double() - reference).abs().max() <= 2e-6 * reference.abs().max(), (fmt, rows)
    check_int8x_kernel(lib, weight, x, built=isa != "generic")


def int8x_reference(x: torch.Tensor, parts: dict) -> torch.Tensor:
    """The int4 product with x in int8 (cpu_kernels.c, a draft's), computed in torch as its comment says: x
    quantized per group of 32 to round(x * 127 / max |x|), integer dot products with the nibbles, then per group
    s * xs * dot + min * sum(x)."""
    from accessory.quant.formats import unpack_int4

    rows, features = x.shape
    groups = x.reshape(rows, features // 32, 32)
    most = groups.abs().amax(-1)
    xq = torch.round(groups * torch.where(most > 0, 127.0 / most, torch.zeros(()))[..., None])
    q = unpack_int4(parts["q"]).reshape(parts["q"].shape[0], -1, 32)
    dots = torch.einsum("mgk,ngk->mng", xq.double(), q.double())  # exact: integers
    return ((dots * (parts["scale"].double() * (most / 127).double()[:, None])).sum(-1)
            + (parts["min"].double() * groups.double().sum(-1)[:, None]).sum(-1))


def check_int8x_kernel(lib, weight: torch.Tensor, x: torch.Tensor, built: bool) -> None:
    """The kernel of int4 with x in int8 (AVX-512 VNNI or AVX2; not in plain C) gives its arithmetic's values, and
    stays within x's rounding of the exact product. 77 rows: a last tile of 13 (on AVX2 a half of 5)."""
    import ctypes

    from accessory.kernels.dispatch import pack_int4_int8x
    from accessory.quant.formats import dequantize, quantize

    assert lib.accessory_int8x() == built
    if not built:
        return
    parts = quantize(weight, "int4")
    packed = pack_int4_int8x(parts["q"], parts["scale"], parts["min"])
    x = x.clone()
    x[0, :32] = 0  # a group of x all zeros: scale 0
    for rows in (1, 2, 6):
        out = torch.full((rows, weight.shape[0]), float("nan"))
        assert lib.accessory_linear_int4_int8x(*[ctypes.c_int64(v) for v in (
            x.data_ptr(), rows, x.shape[1], *(p.data_ptr() for p in packed), weight.shape[0], out.data_ptr())]) == 0
        reference = int8x_reference(x[:rows], parts)
        assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max(), rows
        exact = x[:rows].double() @ dequantize(parts, "int4").double().T
        assert (out.double() - exact).abs().max() <= 2e-2 * exact.abs().max(), rows


@pytest.mark.parametrize("length", [1, 3])
def test_decode_attention_kernel_equals_sdpa(length):
    """The attention kernel of decode and verify steps: L tokens per row (1, or a row's token and 2 proposals), each
    over its own row's columns up to its position, grouped-query heads, rows at different positions, cache rows past
    the batch's: the same values as SDPA over the masked columns (the portable path)."""
    from accessory.kernels import cpu_kernels, dispatch
    from accessory.network.components import decode_mask

    assert cpu_kernels()  # else both calls are SDPA
    generator = torch.Generator().manual_seed(length)
    keys, values = (torch.randn(4, 2, 64, 32, generator=generator) for _ in "kv")  # rows, KV heads, columns, dim
    q = torch.randn(3, length, 6, 32, generator=generator)  # 3 rows of 6 query heads, 3 per KV head
    positions = torch.tensor([5, 40, 61])[:, None] + torch.arange(length)
    mask = decode_mask(positions, 64)
    kernel = dispatch.decode_attention(q, keys, values, positions, mask)
    with dispatch.portable():
        reference = dispatch.decode_attention(q, keys, values, positions, mask)
    assert kernel.shape == reference.shape == (3, 6, length, 32)
    assert (kernel - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_small_step_kernels_equal_the_torch_expressions(offset):
    """RMSNorm (Meta's, and Gemma's with its +1 offset) and the interleaved rotary embedding, as eager steps run
    them on the CPU: the same values as the torch expressions a compiled step fuses (the portable path), on a strided
    view (q, a slice of the fused qkv product), one rotation for every row, and a prefill's many tokens."""
    from accessory.kernels import cpu_kernels, dispatch

    assert cpu_kernels()  # else both calls are the torch expressions
    generator = torch.Generator().manual_seed(int(offset))
    qkv = torch.randn(3, 5, 15 * 64, generator=generator) * 4  # 3 rows, 5 tokens: 9 query heads and 2 x 3 KV heads
    q = qkv[..., :9 * 64].view(3, 5, 9, 64)
    weight = torch.randn(64, generator=generator)
    for x, rotations in [(q, torch.randn(3, 5, 32, 2, generator=generator)),
                         (q, torch.randn(1, 5, 32, 2, generator=generator)),
                         (torch.randn(1, 300, 3, 64, generator=generator), torch.randn(1, 300, 32, 2))]:
        with torch.profiler.profile() as profiled:
            kernel = dispatch.rms_norm(x, weight, 1e-6, offset), dispatch.apply_rope(x, rotations)
        ran = {event.name for event in profiled.events()}
        assert {"accessory::rms_norm_cpu", "accessory::rotary_cpu"} <= ran and "aten::rsqrt" not in ran
        with dispatch.portable():
            reference = dispatch.rms_norm(x, weight, 1e-6, offset), dispatch.apply_rope(x, rotations)
        for got, want in zip(kernel, reference):
            assert got.shape == want.shape == x.shape and got.dtype == torch.float32
            assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # a rounding or two (FMA in the kernel)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_kernel_equals_the_torch_expression(activation):
    """A gated MLP's act(gate) * up as eager steps run it on the CPU (gate and up: halves of the fused w1/w3 product,
    or a mixture's chunks), against the torch expression, over the activations' whole useful range."""
    from accessory.kernels import cpu_kernels, dispatch

    assert cpu_kernels()
    generator = torch.Generator().manual_seed(1)
    for product in (torch.randn(2, 3, 2 * 100, generator=generator) * 6, torch.randn(300, 2 * 64, generator=generator)):
        gate, up = product.chunk(2, dim=-1)
        with torch.profiler.profile() as profiled:
            got = dispatch.gated(gate, up, activation)
        assert "accessory::gated_cpu" in {event.name for event in profiled.events()}
        with dispatch.portable():
            want = dispatch.gated(gate, up, activation)
        assert got.shape == want.shape == gate.shape
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_gated_kernel_gives_a_slice_of_the_hidden_units_the_values_of_the_whole():
    """A rank holds a slice of the hidden units (another width, so other values fall in a row's last, partial
    vector): each value is computed by the same arithmetic wherever it falls, bit for bit."""
    from accessory.kernels import dispatch

    generator = torch.Generator().manual_seed(2)
    for width in (100, 176, 90):
        gate, up = torch.randn(3, width, generator=generator) * 4, torch.randn(3, width, generator=generator)
        for activation in ("silu", "gelu_tanh"):
            whole = dispatch.gated(gate, up, activation)
            for cut in (width // 2, width // 3):
                parts = [dispatch.gated(g.contiguous(), u.contiguous(), activation)
                         for g, u in zip(gate.split(cut, dim=-1), up.split(cut, dim=-1))]
                assert torch.equal(torch.cat(parts, dim=-1), whole), (width, cut, activation)


# (query heads, KV heads, qk-norm, attention scale, window, rows, tokens a row, each row's first position)
ATTENTION_CASES = {
    "llama": (9, 3, False, 1.0, None, 1, 1, [37]),
    "rows at several positions": (6, 2, False, 1.0, None, 3, 1, [0, 5, 63]),
    "speculative proposals": (6, 2, False, 1.0, None, 2, 3, [4, 20]),
    "qk-norm and scale (Gemma 3)": (4, 1, True, 0.7, None, 2, 1, [3, 9]),
    "a ring past its window": (4, 2, True, 1.0, 16, 2, 1, [7, 40]),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_in_one_call_equals_its_steps(case, monkeypatch):
    """An eager decode step's attention as one kernel call (attend_cpu: qk-norm, scale, rotary embedding, the cache
    write, attention) gives the step-by-step kernels' output and caches exactly, and the portable torch path's to
    a rounding; with a cache already holding earlier positions, per-row or shared rotations, several tokens a row,
    and a ring that has wrapped."""
    from types import SimpleNamespace

    from accessory.kernels import cpu_kernels, dispatch
    from accessory.network import components
    from accessory.network.kv_caches import KVCache
    from accessory.parallel import ParallelContext

    assert cpu_kernels()
    heads, kv_heads, qk_norm, scale, window, rows, length, first = ATTENTION_CASES[case]
    head_dim, columns = 32, window or 128
    args = SimpleNamespace(dim=96, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, qkv_bias=False,
                           qk_norm=qk_norm, norm_eps=1e-6, norm_offset=1.0, attention_scale=scale / head_dim ** 0.5)
    attention = components.Attention(args, ParallelContext(None, 0, 1, 0), window=window)
    generator = torch.Generator().manual_seed(len(case))
    for param in attention.parameters():
        param.copy_(torch.randn(param.shape, generator=generator) / 4)
    attention.fuse()
    cache = KVCache.allocate(rows + 1, kv_heads, columns, head_dim, torch.float32, "cpu", ring=bool(window))
    earlier = torch.randn(2, *cache.k.shape, generator=generator)
    positions = torch.tensor(first)[:, None] + torch.arange(length)
    table = components.rope_table(components.base_frequencies(head_dim, 10000.0), 256, "cpu")
    x = torch.randn(rows, length, 96, generator=generator)
    mask = components.decode_mask(positions if not window else positions[:, -1], columns)

    def decoded(rotations):
        cache.k.copy_(earlier[0]), cache.v.copy_(earlier[1])
        out = attention.decode(x, rotations, positions, mask, cache)
        return out, cache.k.clone(), cache.v.clone()

    def ran(rotations, operator):
        with torch.profiler.profile() as profiled:
            result = decoded(rotations)
        assert f"accessory::{operator}" in {event.name for event in profiled.events()}
        return result

    for rotations in (table[positions], table[positions[:1]]):  # each row's, or the first row's for all
        block = ran(rotations, "attention_block_cpu")
        monkeypatch.setattr(components, "products_in_one_call", lambda *_: False)
        one_call = ran(rotations, "attend_cpu")
        monkeypatch.setattr(components, "attends_in_one_call", lambda *_: False)
        steps = decoded(rotations)
        monkeypatch.undo()
        with dispatch.portable():
            portable = decoded(rotations)
        for got_block, got, exact, near in zip(block, one_call, steps, portable):
            assert torch.equal(got_block, exact) and torch.equal(got, exact)
            assert (got - near).abs().max() <= 1e-5 * near.abs().max()


@pytest.mark.parametrize("fmt", [None, "int4", "int8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_gated_mlp_in_one_call_equals_its_steps(fmt, rows, monkeypatch):
    """An eager step's gated MLP as one kernel call (mlp_block_cpu: the w1 / w3 product, act(gate) * up, the w2
    product) gives exactly what its steps give, for float32, int4 and int8, at one row and several."""
    from accessory.kernels import cpu_kernels
    from accessory.network import components
    from accessory.parallel import ParallelContext

    assert cpu_kernels()
    mlp = components.FeedForward(256, 512, ParallelContext(None, 0, 1, 0),
                                 activation="gelu_tanh" if rows > 1 else "silu")
    generator = torch.Generator().manual_seed(rows)
    weights = {name: torch.randn(param.shape, generator=generator) / 16 for name, param in mlp.named_parameters()}
    if fmt is not None:
        mlp.align_hidden(32)
        for layer in (mlp.w1, mlp.w2, mlp.w3):
            layer.quantize_(fmt)
        for name, layer in (("w1", mlp.w1), ("w2", mlp.w2), ("w3", mlp.w3)):
            layer.weight.quantize_from(weights[f"{name}.weight"])
    else:
        mlp.load_state_dict(weights)
    mlp.fuse()
    x = torch.randn(rows, 1, 256, generator=generator)
    with torch.profiler.profile() as profiled:
        one_call = mlp(x)
    assert "accessory::mlp_block_cpu" in {event.name for event in profiled.events()}
    monkeypatch.setattr(components, "products_in_one_call", lambda *_: False)
    assert torch.equal(one_call, mlp(x))


@pytest.mark.parametrize("fmt,levels", [("int8", 127), ("int4", 15)])
def test_quantization_error_is_half_a_step(fmt, levels):
    from accessory.quant.formats import GROUP, dequantize, quantize

    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    weight[3, :GROUP] = 0.25  # an all-equal group: scale 0, exact
    parts = quantize(weight, fmt)
    error = (dequantize(parts, fmt) - weight).abs().reshape(64, -1, GROUP).amax(-1)
    step = parts["scale"].float()
    assert torch.all(error <= step / 2 + 2e-3 * weight.abs().reshape(64, -1, GROUP).amax(-1))  # + fp16 scale rounding
    assert error[3, 0] < 1e-3 and step.max() <= 2 * weight.abs().max() / levels * 1.01


# ---- GGUF bits kept -------------------------------------------------------------------------------------------------

def test_gguf_q4_1_and_q8_0_tensors_are_kept_bit_exact(smollm2_gguf):
    """The built-in model's Q4_1 matrices and its Q8_0 embedding, kept as int4 / int8, dequantize to exactly the
    float32 values the gguf package gives."""
    import gguf

    from accessory.checkpoint.importers.gguf import KEPT_TYPES, kept_parts
    from accessory.quant.formats import dequantize

    reader = gguf.GGUFReader(smollm2_gguf)
    checked = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in KEPT_TYPES or not (t.name.startswith(("blk.0.", "blk.29.")) or t.name == "token_embd.weight"):
            continue
        theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        ours = dequantize(kept_parts(t.data, kind), KEPT_TYPES[kind][0])
        assert torch.equal(ours, theirs.reshape(ours.shape)), t.name
        checked.add(kind)
    assert checked == {"Q4_1", "Q8_0"}


def test_gguf_q4_0_is_kept_bit_exact():
    import gguf

    from accessory.checkpoint.importers.gguf import kept_parts
    from accessory.quant.formats import dequantize

    values = np.random.default_rng(0).standard_normal((48, 160)).astype(np.float32)
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0).copy())
    assert torch.equal(dequantize(kept_parts(blocks, "Q4_0"), "int4"), theirs)


# ---- quantized models -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kept_checkpoint():
    """The built-in model imported with its GGUF bits kept (linears int4 from Q4_1, the embedding int8 from Q8_0)."""
    from accessory.checkpoint.default_model import ensure_default_model

    return ensure_default_model(keep_quantized=True)


def model_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's tensors (shared ones, like a tied embedding, once)."""
    storages = {}
    for tensor in [*model.llma.parameters(), *model.llma.buffers()]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.fixture(scope="module")
def models(smollm2_checkpoint, kept_checkpoint) -> dict:
    from accessory.model.meta import MetaModel

    load = lambda folder, quant=None: MetaModel.from_pretrained(folder, max_seq_len=1024, quant=quant)  # noqa: E731
    return {"float32": load(smollm2_checkpoint), "int8": load(smollm2_checkpoint, "int8"),
            "int4": load(smollm2_checkpoint, "int4"), "int4-kept": load(kept_checkpoint)}


MODELS_BY_RANKS = {3: ("int8",), 9: ("int4-kept", "float32")}  # the kept bits at 3 ranks: test_real_model's CLI
# Each rank count gets the 1-rank answer's first ANSWER_TOKENS after the question and its logits are compared at each
# of them (the logits every greedy step chose from, whole), then it decodes greedily itself: fewer steps at 9 ranks
# (9 processes on 2 cores: about 1.6 s a step) and 3, through the KV cache each time.
ANSWER_TOKENS = 16
GREEDY_STEPS = {1: 24, 3: 4, 9: 2}
LOGITS_ATOL = 1e-3  # the ranks sum their shares in another order: up to ~8e-5 here, of logits up to ~37


def chat_tokens(models: dict, steps: int) -> dict:
    """Greedy tokens of a chat question from each model."""
    return {name: greedy_ids(model, [model.tokenizer.encode_chat(QUESTION)], steps)[0]
            for name, model in models.items()}


def answer_logits(model, answer: list[int]) -> torch.Tensor:
    """The logits after the chat question and each token of `answer` fed after it (what each step chooses from)."""
    ids = model.tokenizer.encode_chat(QUESTION)
    with torch.no_grad():
        return model.llma(torch.tensor([ids + answer]))[0, len(ids) - 1:]


def at_ranks(folders: dict, answers: dict, steps: int) -> dict:
    """{name: (chat_tokens, answer_logits)} of the models loaded from {name: (folder, quant)} on this rank."""
    from accessory.model.meta import MetaModel

    results = {}
    for name, (folder, quant) in folders.items():
        model = MetaModel.from_pretrained(folder, max_seq_len=256, quant=quant)
        results[name] = (chat_tokens({name: model}, steps)[name], answer_logits(model, answers[name]))
    return results


@pytest.fixture(scope="module")
def tokens_by_ranks(models, kept_checkpoint, smollm2_checkpoint) -> dict:
    """{world: [each rank's {name: (greedy tokens, answer logits)}]}. At 1 rank every model; at 3 int8 (quantized
    while loading); at 9 the kept bits and float32, the one 9-rank run of the suite."""
    folders = {"int4-kept": (kept_checkpoint, None), "int8": (smollm2_checkpoint, "int8"),
               "float32": (smollm2_checkpoint, None)}
    alone = chat_tokens(models, GREEDY_STEPS[1])
    answers = {name: ids[:ANSWER_TOKENS] for name, ids in alone.items()}
    out = {1: [{name: (alone[name], answer_logits(model, answers[name])) for name, model in models.items()}]}
    for world in (3, 9):
        out[world] = run_ranks(world, at_ranks, {name: folders[name] for name in MODELS_BY_RANKS[world]}, answers,
                               GREEDY_STEPS[world])
    for results in out.values():
        for result in results:
            assert not isinstance(result, Exception), result.rank_traceback
    return out


@pytest.mark.parametrize("world", [3, 9])
def test_models_give_the_same_tokens_at_1_3_and_9_ranks(tokens_by_ranks, world):
    """9 ranks split the FFN's 1536 hidden units (quantized: in whole groups of 32, 8 ranks hold 192, the last
    none) and replicate the 3 KV heads; the groups do not depend on the rank count, so neither do the weights: the
    logits at each of the answer's first 16 tokens are one process's, and so are the greedy tokens."""
    alone = tokens_by_ranks[1][0]
    for rank, result in enumerate(tokens_by_ranks[world]):
        assert set(result) == set(MODELS_BY_RANKS[world])
        for name, (ids, logits) in result.items():
            assert len(ids) == GREEDY_STEPS[world] and ids == alone[name][0][:len(ids)], f"{name}: rank {rank}"
            assert logits.shape == alone[name][1].shape == (ANSWER_TOKENS + 1, 49152)
            difference = (logits - alone[name][1]).abs().max().item()
            assert difference <= LOGITS_ATOL, f"{name}: rank {rank} of {world}: logits differ by {difference}"


def test_quantized_answers_say_paris(tokens_by_ranks, smollm2_checkpoint):
    from accessory.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(smollm2_checkpoint)
    for name, (ids, _) in tokens_by_ranks[1][0].items():
        assert "Paris" in tokenizer.decode(ids), name


def test_quantized_weights_take_a_fraction_of_float32(models):
    """And the tied embedding is held once: at one rank the output projection is the embedding table itself."""
    sizes = {name: model_bytes(model) for name, model in models.items()}
    assert sizes["int8"] <= 0.3 * sizes["float32"] and sizes["int4"] <= 0.2 * sizes["float32"], sizes
    assert sizes["int4-kept"] == sizes["int4"]
    for model in models.values():
        assert model.llma.output.weight is model.llma.tok_embeddings.weight
    embedding = 49152 * 576 * 4
    assert sizes["float32"] < 134_515_008 * 4 + embedding // 10  # 135M parameters, the embedding counted once


def huge_page_kib_around(address: int) -> int:
    """AnonHugePages of this process's mapping that holds `address` (from /proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_large_weights_sit_on_huge_pages(models):
    """Where Linux gives transparent huge pages to memory that asks (THP "madvise" or "always"), loading moved the
    large weights there: the float embedding (113 MB) and the kept Q8_0 one (30 MB)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this system gives no transparent huge pages")
    for name in ("float32", "int4-kept"):
        embedding = models[name].llma.tok_embeddings
        tensor = next(t for t in [*embedding.parameters(), *embedding.buffers()] if t.numel() > 2 ** 22)
        assert huge_page_kib_around(tensor.data_ptr() + tensor.untyped_storage().nbytes() // 2) >= 4096, name


def test_perplexity_int8_within_1_percent_int4_within_5_percent(models):
    """On a fixed text: int8 and int4 (requantized from the float weights) against float32. The float weights are
    the GGUF's Q4_1 values, so int4 requantization is close to lossless here, and the kept bits are exact."""
    text = PERPLEXITY_TEXT.read_text()
    perplexity = {name: model.evaluate_examples([text])["perplexity"][0] for name, model in models.items()}
    base = perplexity["float32"]
    assert 1 < base < 100, perplexity
    assert abs(perplexity["int8"] / base - 1) <= 0.01, perplexity
    assert abs(perplexity["int4"] / base - 1) <= 0.05, perplexity
    assert abs(perplexity["int4-kept"] / base - 1) <= 0.001, perplexity


# ---- quantized checkpoints ------------------------------------------------------------------------------------------

def test_quantized_checkpoint_is_what_loading_quantizes_and_reshards_3_to_1_to_9(tmp_path, smollm2_checkpoint, models):
    from accessory.checkpoint.quantize import quantize_checkpoint
    from accessory.checkpoint.reshard import reshard
    from accessory.model.meta import MetaModel

    three = quantize_checkpoint(smollm2_checkpoint, tmp_path / "int4-3", "int4")
    assert sorted(p.name for p in three.glob("*.safetensors")) == [f"consolidated.0{i}-of-03.model.safetensors"
                                                                   for i in range(3)]
    one = reshard(three, tmp_path / "int4-1", 1)
    nine = reshard(one, tmp_path / "int4-9", 9)
    expected = models["int4"].llma.saved_tensors()
    for folder in (three, one, nine):
        loaded = MetaModel.from_pretrained(folder, max_seq_len=1024).llma.saved_tensors()
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), f"{folder.name}: {name}"


def test_requantizing_or_quantizing_twice_is_refused(kept_checkpoint, tmp_path, tiny_checkpoints):
    from accessory.checkpoint.quantize import quantize_checkpoint
    from accessory.errors import CheckpointError, ConfigError
    from accessory.model.meta import MetaModel

    with pytest.raises(CheckpointError, match=r"hidden size \(100\) is not a multiple of 32.*--quant int8"):
        quantize_checkpoint(tiny_checkpoints["mha", 1], tmp_path / "partial-groups", "int8")

    with pytest.raises(ConfigError, match="holds int4-quantized weights; load it with quant='int4'"):
        MetaModel.from_pretrained(kept_checkpoint, quant="int8")
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(kept_checkpoint, tmp_path / "again", "int8")
    with pytest.raises(ConfigError, match="quant must be"):
        MetaModel.from_pretrained(kept_checkpoint, quant="int3")


def test_a_split_off_the_quantization_groups_is_refused_by_name():
    """At 2 ranks the tiny model's 96 attention outputs (and embedding features) split 48 + 48: not whole groups
    of 32. The refusal names the weight, the slice, the rank count and the group size."""
    from accessory.errors import ConfigError
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.parallel import ParallelContext

    from tiny import TINY_CONFIGS

    with torch.device("meta"):
        model = Transformer(ModelArgs(**TINY_CONFIGS["mha"]), ParallelContext(None, 0, 2, 0))
    with pytest.raises(ConfigError, match=r"cannot quantize layers.0.attention.wo.weight as int8: int8 stores whole "
                                          r"blocks of 32 inputs, but this rank's inputs \[0, 48\) of 96 at 2 "
                                          r"model-parallel ranks do not fall on them"):
        model.quantize_(model.quantization_plan("int8"))


def load_int8(folder):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(folder, max_seq_len=64, quant="int8")


def test_a_slice_that_one_rank_cannot_quantize_ends_every_rank_with_an_error(tiny_checkpoints):
    """The tiny model's hidden size of 100 leaves some rank of 3 a slice that is no whole number of int8 blocks: that
    rank's error reaches the others (a rank that raised alone left them waiting in the next collective)."""
    from accessory.errors import ConfigError

    errors = run_ranks(3, load_int8, tiny_checkpoints["mha", 3])
    assert all(isinstance(e, Exception) for e in errors), errors
    named = [e for e in errors if isinstance(e, ConfigError)]
    assert named and all("whole blocks of 32" in str(e) for e in named)
    assert all("whole blocks of 32" in str(e) and "failed" in str(e) for e in errors if e not in named)
