"""An image to a model's pixels, however it was read (a file, a URL, bytes), any refusal naming the field or option
the image came from, once."""
from __future__ import annotations

from typing import Callable

import torch
from PIL import Image

from accessory.data.images import ImageError


def image_pixels(model, read: Callable[[], Image.Image], transform: str, field: str) -> torch.Tensor:
    """`model`'s pixels of the image `read()` returns, by the transform named `transform`. An ImageError of either (a
    bad file, an image too large for the transform) is raised again with `field` starting its message: reading
    usually names it already, the transform never does."""
    try:
        return model.image_transform(transform)(read())
    except ImageError as e:
        raise ImageError(str(e) if str(e).startswith(field) else f"{field}: {e}") from None
