"""Registry of model types (`llama_type` in meta.json). One file per type, named as the type (LLaMA2-Accessory's
convention); types share network/components.py (docs/adding-a-model.md)."""
import importlib

from accessory.errors import ConfigError

LLAMA_TYPES = ("llama", "llama_peft", "llava", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen3_moe")
# LLaMA2-Accessory's multimodal types (adapters, Q-Former, SPHINX ensembles): refused by name.
ACCESSORY_MULTIMODAL = ("llama_adapter", "llama_qformer", "llama_qformerv2", "llama_qformerv2_peft", "llama_ens",
                        "llama_ens5", "llama_ens5p2", "llama_ens10", "llama_ens_light", "llama_ens_peft")


def model_classes(llama_type: str, source: str = "llama_type"):
    """(ModelArgs, Transformer) for a llama_type; an unknown one is an error, never a guess."""
    if llama_type in LLAMA_TYPES:
        module = importlib.import_module(f"accessory.network.LLM.{llama_type}")
        return module.ModelArgs, module.Transformer
    if llama_type in ACCESSORY_MULTIMODAL:
        raise ConfigError(f"{source}: llama_type {llama_type!r} is one of LLaMA2-Accessory's multimodal types "
                          f"(adapter, Q-Former, SPHINX), which this version cannot load. Vision-language models load "
                          f"as 'llava' (import an HF LLaVA folder with `accessory convert hf`); supported types: "
                          f"{list(LLAMA_TYPES)}")
    raise ConfigError(f"{source}: unknown llama_type {llama_type!r}; this version supports {list(LLAMA_TYPES)}")
