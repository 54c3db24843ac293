"""The vision side of a vision-language model: a CLIP- or SigLIP-style ViT and the projector that maps its patch
features into the language model's embedding space (LLaVA's design).

The ViT is written here, small and plain, rather than taken from transformers: its blocks share nothing with the
LLaMA blocks in components.py (LayerNorm, biases, a GELU MLP, bidirectional attention, learned positions, a class
token), and a module of our own builds on the meta device, loads through checkpoint/load.py like every other
tensor, and does not move with transformers' internals. transformers' LlavaForConditionalGeneration is the oracle
it is tested against (tests/network/test_multimodal.py).

Under tensor parallelism the tower and the projector are replicated: every rank holds them whole and computes the
same features from the same pixels (the engine sends the pixels with the plan that admits the prompt). See
docs/multimodal.md for why.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from accessory.errors import ConfigError

# HF's names for the activations LLaVA-family towers and projectors use.
ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # OpenAI CLIP's
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # SigLIP's
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}
TOWERS = ("clip_vision_model", "siglip_vision_model")
# The keys of a tower's config (HF's CLIPVisionConfig / SiglipVisionConfig names), with their defaults.
TOWER_KEYS = {"model_type": "clip_vision_model", "hidden_size": None, "intermediate_size": None,
              "num_hidden_layers": None, "num_attention_heads": None, "image_size": None, "patch_size": None,
              "num_channels": 3, "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu"}


def tower_config(values: dict, source: str) -> dict:
    """A tower config with every key, checked: the model type, sizes that are positive integers and divide."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: vision must be a dict of {sorted(TOWER_KEYS)}, got {values!r}")
    unknown = sorted(set(values) - set(TOWER_KEYS))
    if unknown:
        raise ConfigError(f"{source}: vision: unknown key(s) {unknown}; known: {sorted(TOWER_KEYS)}")
    config = {**TOWER_KEYS, **values}
    missing = sorted(k for k, v in config.items() if v is None)
    if missing:
        raise ConfigError(f"{source}: vision: missing key(s) {missing}")
    if config["model_type"] not in TOWERS:
        raise ConfigError(f"{source}: vision.model_type {config['model_type']!r} is not supported; expected one of "
                          f"{list(TOWERS)}")
    if config["hidden_act"] not in ACTIVATIONS:
        raise ConfigError(f"{source}: vision.hidden_act {config['hidden_act']!r} is not supported; expected one of "
                          f"{sorted(ACTIVATIONS)}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size", "num_channels"):
        if isinstance(config[key], bool) or not isinstance(config[key], int) or not 1 <= config[key] <= 1 << 16:
            raise ConfigError(f"{source}: vision.{key} must be an integer in [1, 65536], got {config[key]!r}")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ConfigError(f"{source}: vision.hidden_size ({config['hidden_size']}) must be divisible by "
                          f"num_attention_heads ({config['num_attention_heads']})")
    if config["image_size"] % config["patch_size"]:
        raise ConfigError(f"{source}: vision.image_size ({config['image_size']}) must be a multiple of patch_size "
                          f"({config['patch_size']})")
    return config


class VisionEmbeddings(nn.Module):
    """Patches -> vectors, plus learned positions; CLIP prepends a class token (whose position is the first)."""

    def __init__(self, config: dict):
        super().__init__()
        dim, patch, self.clip = config["hidden_size"], config["patch_size"], config["model_type"] == "clip_vision_model"
        self.patch_embedding = nn.Conv2d(config["num_channels"], dim, patch, stride=patch, bias=not self.clip)
        patches = (config["image_size"] // patch) ** 2
        if self.clip:
            self.class_embedding = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.position_embedding = nn.Embedding(patches + self.clip, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.clip:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (proj(x).view(batch, length, self.n_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        attended = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(attended.transpose(1, 2).reshape(batch, length, dim))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        dim, eps = config["hidden_size"], config["layer_norm_eps"]
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.self_attn = VisionAttention(dim, config["num_attention_heads"])
        self.mlp = VisionMLP(dim, config["intermediate_size"], config["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config["num_hidden_layers"]))


class VisionTower(nn.Module):
    """The ViT, under HF's module names (checkpoints keep them below `vision_tower.`). `hidden_state(pixels, k)`
    is what HF's `hidden_states[k]` is: 0 the embeddings (after CLIP's pre-norm), i the output of layer i; only the
    layers up to k run. The post-norm is kept for the checkpoint's sake: LLaVA reads hidden states, never it."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.embeddings = VisionEmbeddings(config)
        dim, eps = config["hidden_size"], config["layer_norm_eps"]
        if config["model_type"] == "clip_vision_model":
            self.pre_layrnorm = nn.LayerNorm(dim, eps=eps)  # sic: CLIP's name
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)

    def hidden_state(self, pixels: torch.Tensor, layer: int) -> torch.Tensor:
        layers = len(self.encoder.layers)
        index = layer + layers + 1 if layer < 0 else layer
        if not 0 <= index <= layers:
            raise ConfigError(f"vision_feature_layer {layer} is outside the tower's hidden states "
                              f"[-{layers + 1}, {layers}]")
        x = self.embeddings(pixels)
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        for block in self.encoder.layers[:index]:
            x = block(x)
        return x


class Projector(nn.Module):
    """LLaVA-1.5's "mlp2x_gelu": linear, activation, linear, from the tower's width to the language model's."""

    def __init__(self, vision_dim: int, dim: int, act: str, bias: bool = True):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ConfigError(f"projector_hidden_act {act!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
        self.linear_1, self.linear_2 = nn.Linear(vision_dim, dim, bias=bias), nn.Linear(dim, dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImagePlacement(NamedTuple):
    """An image whose features fill the image tokens of tokens[row, start:stop] (a prompt, or the part of one that
    a prefill computes: then its image tokens are the last ones of the image, and take the last features)."""
    row: int
    start: int
    stop: int
    pixels: torch.Tensor  # (channels, image_size, image_size), already transformed


def place_features(h: torch.Tensor, tokens: torch.Tensor, image_token: int, placements: list[ImagePlacement],
                   features: torch.Tensor) -> None:
    """Write each placement's features (features[i]: (image tokens, dim)) over the embeddings h of its image
    tokens, in place."""
    for placement, image in zip(placements, features):
        where = (tokens[placement.row, placement.start:placement.stop] == image_token).nonzero()[:, 0]
        if len(where) > len(image):
            raise ValueError(f"a prompt holds {len(where)} image tokens; an image fills {len(image)}")
        h[placement.row, where + placement.start] = image[len(image) - len(where):].to(h.dtype)


def check_pixels(pixels, channels: int, size: int, what: str) -> torch.Tensor:
    """`pixels` as a float tensor (channels, size, size); ValueError naming `what` otherwise."""
    expected = f"a float tensor of shape ({channels}, {size}, {size}) (from accessory.data.transform.get_transform)"
    if not isinstance(pixels, torch.Tensor):
        raise ValueError(f"{what} must be {expected}, got {type(pixels).__name__}")
    if pixels.dim() == 4 and pixels.shape[0] == 1:
        pixels = pixels[0]
    if tuple(pixels.shape) != (channels, size, size) or not pixels.is_floating_point():
        raise ValueError(f"{what} must be {expected}, got shape {tuple(pixels.shape)} {pixels.dtype}")
    if not torch.isfinite(pixels).all():
        raise ValueError(f"{what} holds NaN or infinite values")
    return pixels.detach().to("cpu", torch.float32).contiguous()


def image_key(pixels: torch.Tensor) -> int:
    """A 56-bit digest of an image's pixels: two prompts share a KV-cache prefix through an image only if it is the
    same image (the engine's prefix cache keys the image's positions on it)."""
    return int.from_bytes(hashlib.blake2b(pixels.numpy().tobytes(), digest_size=7).digest(), "little")


def optional_pixels(images, count: int, channels: int, size: int, what: str) -> list[Optional[torch.Tensor]]:
    """`images` for `count` prompts: None; one tensor (count, C, S, S); or a list of tensors or None, one per
    prompt. A list of `count` entries (each checked), or ValueError naming the problem."""
    if images is None:
        return [None] * count
    if isinstance(images, torch.Tensor):
        if images.dim() != 4:
            raise ValueError(f"{what} must be a tensor (prompts, {channels}, {size}, {size}) or a list with one "
                             f"image or None per prompt, got shape {tuple(images.shape)}")
        images = list(images)
    images = list(images)
    if len(images) != count:
        raise ValueError(f"{len(images)} images for {count} prompts: give one image (or None) per prompt")
    return [None if image is None else check_pixels(image, channels, size, f"{what}[{i}]")
            for i, image in enumerate(images)]
