"""Image preprocessing for the visual encoder, drop-in for LLaMA2-Accessory's `accessory.data.transform`.

`get_transform("padded_resize", 224)(pil_image)` gives the normalized float32 tensor (3, 224, 224) a CLIP encoder
takes. Every step stays in uint8 PIL until the final float conversion, as HF's (PIL) CLIPImageProcessor does, so
the pixels match that reference exactly; PIL, numpy and torch only (no torchvision).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from accessory.data.images import ImageError

# OpenAI CLIP's normalization, used by LLaVA and LLaMA2-Accessory.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

TRANSFORMS = ("padded_resize", "resized_center_crop")

# Both transforms go through a full-size intermediate (the padded square, or the image resized before its crop), as
# the reference does; a 1 x 40M-pixel image would make that far larger than any memory, so an image whose intermediate
# is larger than this is refused. Every 40-megapixel photo up to 2.5:1 passes.
MAX_INTERMEDIATE_PIXELS = 100_000_000


def get_transform(name: str, size: int = 224, mean: Sequence[float] = CLIP_MEAN,
                  std: Sequence[float] = CLIP_STD) -> "ImageTransform":
    """The transform called `name` ("padded_resize" or "resized_center_crop"), to a size x size square.

    "padded_resize" pads the image to a square with the mean colour (LLaVA-1.5's "pad"), then resizes it;
    "resized_center_crop" resizes the shortest side to `size` and crops the centre (CLIP's own preprocessing).
    """
    if name not in TRANSFORMS:
        raise ValueError(f"unknown image transform {name!r}; expected one of {', '.join(TRANSFORMS)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"image transform size must be an int >= 1, got {size!r}")
    return ImageTransform(name, size, _channels("mean", mean), _channels("std", std))


def _channels(what: str, values: Sequence[float]) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if len(values) != 3:
        raise ValueError(f"image {what} must have 3 values (R, G, B), got {len(values)}: {values}")
    if what == "std" and min(values) <= 0:
        raise ValueError(f"image std values must be > 0, got {values}")
    return values


@dataclass(frozen=True)
class ImageTransform:
    """A PIL image -> float32 tensor (3, size, size), normalized by mean and std per channel."""
    name: str
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if not isinstance(image, Image.Image):
            raise TypeError(f"image transform {self.name!r} takes a PIL image, got {type(image).__name__}")
        self._check_intermediate(image.size)
        # convert("RGB") drops alpha as LLaVA's and Accessory's loaders do (HF would composite it on white).
        image = image.convert("RGB") if image.mode != "RGB" else image
        if self.name == "padded_resize":
            square = expand_to_square(image, tuple(int(m * 255) for m in self.mean))
            image = square.resize((self.size, self.size), Image.Resampling.BICUBIC)
        else:
            image = center_crop(resize_shortest_side(image, self.size), self.size)
        return self._normalize(image)

    def _check_intermediate(self, image_size: tuple[int, int]) -> None:
        width, height = image_size
        if self.name == "padded_resize":
            inter_w = inter_h = max(width, height)
        else:
            inter_w, inter_h = _shortest_side_size(width, height, self.size)
        if inter_w * inter_h > MAX_INTERMEDIATE_PIXELS:
            raise ImageError(f"image {width}x{height} is too large for {self.name!r} at size {self.size}: its "
                             f"intermediate {inter_w}x{inter_h} image would have {inter_w * inter_h} pixels; the limit "
                             f"is {MAX_INTERMEDIATE_PIXELS} (crop or shrink the image first)")

    def _normalize(self, image: Image.Image) -> torch.Tensor:
        # The same float steps as HF: uint8 -> float64 * (1/255) -> float32, then (x - mean) / std in float32.
        pixels = (np.asarray(image, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
        pixels = (pixels - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)  # (H, W, 3)
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))  # (3, H, W)


def expand_to_square(image: Image.Image, background: tuple[int, ...]) -> Image.Image:
    """Pad to a square with `background`, the image centred as LLaVA's `expand2square` places it."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new(image.mode, (side, side), background)
    square.paste(image, (0, (width - height) // 2) if width > height else ((height - width) // 2, 0))
    return square


def resize_shortest_side(image: Image.Image, size: int) -> Image.Image:
    """Resize (BICUBIC) so the shortest side is `size`; the long side is truncated, int(size * long / short),
    as HF's get_resize_output_image_size computes it."""
    return image.resize(_shortest_side_size(*image.size, size), Image.Resampling.BICUBIC)


def _shortest_side_size(width: int, height: int, size: int) -> tuple[int, int]:
    long_side = int(size * max(width, height) / min(width, height))
    return (size, long_side) if width <= height else (long_side, size)


def center_crop(image: Image.Image, size: int) -> Image.Image:
    """The central size x size square. The offsets floor, (h - size) // 2, as HF's CLIPImageProcessor (the
    reference) does; torchvision's CenterCrop rounds instead and lands one pixel further when h - size is odd."""
    width, height = image.size
    top, left = (height - size) // 2, (width - size) // 2
    return image.crop((left, top, left + size, top + size))
