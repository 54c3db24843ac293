"""Mixtral (llama_type "mixtral", LLaMA2-Accessory's type of that name, HF `MixtralForCausalLM`): LLaMA's decoder
with a mixture of experts for every feed-forward (components.py `MoEFeedForward`).

LLaMA2-Accessory's config.json: dim, hidden_dim (each expert's), head_dim, n_layers, n_heads, n_kv_heads,
norm_eps, rope_theta, `moe: {"num_experts": 8, "num_experts_per_tok": 2}` (and load_balancing_weight, a training
loss weight). Its shards hold the router `layers.N.feed_forward.gate.weight` whole in every shard, and each expert
`layers.N.feed_forward.experts.E.w1/w2/w3.weight` whole in the one shard its global id E falls in (shard r of M:
experts r*E/M ..); this runtime loads and saves that layout at any shard and rank count (parallel/layers.py
`expert_placement`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from accessory.network.config import MoEConfig
from accessory.network.LLM import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    rope_theta: float = 1000000.0
    # {"num_experts": E, "num_experts_per_tok": k, "norm_topk_prob": true (default; Qwen3-MoE's may say false)}
    moe: dict = field(default_factory=lambda: {"num_experts": 8, "num_experts_per_tok": 2})
    load_balancing_weight: float = 0.1  # LLaMA2-Accessory's training loss weight; no effect on inference

    @property
    def experts(self) -> MoEConfig:
        return MoEConfig(self.moe["num_experts"], self.moe["num_experts_per_tok"], self.moe.get("norm_topk_prob", True))


Transformer = llama.Transformer
