"""Mistral (llama_type "mistral", HF `MistralForCausalLM`): LLaMA's decoder; Mistral-7B-v0.1 attends through a
sliding window of 4096 positions on every layer (`sliding_window`), later versions to everything. Nothing else
differs, so this family is LLaMA's classes under its own name (its checkpoints say what they are)."""
from accessory.network.LLM.llama import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer"]
