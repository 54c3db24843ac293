"""Reading images from untrusted input: HTTP `image_url` parts, `--image FILE`, batch records.

Every limit is checked before the work it bounds: the byte count before the bytes are decoded (a base64 payload's
size from its length, a file's from stat), the pixel count from the header before any pixel is decoded. Nothing is
ever fetched from the network, and local files are read only where the operator allows it.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image, ImageOps

from accessory.errors import AccessoryError


# The raster formats opened; PIL's others stay off for untrusted bytes (EPS, for one, runs Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class ImageError(AccessoryError, ValueError):
    """An image that is missing, too large, unreadable, or named by a URL that is refused."""


@dataclass(frozen=True)
class ImageLimits:
    """The most bytes (encoded) and pixels (width x height) one image may have."""
    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageLimits.{name} must be an int >= 1, got {value!r}")


def decode_image(data: bytes, what: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The RGB image encoded in `data`, fully loaded; `what` names the input in errors."""
    _check_bytes(len(data), what, limits)
    # PIL's bomb warning stays a warning: making it an error with warnings.catch_warnings swaps process-wide state,
    # unsafe across server threads. max_pixels (below PIL's own limit by default) is the refusal.
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:  # lazy: reads the header only
            _check_pixels(image.size, what, limits)
            # decodes every pixel, so any decode failure is raised in here; a photo's EXIF orientation is applied,
            # as transformers' load_image does: the model sees it upright, as a viewer shows it
            return ImageOps.exif_transpose(image).convert("RGB")
    except ImageError:
        raise
    except Image.UnidentifiedImageError:
        raise ImageError(f"{what}: not a readable image (not {', '.join(IMAGE_FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{what}: image is too large to decode ({e}); the limit is {limits.max_pixels} "
                         "pixels") from None
    except Exception as e:  # noqa: BLE001 - any failure to decode untrusted bytes is the input's fault
        raise ImageError(f"{what}: not a readable image ({type(e).__name__}: {e})") from None


def read_image_file(path: str | os.PathLike, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The RGB image in the file `path`; its size is checked by stat before any byte is read."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ImageError(f"{path}: no such image file") from None
    except OSError as e:
        raise ImageError(f"{path}: cannot read the image file ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ImageError(f"{path}: is {kind}; expected an image file")
    _check_bytes(info.st_size, str(path), limits)
    try:
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)  # a file that grew since stat is still caught by decode_image
    except OSError as e:
        raise ImageError(f"{path}: cannot read the image file ({e.strerror or e})") from None
    return decode_image(data, str(path), limits)


def image_from_url(url: str, what: str, limits: ImageLimits = ImageLimits(),
                   allow_local_files: bool = False) -> Image.Image:
    """The RGB image that an OpenAI `image_url` names: a `data:image/...;base64,` URL, or (only with
    `allow_local_files`) a `file:///abs/path` URL or an absolute path. Remote URLs are refused, never fetched."""
    if not isinstance(url, str):
        raise ImageError(f"{what}: an image URL must be a string, got {type(url).__name__}")
    scheme = _scheme(url)
    if scheme == "data":
        return decode_image(_data_url_bytes(url, what, limits), what, limits)
    if scheme == "file" or (scheme is None and url.startswith("/")):
        return _local_image(url, what, limits, allow_local_files)
    if scheme is None:
        raise ImageError(f"{what}: {_clip(url)} is not an image URL; expected data:image/<type>;base64,<payload>")
    raise ImageError(f"{what}: remote image URLs are refused: the server fetches nothing from the network (a "
                     "request could otherwise make it reach internal hosts); send the image inline as a data: URL")


def _scheme(url: str) -> str | None:
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", url)
    return match.group(1).lower() if match else None


def _data_url_bytes(url: str, what: str, limits: ImageLimits) -> bytes:
    """The decoded payload of `data:image/<type>[;param...];base64,<payload>`, its size checked first."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise ImageError(f"{what}: data URL {_clip(url)} has no ',' before its payload; expected "
                         "data:image/<type>;base64,<payload>")
    media_type, *params = [part.strip() for part in header.split(";")]
    if not media_type.lower().startswith("image/"):
        raise ImageError(f"{what}: data URL media type {media_type!r} is not an image; expected "
                         "image/png, image/jpeg, image/webp, ...")
    if not params or params[-1].lower() != "base64":
        raise ImageError(f"{what}: data URL {_clip(url)} is not base64-encoded; expected "
                         "data:image/<type>;base64,<payload>")
    # Exact for valid base64 (3 bytes per 4 characters, less the padding), so nothing oversized is decoded.
    _check_bytes(len(payload) * 3 // 4 - (len(payload) - len(payload.rstrip("="))), what, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what}: data URL payload is not valid base64 ({e})") from None


def _local_image(url: str, what: str, limits: ImageLimits, allow_local_files: bool) -> Image.Image:
    if not allow_local_files:
        raise ImageError(f"{what}: local image files are off ({_clip(url)}); the operator enables them with the "
                         "server flag --allow-local-images, or send the image inline as a data: URL")
    path = url
    if _scheme(url) == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ImageError(f"{what}: file URL {_clip(url)} does not name a local absolute path; expected "
                             "file:///abs/path")
        path = unquote(parts.path)
    try:
        return read_image_file(path, limits)
    except ImageError as e:
        raise ImageError(f"{what}: {e}") from None


def _check_bytes(size: int, what: str, limits: ImageLimits) -> None:
    if size > limits.max_bytes:
        raise ImageError(f"{what}: image is {size} bytes; the limit is {limits.max_bytes} bytes")


def _check_pixels(image_size: tuple[int, int], what: str, limits: ImageLimits) -> None:
    width, height = image_size
    if width * height > limits.max_pixels:
        raise ImageError(f"{what}: image is {width}x{height} = {width * height} pixels; the limit is "
                         f"{limits.max_pixels}")


def _clip(text: str, limit: int = 60) -> str:
    """`text` quoted, cut to `limit` characters: a data URL may be megabytes."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"
