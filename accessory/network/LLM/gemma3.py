"""Gemma 3's text model (llama_type "gemma3", HF `Gemma3ForCausalLM`, and the language model of
`Gemma3ForConditionalGeneration`): LLaMA's decoder with

- GeGLU (GELU-tanh) feed-forward, RMSNorm scaling by (1 + weight), and sandwich norms (after attention and after
  the MLP too);
- embeddings scaled by sqrt(dim), q/k norm, and a query scale of query_pre_attn_scalar ** -0.5;
- local layers (a sliding window, RoPE base `rope_local_theta`, no scaling) and global ones (every sixth, by
  `layer_types`; RoPE base `rope_theta` with the config's scaling);
- final logits soft-capped when `final_logit_softcapping` is set (Gemma 2's; Gemma 3 sets none)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from accessory.network.LLM import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    qk_norm: ClassVar[bool] = True
    hidden_act: ClassVar[str] = "gelu_tanh"
    norm_offset: ClassVar[float] = 1.0
    sandwich_norms: ClassVar[bool] = True

    query_pre_attn_scalar: Optional[float] = None  # None: head_dim
    rope_local_theta: float = 10000.0  # the sliding layers' RoPE base
    final_logit_softcapping: Optional[float] = None

    def rope(self, window):
        if window is not None:
            return self.rope_local_theta, None
        return super().rope(window)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.dim)

    @property
    def logit_softcap(self) -> Optional[float]:
        return self.final_logit_softcapping


Transformer = llama.Transformer
