"""A chat request's image: how the server reads images (ImageOptions), where a request's image part is (ImageRef),
and its pixels for the model, a bad image refused naming its field."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from accessory.data.images import ImageError, ImageLimits, image_from_url
from accessory.runtime.images import image_pixels as pixels_of
from accessory.serve.api_errors import APIError


@dataclass(frozen=True)
class ImageOptions:
    """How chat messages' image parts are read: the limits on each image, whether `image_url` may name a file on
    this machine (the server's --allow-local-images), and the transform to the model's pixels."""
    limits: ImageLimits = ImageLimits()
    allow_local_files: bool = False
    transform: str = "padded_resize"


@dataclass(frozen=True)
class ImageRef:
    """A request's image part: its URL, and where the part is (messages.i.content.j), named in errors."""
    url: str
    part: str

    @property
    def field(self) -> str:
        return f"{self.part}.image_url.url"


def image_pixels(model, image: ImageRef, options: ImageOptions) -> torch.Tensor:
    """The image's pixels for `model` (decoding is CPU work: call this in a worker thread); a bad image is a 400
    naming its field."""
    read = lambda: image_from_url(image.url, image.field, options.limits, options.allow_local_files)  # noqa: E731
    try:
        return pixels_of(model, read, options.transform, image.field)
    except ImageError as e:
        raise APIError(400, str(e), param=image.field) from None
