"""LLaVA (llama_type "llava"): a vision tower and a projector (network/vision.py) in front of the llama language model.

An image becomes `image_tokens` embeddings that take the places of as many image tokens (`image_token_index`) in the
prompt, as in HF's LlavaForConditionalGeneration; `MetaModel.encode_prompt` puts them where the prompt's "<image>"
placeholder is, or right after BOS (where LLaMA2-Accessory puts its visual tokens). From there on the sequence is
plain llama: the KV cache, decoding, sampling and tensor parallelism are the language model's.

Checkpoint names: the language model's are llama's; the tower's are HF's CLIP / SigLIP vision names under
`vision_tower.` (without HF's `vision_model.`), the projector's `multi_modal_projector.linear_{1,2}.{weight,bias}`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from accessory.data.transform import CLIP_MEAN, CLIP_STD
from accessory.errors import ConfigError
from accessory.network.LLM import llama
from accessory.network.vision import ImagePlacement, Projector, VisionTower, place_features, tower_config

STRATEGIES = ("default", "full")  # HF's vision_feature_select_strategy: drop the first (class) token, or keep all


@dataclass
class ModelArgs(llama.ModelArgs):
    vision: Optional[dict] = None  # the tower's config, HF's names (vision.TOWER_KEYS); required
    vision_feature_layer: int = -2  # which hidden state of the tower feeds the projector (HF's numbering)
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    image_token_index: int = 32000  # the token an image's embeddings replace
    image_mean: list = field(default_factory=lambda: list(CLIP_MEAN))  # the tower's pixel normalisation
    image_std: list = field(default_factory=lambda: list(CLIP_STD))

    def __post_init__(self):
        super().__post_init__()
        if self.vision is None:
            raise ConfigError("a llava config needs \"vision\": the vision tower's config")
        self.vision = tower_config(self.vision, "config")
        if isinstance(self.vision_feature_layer, bool) or not isinstance(self.vision_feature_layer, int):
            raise ConfigError(f"vision_feature_layer must be an integer (one hidden state of the tower), got "
                              f"{self.vision_feature_layer!r}")
        if self.vision_feature_select_strategy not in STRATEGIES:
            raise ConfigError(f"vision_feature_select_strategy must be one of {STRATEGIES}, got "
                              f"{self.vision_feature_select_strategy!r}")
        if not 0 <= self.image_token_index < (self.vocab_size if self.vocab_size > 0 else 1 << 24):
            raise ConfigError(f"image_token_index {self.image_token_index!r} is not a token of the vocabulary "
                              f"(vocab_size {self.vocab_size})")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if not (isinstance(value, (list, tuple)) and len(value) == self.vision["num_channels"]
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
                raise ConfigError(f"{name} must be {self.vision['num_channels']} numbers, one per channel, got "
                                  f"{value!r}")
        if any(v <= 0 for v in self.image_std):
            raise ConfigError(f"image_std must be positive, got {self.image_std!r}")

    @property
    def image_tokens(self) -> int:
        """How many token positions one image fills: the tower's patches (and CLIP's class token), less the first
        with the "default" strategy."""
        patches = (self.vision["image_size"] // self.vision["patch_size"]) ** 2
        with_class = patches + (self.vision["model_type"] == "clip_vision_model")
        return with_class - (self.vision_feature_select_strategy == "default")


class Transformer(llama.Transformer):
    def __init__(self, args: ModelArgs, ctx, stage=None):
        super().__init__(args, ctx, stage)
        vision = args.vision
        self.vision_tower = VisionTower(vision)  # replicated on every rank
        self.multi_modal_projector = Projector(vision["hidden_size"], args.dim, args.projector_hidden_act,
                                               args.projector_bias)

    @property
    def image_size(self) -> int:
        return self.args.vision["image_size"]

    @property
    def image_tokens(self) -> int:
        return self.args.image_tokens

    @property
    def image_token(self) -> int:
        return self.args.image_token_index

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """(images, image_tokens, dim) language-model embeddings of transformed images (images, C, S, S)."""
        x = self.vision_tower.hidden_state(pixels.to(self.device), self.args.vision_feature_layer)
        if self.args.vision_feature_select_strategy == "default":
            x = x[:, 1:]
        return self.multi_modal_projector(x)

    def embed(self, tokens: torch.Tensor, images: list[ImagePlacement] = ()) -> torch.Tensor:
        h = self.tok_embeddings(tokens, self.dtype)
        if images:
            features = self.image_features(torch.stack([image.pixels for image in images]))
            place_features(h, tokens, self.image_token, list(images), features)
        return h
