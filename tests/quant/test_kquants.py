"""GGUF's K-quants kept (Q4_K, Q5_K, Q6_K, and Q5_0): the import-only block formats of quant/formats.py against the
`gguf` package as the oracle, on the real tensors of Google's Gemma 3 270M Q4_K_M file and on synthetic blocks
(bit-exact); their CPU kernels (every instruction-set variant) against F.linear on the dequantized weight, and a
prompt's products with x in int8 against that arithmetic done in float64; a
model that holds them converted from a GGUF, loaded at 1 and 2 ranks, resharded on disk; and the refusals (a split
of `in` off the blocks, quantizing to an import-only format)."""
from __future__ import annotations

import ctypes
import json
import subprocess

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks

K_FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0")
# Where each block keeps its float16 d (and dmin): random bytes elsewhere are a valid block.
HALVES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q5_0": (0,)}


def random_blocks(fmt: str, rows: int, columns: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """(rows, bytes) of valid `fmt` blocks for a (rows, columns) matrix: random bytes with sane float16 d / dmin
    (of either sign, some subnormal)."""
    from accessory.quant.formats import GGUF_BLOCKS

    values, nbytes = GGUF_BLOCKS[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // values, nbytes), dtype=np.uint8)
    for at in HALVES[fmt]:
        halves = (rng.standard_normal((rows, columns // values)) * scale).astype(np.float16)
        halves.flat[::7] = np.float16(3e-7)  # subnormal in float16
        blocks[..., at:at + 2] = halves.view(np.uint8).reshape(rows, columns // values, 2)
    return blocks.reshape(rows, -1)


# Each block's bytes that hold its values (the rest: scales); zeroed, the block dequantizes to its minimums.
CODES = {"q4_k": (16, 144), "q5_k": (16, 176), "q6_k": (0, 192), "q5_0": (2, 22)}
ONE_ROW_INT8X = ("q4_k", "q6_k", "q5_0")  # one row of x takes x in int8 against these, in the AVX-512 build


def int8x_reference(x: torch.Tensor, q: torch.Tensor, fmt: str) -> torch.Tensor:
    """x @ W^T as the int8-x kernels compute it, in float64: x's groups of 32 rounded to int8 (scale max |x| / 127,
    in float32 as the kernel does), W's values s * code + mn taken on the rounded x, and its minimums mn on x itself
    (the kernel adds mn * sum(x))."""
    from accessory.quant.formats import GGUF_BLOCKS, dequantize

    groups = x.reshape(x.shape[0], -1, 32)
    top = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, 0.0)  # torch's 127.0 / top is 127 * (1 / top)
    rounded = (torch.round(groups * inverse).double() * (top / 127.0).double()).reshape(x.shape)
    blocks = q.reshape(q.shape[0], -1, GGUF_BLOCKS[fmt][1]).clone()
    blocks[..., slice(*CODES[fmt])] = 0
    minimums = dequantize({"q": blocks.reshape(q.shape)}, fmt).double()
    return rounded @ dequantize({"q": q}, fmt).double().T + (x.double() - rounded) @ minimums.T


def gguf_type(fmt: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[fmt.upper()]


def theirs(blocks: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf_type(fmt)).copy())


# ---- dequantizing: bit-exact to gguf -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_tensors(gemma3_reader) -> list:
    """The Gemma file's tensors, as the gguf package reads them (the conftest opens it once: 262k tokens)."""
    return gemma3_reader.tensors


def test_gemma_file_tensors_dequantize_exactly_as_gguf(gemma_tensors):
    """Through the importer's kept_parts: Q4_K (attn_output, half the ffn_down), Q6_K (the other ffn_down) and Q5_0
    (attn_q / k, ffn_gate / up, half attn_v) of the first layers, equal to gguf's float32 values bit for bit."""
    from accessory.checkpoint.importers.gguf import KEPT_TYPES, kept_parts
    from accessory.quant.formats import dequantize

    checked = set()
    for t in gemma_tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_K", "Q6_K", "Q5_0") or not t.name.startswith(("blk.0.", "blk.1.", "blk.2.", "blk.3.")):
            continue
        fmt = KEPT_TYPES[kind][0]
        ours = dequantize(kept_parts(t.data, kind), fmt)
        assert torch.equal(ours, theirs(t.data, fmt).reshape(ours.shape)), t.name
        checked.add(kind)
    assert checked == {"Q4_K", "Q6_K", "Q5_0"}


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_synthetic_blocks_dequantize_exactly_as_gguf(fmt):
    """Random valid blocks (every bit pattern of the scales and values), and for Q5_0 gguf's own quantizer's."""
    from accessory.quant.formats import dequantize

    blocks = random_blocks(fmt, 21, 768, seed=1)
    assert torch.equal(dequantize({"q": torch.from_numpy(blocks)}, fmt), theirs(blocks, fmt))
    if fmt == "q5_0":
        values = np.random.default_rng(2).standard_normal((16, 160)).astype(np.float32)
        blocks = gguf.quants.quantize(values, gguf_type(fmt))
        assert torch.equal(dequantize({"q": torch.from_numpy(blocks)}, fmt), theirs(blocks, fmt))
    low = dequantize({"q": torch.from_numpy(blocks)}, fmt, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, theirs(blocks, fmt).bfloat16())


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_the_kernels_dequantize_exactly_as_gguf(fmt):
    """The dequantizing path's kernel (more rows than the products' kernels take): gguf's values bit for bit."""
    from accessory.kernels.build import cpu_kernels

    assert cpu_kernels()
    blocks = random_blocks(fmt, 21, 768, seed=4)
    assert torch.equal(torch.ops.accessory.dequantize_gguf_cpu(torch.from_numpy(blocks), fmt, 768),
                       theirs(blocks, fmt))


# ---- kernels --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 40, 520])
def test_quantized_linear_equals_f_linear_on_the_dequantized_weight(fmt, rows):
    """Below GGUF_INT8X_ROWS the exact kernel (but one row against ONE_ROW_INT8X in the AVX-512 build); from there
    (16, 40, 520) x in int8, its own arithmetic to float32's rounding and within x's rounding of the exact product;
    K = 768 (not a multiple of 512), an odd number of outputs; and bf16 input."""
    from accessory.kernels import quantized_linear
    from accessory.kernels.build import int8x_kernels, library_path
    from accessory.kernels.dispatch import GGUF_INT8X_ROWS
    from accessory.quant.formats import dequantize

    assert GGUF_INT8X_ROWS[fmt] == 16 and int8x_kernels()
    one_row_int8x = rows == 1 and fmt in ONE_ROW_INT8X and ctypes.CDLL(str(library_path())).accessory_int8x_one_row()
    q = torch.from_numpy(random_blocks(fmt, 77, 768, seed=rows))
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    exact = F.linear(x.double(), dequantize({"q": q}, fmt).double())
    reference = int8x_reference(x, q, fmt) if rows >= GGUF_INT8X_ROWS[fmt] or one_row_int8x else exact
    out = quantized_linear(x, fmt, q)
    assert out.dtype == torch.float32 and out.shape == (rows, 77)
    assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert (out.double() - exact).abs().max() <= 3e-2 * exact.abs().max()
    low = quantized_linear(x.bfloat16(), fmt, q)
    assert low.dtype == torch.bfloat16 and (low.double() - exact).abs().max() <= 3e-2 * exact.abs().max()


def test_a_block_format_embedding_looks_up_dequantized_rows():
    """A GGUF's token_embd may be Q4_K or Q6_K: the lookup dequantizes the rows it reads, as the whole table does."""
    from accessory.parallel.quantized_weight import QuantizedWeight

    table = QuantizedWeight("q6_k", 80, 512)
    table.q.copy_(torch.from_numpy(random_blocks("q6_k", 80, 512)))
    tokens = torch.tensor([[3, 79, 3], [0, 41, 12]])
    assert torch.equal(table.embed(tokens, torch.float32), table.dequantize()[tokens])


def test_exact_products_switch_off_every_int8_x_path():
    """exact_products(True): a prompt's products and one row against Q5_0, Q4_K and Q6_K all exact (the F.linear
    reference on the dequantized weight, to float32's rounding); False again restores x in int8."""
    from accessory.kernels import dispatch, quantized_linear
    from accessory.kernels.build import library_path
    from accessory.quant.formats import dequantize

    lib = ctypes.CDLL(str(library_path()))
    built = lib.accessory_int8x_one_row()
    dispatch.exact_products(True)
    try:
        assert not lib.accessory_int8x_one_row()
        for fmt in ONE_ROW_INT8X:
            q = torch.from_numpy(random_blocks(fmt, 40, 768, seed=5))
            weight = dequantize({"q": q}, fmt).double()
            for rows in (1, 20):
                x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
                reference = x.double() @ weight.T
                out = quantized_linear(x, fmt, q).double()
                assert (out - reference).abs().max() <= 1e-5 * reference.abs().max(), (fmt, rows)
    finally:
        dispatch.exact_products(False)
    assert lib.accessory_int8x_one_row() == built


@pytest.mark.parametrize("march,isa", [("haswell", "avx2"), ("skylake-avx512", "avx512"), ("x86-64", "generic")])
def test_every_kernel_variant_equals_the_reference(tmp_path, march, isa):
    """The AVX2 + FMA + F16C, AVX-512 without VNNI and plain C paths whatever this machine is (the native one runs
    above), called through ctypes on the C code alone; K = 1280 (5 blocks of 256), 1 to 6 rows (tiles and
    leftovers), and 9 rows with x in int8 (not built in plain C); one row against Q5_0, Q4_K and Q6_K takes x in int8
    in the AVX-512 build, and is exact once that is switched off (exact products)."""
    from accessory.kernels.build import SOURCES
    from accessory.quant.formats import dequantize

    library = tmp_path / f"kernels-{march}.so"
    subprocess.run(["cc", "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", str(SOURCES[0]), "-o",
                    str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.accessory_kernels_isa.restype = ctypes.c_char_p
    assert lib.accessory_kernels_isa().decode() == isa
    assert lib.accessory_int8x() == (isa != "generic")
    x = torch.randn(9, 1280, generator=torch.Generator().manual_seed(0))
    for fmt in K_FORMATS:
        q = torch.from_numpy(random_blocks(fmt, 37, 1280, seed=3))
        assert lib.accessory_int8x_one_row() == (isa == "avx512")
        for rows, one_row_int8x in ((1, True), (1, False), (2, True), (3, True), (4, True), (6, True)):
            lib.accessory_set_int8x_one_row(one_row_int8x)
            out = torch.empty(rows, 37)
            args = [x.data_ptr(), rows, 1280, q.data_ptr(), 37, out.data_ptr()]
            assert lib.accessory_linear_gguf(fmt.encode(), *[ctypes.c_int64(a) for a in args]) == 0
            reference = x[:rows].double() @ dequantize({"q": q}, fmt).double().T
            if rows == 1 and fmt in ONE_ROW_INT8X and lib.accessory_int8x_one_row():
                reference = int8x_reference(x[:1], q, fmt)
            assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max(), (fmt, rows)
        weights = torch.empty(37, 1280)
        args = [q.data_ptr(), 37, 1280, weights.data_ptr()]
        assert lib.accessory_dequantize_gguf(fmt.encode(), *[ctypes.c_int64(a) for a in args]) == 0
        assert torch.equal(weights, dequantize({"q": q}, fmt)), fmt
        if isa != "generic":
            out = torch.empty(9, 37)
            args = [x.data_ptr(), 9, 1280, q.data_ptr(), 37, out.data_ptr()]
            assert lib.accessory_linear_gguf_int8x(fmt.encode(), *[ctypes.c_int64(a) for a in args]) == 0
            reference = int8x_reference(x, q, fmt)
            assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max(), (fmt, "int8x")


def test_a_compiled_graph_calls_the_kernel():
    """The operator has a fake implementation: torch.compile traces through it without a graph break."""
    from accessory.kernels import quantized_linear
    from accessory.quant.formats import dequantize

    q = torch.from_numpy(random_blocks("q4_k", 64, 512))
    x = torch.randn(3, 512)
    compiled = torch.compile(lambda x, q: quantized_linear(x, "q4_k", q), fullgraph=True, backend="aot_eager")
    reference = x.double() @ dequantize({"q": q}, "q4_k").double().T
    assert (compiled(x, q).double() - reference).abs().max() <= 1e-5 * reference.abs().max()


# ---- refusals -------------------------------------------------------------------------------------------------------

def test_import_only_formats_are_not_quantizers(tmp_path, tiny_checkpoints):
    from accessory.checkpoint.quantize import quantize_checkpoint
    from accessory.quant.formats import quantize

    with pytest.raises(ValueError, match=r"'q4_k' is an import-only format .*GGUF's Q4_K.*\['int8', 'int4'\]"):
        quantize(torch.randn(4, 256), "q4_k")
    with pytest.raises(ValueError, match=r"--to: 'q6_k' is an import-only format"):
        quantize_checkpoint(tiny_checkpoints["mha", 1], tmp_path / "out", "q6_k")
    assert not (tmp_path / "out").exists()


def test_a_split_off_the_blocks_is_refused_by_name():
    """At 2 ranks the attention output's 256 inputs split 128 + 128 by heads: whole Q5_0 blocks of 32, not whole
    Q4_K blocks of 256. The refusal names the weight, the rank count and the block."""
    from accessory.errors import ConfigError
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.parallel import ParallelContext
    from accessory.parallel.quantized_weight import QuantizedWeight

    args = ModelArgs(**CONFIG)
    with torch.device("meta"):
        model = Transformer(args, ParallelContext(None, 0, 2, 0))
    model.quantize_({"layers.0.attention.wo.weight": "q5_0", "layers.0.feed_forward.w2.weight": "q6_k"})
    assert model.layers[0].feed_forward.w2.weight.q_shard.stop == 256 // 256 * 210  # rank 0: hidden [0, 256)
    with torch.device("meta"):
        model = Transformer(args, ParallelContext(None, 0, 2, 0))
    with pytest.raises(ConfigError, match=r"layers\.1\.attention\.wo\.weight as q4_k: q4_k stores whole blocks of "
                                          r"256 inputs, but this rank's inputs \[0, 128\) of 256 at 2 model-parallel "
                                          r"ranks do not fall on them"):
        model.quantize_({"layers.1.attention.wo.weight": "q4_k"})
    with pytest.raises(ValueError, match=r"320 input features per rank are not a multiple of q6_k's block of 256"):
        QuantizedWeight("q6_k", 8, 320)


# ---- a model holding them: GGUF -> checkpoint -> 1 and 2 ranks ------------------------------------------------------

# dim 256 (head dim 64), FFN 512: at 2 ranks w2's inputs split 256 + 256 (whole blocks of every format), wo's
# 128 + 128 (whole Q5_0 blocks only).
CONFIG = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=80, hidden_dim=512, max_seq_len=64)
TYPES = {"attn_q": "q4_k", "attn_k": "q5_k", "attn_v": "q6_k", "attn_output": "q5_0", "ffn_gate": "q4_k",
         "ffn_up": "q5_k", "ffn_down": "q6_k"}  # layer 1's ffn_down: q4_k


def write_gguf(path) -> dict[str, str]:
    """A llama-architecture GGUF whose matrices are K-quant blocks (Q8_0 embedding, Q6_K output, F32 norms), with
    a toy BPE vocabulary; returns our weight name -> format of its kept matrices."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(CONFIG["n_layers"])
    w.add_embedding_length(CONFIG["dim"])
    w.add_feed_forward_length(CONFIG["hidden_dim"])
    w.add_head_count(CONFIG["n_heads"])
    w.add_head_count_kv(CONFIG["n_kv_heads"])
    w.add_context_length(CONFIG["max_seq_len"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    tokens = ["<s>", "</s>", "<|endoftext|>"] + [chr(ord("a") + i) for i in range(26)]  # (transformers adds the 3rd)
    tokens += [f"{a}{b}" for a in "abcdefgh" for b in "abcdefgh"][:CONFIG["vocab_size"] - len(tokens)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([f"{t[0]} {t[1]}" for t in tokens if len(t) == 2])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    dim, hidden, kv = CONFIG["dim"], CONFIG["hidden_dim"], CONFIG["dim"] // CONFIG["n_heads"] * CONFIG["n_kv_heads"]
    shapes = {"attn_q": (dim, dim), "attn_k": (kv, dim), "attn_v": (kv, dim), "attn_output": (dim, dim),
              "ffn_gate": (hidden, dim), "ffn_up": (hidden, dim), "ffn_down": (dim, hidden)}
    rng = np.random.default_rng(0)
    embedding = (rng.standard_normal((CONFIG["vocab_size"], dim)) * 0.5).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embedding, gguf_type("q8_0")),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output.weight", random_blocks("q6_k", CONFIG["vocab_size"], dim, seed=99, scale=3e-4),
                 raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    kept = {"output.weight": "q6_k"}
    names = {"attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
             "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
             "ffn_down": "feed_forward.w2"}
    for i in range(CONFIG["n_layers"]):
        for name, fmt in TYPES.items():
            fmt = "q4_k" if (i, name) == (1, "ffn_down") else fmt
            blocks = random_blocks(fmt, *shapes[name], seed=10 * i + len(kept), scale=2e-4)
            w.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=gguf_type(fmt))
            kept[f"layers.{i}.{names[name]}.weight"] = fmt
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(dim, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    kept["tok_embeddings.weight"] = "int8"
    return kept


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """The synthetic GGUF converted with its bits kept (1 shard, then resharded to 2 on disk) and dequantized."""
    from accessory.checkpoint.convert import convert
    from accessory.checkpoint.reshard import reshard

    root = tmp_path_factory.mktemp("kquants")
    formats = write_gguf(root / "k.gguf")
    kept = convert("gguf", root / "k.gguf", root / "kept-1", 1, keep_quantized=True)
    return {"formats": formats, "kept-1": kept, "kept-2": reshard(kept, root / "kept-2", 2),
            "float": convert("gguf", root / "k.gguf", root / "float", 1)}


PROMPT = [0, 5, 9, 30, 41, 7, 12, 3, 60, 2]


def logits_of(folder) -> torch.Tensor:
    """Logits of PROMPT (10 rows: the kernels' path), on this rank."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=64)
    return model.llma(torch.tensor([PROMPT]))[0]


def logits_of_each(folders) -> list[torch.Tensor]:
    return [logits_of(folder) for folder in folders]


def test_convert_keeps_the_blocks_and_records_their_formats(converted):
    from accessory.checkpoint.inspect import inspect_checkpoint
    from accessory.model.meta import MetaModel

    meta = json.loads((converted["kept-1"] / "meta.json").read_text())
    assert meta["quantization"] == {"quant": "mixed", "group_size": 32, "tensors": converted["formats"]}
    report = inspect_checkpoint(converted["kept-1"])
    assert report.quantization == "mixed" and not report.problems
    model = MetaModel.from_pretrained(converted["kept-1"], max_seq_len=64)
    wq = model.llma.layers[0].attention.wq.weight
    assert wq.fmt == "q4_k" and wq.q.shape == (256, 144) and wq.nbytes == 256 * 256 * 4.5 / 8
    floating = MetaModel.from_pretrained(converted["float"], max_seq_len=64).llma.saved_tensors()
    for name, fmt in converted["formats"].items():  # the kept bits are the float import's values exactly
        weight = model.llma.get_submodule(name.removesuffix(".weight")).weight
        assert torch.equal(weight.dequantize(), floating[name]), name


def test_kept_model_at_1_and_2_ranks_gives_the_float_import_logits(converted):
    """At 2 ranks (from the 1-shard and the resharded 2-shard folder) w2's Q6_K / Q4_K inputs split on whole blocks,
    wo's Q5_0 on whole blocks of 32: each rank's partial products sum to the 1-rank logits."""
    reference = logits_of(converted["float"])
    alone = logits_of(converted["kept-1"])
    torch.testing.assert_close(alone, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
    folders = [converted["kept-1"], converted["kept-2"]]
    for rank, result in enumerate(run_ranks(2, logits_of_each, folders)):
        assert not isinstance(result, Exception), result.rank_traceback
        for folder, logits in zip(folders, result):
            torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4 * alone.abs().max().item(),
                                       msg=f"{folder.name}, rank {rank}")


def test_gemma_file_import_records_its_kept_formats(gemma3_gguf, gemma_tensors):
    """Google's Gemma 3 270M Q4_K_M, imported with its bits kept (the cached import that `from_pretrained("x.gguf")`
    makes, shared with tests/checkpoint/test_real_gemma.py, which checks its text): Q4_K, Q6_K, Q5_0 and Q8_0
    matrices, as the file holds them, recorded in meta.json and held so."""
    from accessory.checkpoint.direct import imported
    from accessory.model.meta import MetaModel

    folder = imported(gemma3_gguf)
    formats = json.loads((folder / "meta.json").read_text())["quantization"]["tensors"]
    assert set(formats.values()) == {"q4_k", "q6_k", "q5_0", "int8"}
    assert formats["layers.0.attention.wo.weight"] == "q4_k" and formats["layers.0.attention.wq.weight"] == "q5_0"
    types = {t.name: t.tensor_type.name.lower() for t in gemma_tensors}
    assert {fmt for name, fmt in formats.items() if ".feed_forward.w2." in name} == {"q4_k", "q6_k"}
    assert formats["layers.5.feed_forward.w2.weight"] == types["blk.5.ffn_down.weight"]
    model = MetaModel.from_pretrained(folder, max_seq_len=64)
    w2 = model.llma.layers[5].feed_forward.w2.weight
    assert w2.fmt == formats["layers.5.feed_forward.w2.weight"] and w2.q.dtype == torch.uint8
