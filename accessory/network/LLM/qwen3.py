"""Qwen3 (llama_type "qwen3", HF `Qwen3ForCausalLM`): LLaMA's decoder with an RMSNorm over each head's q and k
before RoPE, and an explicit head_dim (128 whatever the width)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from accessory.network.LLM import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    qk_norm: ClassVar[bool] = True


Transformer = llama.Transformer
