"""Registry of model types (`llama_type` in meta.json). One file per type; types share model/components.py."""
from accessory.errors import ConfigError

LLAMA_TYPES = ("llama", "llama_peft")


def model_classes(llama_type: str, source: str = "llama_type"):
    """(ModelArgs, Transformer) for a llama_type; an unknown one is an error, never a guess."""
    if llama_type == "llama":
        from accessory.model.LLM.llama import ModelArgs, Transformer
        return ModelArgs, Transformer
    if llama_type == "llama_peft":
        from accessory.model.LLM.llama_peft import ModelArgs, Transformer
        return ModelArgs, Transformer
    raise ConfigError(f"{source}: unknown llama_type {llama_type!r}; this version supports {list(LLAMA_TYPES)}")
