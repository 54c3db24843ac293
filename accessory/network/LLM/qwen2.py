"""Qwen2 and Qwen2.5 (llama_type "qwen2", HF `Qwen2ForCausalLM`): LLaMA's decoder with a bias on q, k and v.

Tied or untied embeddings, GQA, and a sliding window on some layers when a config asks for one, come from the
shared config keys; long-context checkpoints use yarn RoPE scaling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from accessory.network.LLM import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    qkv_bias: ClassVar[bool] = True


Transformer = llama.Transformer
