"""accessory: tensor-parallel inference for LLaMA-family models, compatible with LLaMA2-Accessory."""
__version__ = "0.1.0"
