"""Kernels the runtime compiles for the machine it runs on (cpu_kernels.c, torch_ops.cpp): matrix products for a
decode step's few rows (float32 and weight-only quantized weights), decode attention (alone, or with the steps
before it), RMSNorm and rotary embeddings, on the CPU. build.py compiles and loads them; dispatch.py picks them, or
the portable torch path, for each call."""
from accessory.kernels.build import cpu_kernels, kernel_isa
from accessory.kernels.dispatch import (ACTIVATIONS, apply_rope, attends_in_one_call, decode_attention, expert_product,
                                        gated, grouped_experts, linear, products_in_one_call, quantized_linear,
                                        rms_norm)

__all__ = ["cpu_kernels", "kernel_isa", "linear", "quantized_linear", "decode_attention", "expert_product",
           "grouped_experts", "rms_norm", "apply_rope", "gated", "attends_in_one_call", "products_in_one_call",
           "ACTIVATIONS"]
