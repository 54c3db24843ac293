"""Qwen3-MoE (llama_type "qwen3_moe", HF `Qwen3MoeForCausalLM`): Mixtral's decoder (a mixture of experts for every
feed-forward) with Qwen3's RMSNorm over each head's q and k; its router renormalises the top k weights only if
`moe.norm_topk_prob` (HF's `norm_topk_prob`) says so."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from accessory.network.LLM import mixtral


@dataclass
class ModelArgs(mixtral.ModelArgs):
    qk_norm: ClassVar[bool] = True


Transformer = mixtral.Transformer
