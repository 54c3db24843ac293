"""LLaMA with LoRA and bias tuning (llama_type "llama_peft"), as defined in
LLaMA2-Accessory's `accessory/model/LLM/llama_peft.py` and `accessory/model/peft.py`: the llama model with every block linear (wq wk wv
wo w1 w2 w3) made LoRA- and bias-capable; embeddings, norms and the output projection are llama's.

Checkpoint names per linear, e.g. `layers.0.attention.wq.`: `weight`, `bias` (with bias_tuning), `lora_a.weight`
(lora_rank, in), `lora_b.weight` (out, lora_rank). The LoRA update is unscaled: y = x W^T + b + x A^T B^T.
LLaMA2-Accessory trains only the norms, biases and LoRA factors and can save just those; such a folder loads stacked
after its base: `MetaModel.from_pretrained([base_folder, peft_folder])`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from accessory.network.components import Linears
from accessory.network.LLM import llama
from accessory.parallel import LoraColumnParallelLinear, LoraRowParallelLinear


@dataclass
class ModelArgs(llama.ModelArgs):
    lora_rank: int = -1  # <= 0: no LoRA factors (LLaMA2-Accessory's default)
    bias_tuning: bool = True  # a bias on every block linear (LLaMA2-Accessory's default)
    # Training flag of LLaMA2-Accessory (norm weights are trained and saved with the trainable tensors); the norms
    # exist either way, so it has no effect on inference.
    norm_tuning: bool = True


class Transformer(llama.Transformer):
    def block_linears(self, args: ModelArgs) -> Linears:
        peft = dict(lora_rank=args.lora_rank, bias=args.bias_tuning)
        return Linears(column=functools.partial(LoraColumnParallelLinear, **peft),
                       row=functools.partial(LoraRowParallelLinear, **peft))
