"""The built-in real model, SmolLM2-135M-Instruct (imported from its GGUF as 3 shards), end to end: the CLI under
torchrun at 3 ranks and alone, the first 32 greedy tokens against HF transformers on the same GGUF (at 1, 2 and 3
ranks: 2 splits its 3 GQA groups unevenly), and a refusal at 4 ranks that comes before any weight is read."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from distributed import free_port, run_ranks
from tiny import greedy_ids

QUESTION = "What is the capital of France?"
GEN_STEPS = 32


def accessory_cli(args: list[str], ranks: int | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`accessory ...` as a user runs it: alone, or under `torchrun --nproc-per-node=ranks`."""
    if ranks is None:
        command = [sys.executable, "-m", "accessory", *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "accessory", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("ranks", [3, None], ids=["torchrun-3-ranks", "single-process"])
def test_chat_answers_paris(smollm2_checkpoint, ranks):
    """(9 ranks: tests/quant/test_quant.py's one 9-rank run, float32 and the kept int4 bits against one process.)"""
    result = accessory_cli(["generate", "--pretrained_path", str(smollm2_checkpoint), "--chat",
                            "--prompt", QUESTION, "--max_gen_len", "48"], ranks)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert result.stdout.count("\n") == 1, "only the source rank prints, and only the answer"
    assert "<|im_end|>" not in result.stdout


def test_quantized_chat_from_the_command_line_answers_paris():
    """`--quant int4` with the built-in model: its GGUF's own Q4_1 bits (imported with them kept), at 3 ranks."""
    result = accessory_cli(["generate", "--chat", "--prompt", QUESTION, "--max_gen_len", "48", "--quant", "int4"], 3)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "quantized weights: 210 int4, 1 int8" in result.stderr


def test_four_ranks_are_refused_before_loading(smollm2_checkpoint):
    result = accessory_cli(["generate", "--pretrained_path", str(smollm2_checkpoint), "--prompt", "hi"], ranks=4)
    assert result.returncode != 0
    assert ("cannot run this model at 4 model-parallel ranks: the model-parallel size (4) is more than n_kv_heads "
            "(3) but not a multiple of it") in result.stderr
    assert "it runs at [1, 2, 3, 6, 9] ranks" in result.stderr
    assert "loading weights" not in result.stderr and "loaded" not in result.stderr


def greedy_tokens(folder) -> list[int]:
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=512)
    ids = model.tokenizer.encode_chat(QUESTION)
    # no stop tokens: compare all 32 steps, past the end of the answer too
    return ids, greedy_ids(model, [ids], GEN_STEPS)[0]


@pytest.fixture(scope="module")
def hf_greedy_on_gguf(smollm2_hf, smollm2_checkpoint):
    from accessory.text.tokenizer import Tokenizer

    ids = Tokenizer.from_path(smollm2_checkpoint).encode_chat(QUESTION)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(GEN_STEPS):
            tokens = torch.cat([tokens, smollm2_hf(tokens).logits[:, -1:].argmax(-1)], dim=1)
    return ids, tokens[0, len(ids):].tolist()


@pytest.mark.parametrize("ranks", [1, 2, 3])  # 2: its 3 KV heads' groups split unevenly (2 and 1)
def test_first_32_greedy_tokens_equal_hf_transformers_on_the_gguf(smollm2_checkpoint, hf_greedy_on_gguf, ranks):
    hf_ids, hf_tokens = hf_greedy_on_gguf
    results = [greedy_tokens(smollm2_checkpoint)] if ranks == 1 else run_ranks(ranks, greedy_tokens,
                                                                                  smollm2_checkpoint)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        ids, tokens = result
        assert ids == hf_ids
        assert tokens == hf_tokens, f"rank {rank}"
