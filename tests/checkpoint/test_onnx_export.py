"""`accessory export onnx`: the exported model run by onnxruntime gives our logits (within 1e-4 relative) on a
prompt and on a cached next step fed its own present keys and values back as the past, at batch sizes and lengths
other than those it was traced with (dynamic axes); a quantized load is exported dequantized; an existing output
folder is refused, untouched. The oracle is our model's `forward` (the scoring path: no KV cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO

onnxruntime = pytest.importorskip("onnxruntime")

MAX_SEQ_LEN = 64
PROMPTS = torch.tensor([[1, 450, 4996, 17354, 1701], [1, 306, 763, 3186, 29892], [1, 15043, 29991, 13, 29871]])


def session(folder):
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])


def run_steps(sess, description: dict, prompts: torch.Tensor) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """onnxruntime's logits of the prompts (past empty), the next tokens (argmax), and the logits of a step fed
    those tokens with the first step's present as its past."""
    past_names = [name for name in description["inputs"] if name.startswith("past_key_values.")]
    heads, head_dim = description["inputs"][past_names[0]][1], description["inputs"][past_names[0]][3]
    empty = np.zeros((prompts.shape[0], heads, 0, head_dim), dtype=np.float32)
    first = sess.run(None, {"input_ids": prompts.numpy(), **{name: empty for name in past_names}})
    following = torch.from_numpy(first[0][:, -1].argmax(-1))[:, None]
    second = sess.run(None, {"input_ids": following.numpy(), **dict(zip(past_names, first[1:]))})
    return first[0], second[0], following


def relative_error(ours: torch.Tensor, theirs: np.ndarray) -> float:
    return float((ours - torch.from_numpy(theirs)).abs().max() / ours.abs().max())


def assert_matches(model, sess, folder, prompts):
    """onnxruntime's logits against `model.llma.forward` (whole sequences, nothing cached)."""
    description = json.loads((folder / "onnx.json").read_text())
    prompt_logits, step_logits, following = run_steps(sess, description, prompts)
    ours = model.llma.forward(prompts)
    assert relative_error(ours, prompt_logits) < 1e-4
    ours_next = model.llma.forward(torch.cat((prompts, following), dim=1))[:, -1:]
    assert relative_error(ours_next, step_logits) < 1e-4
    assert step_logits.shape == (prompts.shape[0], 1, model.llma.args.vocab_size)


@pytest.fixture(scope="module")
def exported(tiny_checkpoints, tmp_path_factory):
    """The tiny GQA model (tied embeddings, llama3 RoPE) exported by the command line."""
    folder = tmp_path_factory.mktemp("onnx") / "gqa"
    done = subprocess.run([sys.executable, "-m", "accessory", "export", "onnx", str(tiny_checkpoints["gqa", 1]),
                           str(folder), "--max_seq_len", str(MAX_SEQ_LEN)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(folder)
    return folder


def test_onnxruntime_logits_equal_ours_on_a_prompt_and_a_cached_step(exported, tiny_checkpoints):
    """3 rows of 5 tokens, then 1 token each after 5 cached positions (traced at 2 rows of 3 after 2)."""
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(tiny_checkpoints["gqa", 1], max_seq_len=MAX_SEQ_LEN, dtype="fp32",
                                      device="cpu")
    assert_matches(model, session(exported), exported, PROMPTS)
    assert_matches(model, session(exported), exported, PROMPTS[:1, :2])  # batch 1, length 2
    assert {p.name for p in exported.iterdir()} == {"model.onnx", "onnx.json", "tokenizer.model"}
    description = json.loads((exported / "onnx.json").read_text())
    assert description["max_seq_len"] == MAX_SEQ_LEN and len(description["outputs"]) == 1 + 2 * 2


def test_a_quantized_load_is_exported_dequantized(tiny_checkpoints, tmp_path):
    """int8 weights (the embedding too), as a GGUF import's kept bits load: onnxruntime's float32 logits equal
    the quantized model's (the same values, dequantized)."""
    from accessory.checkpoint.onnx_export import export_onnx
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=MAX_SEQ_LEN, dtype="fp32",
                                      device="cpu", quant="int8")
    assert model.llma.quantization, "the model is held quantized"
    ours = model.llma.forward(PROMPTS[:2])
    folder = export_onnx(model.llma, model.tokenizer.files, tmp_path / "mha")
    assert not model.llma.quantization  # exported from float32 weights
    prompt_logits, _, _ = run_steps(session(folder), json.loads((folder / "onnx.json").read_text()), PROMPTS[:2])
    assert relative_error(ours, prompt_logits) < 1e-4


def test_an_existing_output_folder_is_refused(exported, tiny_checkpoints):
    before = (exported / "model.onnx").read_bytes()
    done = subprocess.run([sys.executable, "-m", "accessory", "export", "onnx", str(tiny_checkpoints["gqa", 1]),
                           str(exported)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert done.returncode == 2
    assert f"{exported} already exists" in done.stderr
    assert (exported / "model.onnx").read_bytes() == before
