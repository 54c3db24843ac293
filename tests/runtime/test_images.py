"""Image transforms against HF's CLIPImageProcessor on real photos, and image reading from untrusted input.

The oracle is HF transformers' PIL CLIPImageProcessor (the reference CLIP / LLaVA preprocessing), with LLaVA's
`expand2square` written out below as LLaVA's repository has it; the photos are the ones gradio ships.
"""
from __future__ import annotations

import base64
import importlib.util
import io
import socket
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from accessory.data.images import ImageError, ImageLimits, decode_image, image_from_url, read_image_file
from accessory.data.transform import CLIP_MEAN, CLIP_STD, TRANSFORMS, get_transform
from accessory.errors import AccessoryError

PHOTOS = Path(importlib.util.find_spec("gradio").submodule_search_locations[0], "media_assets", "images")


def photo(name: str) -> Image.Image:
    with Image.open(PHOTOS / name) as image:
        return image.convert("RGB")


def wide() -> Image.Image:
    return photo("cheetah.jpg")  # 502 x 343


def tall() -> Image.Image:
    return photo("tower.jpg")  # 377 x 600


def rotated() -> Image.Image:
    return wide().transpose(Image.Transpose.ROTATE_90)  # 343 x 502: the crop offset moves down, not across


def hf_clip(image: Image.Image, size: int) -> torch.Tensor:
    # transformers' slow PIL processor, named explicitly: CLIPImageProcessor itself picks a torchvision backend
    # where torchvision is installed.
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                      image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))
    return processor(image, return_tensors="pt").pixel_values[0]


def expand2square(pil_img, background_color):
    """LLaVA's llava/mm_utils.py, as written there."""
    width, height = pil_img.size
    if width == height:
        return pil_img
    elif width > height:
        result = Image.new(pil_img.mode, (width, width), background_color)
        result.paste(pil_img, (0, (width - height) // 2))
        return result
    else:
        result = Image.new(pil_img.mode, (height, height), background_color)
        result.paste(pil_img, ((height - width) // 2, 0))
        return result


# ---------------------------------------------------------------- transforms

@pytest.mark.parametrize("make, size", [(wide, 336), (wide, 224), (rotated, 336), (tall, 336), (tall, 225)])
def test_resized_center_crop_equals_hf(make, size):
    image = make()
    expected = hf_clip(image, size)
    torch.testing.assert_close(get_transform("resized_center_crop", size)(image), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("make, size", [(wide, 336), (rotated, 224)])
def test_crop_cases_tell_hf_from_torchvision(make, size):
    """The wide and rotated cases above pin HF's floored crop offset: torchvision's CenterCrop rounds
    (int(round(d / 2))) and lands one pixel further on them, which a match within 1e-5 would not survive."""
    width, height = make().size
    long_side = int(size * max(width, height) / min(width, height))
    assert (long_side - size) // 2 != int(round((long_side - size) / 2.0))


@pytest.mark.parametrize("make", [wide, tall, rotated, lambda: photo("lion.jpg")])
@pytest.mark.parametrize("size", [224, 336])
def test_padded_resize_equals_llava_then_hf(make, size):
    image = make()
    expected = hf_clip(expand2square(image, tuple(int(x * 255) for x in CLIP_MEAN)), size)
    torch.testing.assert_close(get_transform("padded_resize", size)(image), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_transform_output_and_other_modes(name):
    for image in (photo("bus.png"), Image.open(PHOTOS / "avatar.png"), wide().convert("L")):  # P, RGBA, L
        pixels = get_transform(name, 32)(image)
        assert pixels.shape == (3, 32, 32) and pixels.dtype == torch.float32 and pixels.is_contiguous()


def test_transform_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown image transform 'crop'; expected one of padded_resize, "
                                         "resized_center_crop"):
        get_transform("crop", 224)
    for size in (0, -1, 2.5, "224", True):
        with pytest.raises(ValueError, match="size must be an int >= 1"):
            get_transform("padded_resize", size)
    with pytest.raises(ValueError, match="mean must have 3 values"):
        get_transform("padded_resize", 224, mean=(0.5, 0.5))
    with pytest.raises(TypeError, match="takes a PIL image, got ndarray"):
        get_transform("padded_resize", 224)(np.zeros((4, 4, 3), np.uint8))


@pytest.mark.parametrize("name, size", [("padded_resize", (20_000, 1)), ("resized_center_crop", (1, 2_000_000))])
def test_elongated_image_is_refused_before_any_work(name, size):
    expected = rf"^image {size[0]}x{size[1]} is too large for {name!r} at size 336: .* the limit is 100000000 "
    with pytest.raises(ImageError, match=expected):
        get_transform(name, 336)(Image.new("RGB", size))


# ---------------------------------------------------------------- reading images

def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def random_image(mode: str = "RGB", size=(17, 11)) -> Image.Image:
    channels = len(mode)
    array = np.random.default_rng(0).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(array, mode)


def test_png_round_trip_through_a_data_url():
    image = random_image()
    decoded = image_from_url(data_url(png_bytes(image)), "image_url")
    assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), np.asarray(image))
    with_params = image_from_url("data:image/png;name=a.png;base64," + data_url(png_bytes(image)).split(",")[1], "x")
    assert np.array_equal(np.asarray(with_params), np.asarray(image))
    rgba = decode_image(png_bytes(random_image("RGBA")), "upload")
    assert rgba.mode == "RGB" and rgba.size == (17, 11)


def test_oversized_data_url_is_refused_before_decoding():
    # '!' is not base64: decoding first would raise the base64 error, not the size one.
    with pytest.raises(ImageError, match=r"^image_url: image is 3000 bytes; the limit is 1000 bytes$"):
        image_from_url("data:image/png;base64," + "!" * 4000, "image_url", ImageLimits(max_bytes=1000))


def test_data_url_size_estimate_is_exact():
    payload = data_url(bytes(1000))  # 1000 bytes: base64 ends in '=='
    with pytest.raises(ImageError, match="image is 1000 bytes; the limit is 999 bytes"):
        image_from_url(payload, "u", ImageLimits(max_bytes=999))
    with pytest.raises(ImageError, match="not a readable image"):  # at the limit: passes, then fails to decode
        image_from_url(payload, "u", ImageLimits(max_bytes=1000))


def test_oversized_bytes_are_refused_before_opening():
    with pytest.raises(ImageError, match=r"^upload: image is 2001 bytes; the limit is 2000 bytes$"):
        decode_image(b"\0" * 2001, "upload", ImageLimits(max_bytes=2000))


def test_too_many_pixels_are_refused_before_decoding():
    big = png_bytes(Image.new("1", (9000, 9000)))  # 81 megapixels in a few kilobytes
    assert len(big) < 100_000
    with pytest.raises(ImageError, match=r"^upload: image is 9000x9000 = 81000000 pixels; the limit is 80000000$"):
        decode_image(big, "upload", ImageLimits(max_pixels=80_000_000))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and that holds no pixel data at all."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def test_pixel_count_comes_from_the_header():
    with pytest.raises(ImageError, match="image is 9000x9000 = 81000000 pixels; the limit is 40000000"):
        decode_image(png_header_only(9000, 9000), "upload")
    # Beyond PIL's own bomb limit, PIL refuses it as it opens; that is an ImageError too.
    with pytest.raises(ImageError, match="upload: image is too large to decode .*decompression bomb"):
        decode_image(png_header_only(20_000, 20_000), "upload", ImageLimits(max_pixels=10**9))


def test_corrupt_images_are_refused_by_name(tmp_path):
    with pytest.raises(ImageError, match=r"^upload: not a readable image \(not PNG, JPEG, WEBP, GIF, BMP, TIFF\)$"):
        decode_image(np.random.default_rng(1).bytes(5000), "upload")
    truncated = tmp_path / "cut.jpg"
    truncated.write_bytes((PHOTOS / "cheetah.jpg").read_bytes()[:6000])
    with pytest.raises(ImageError, match=rf"^{truncated}: not a readable image \(OSError: .*truncated"):
        read_image_file(truncated)
    with pytest.raises(ImageError, match="not a readable image"):  # PIL has EPS, but it is not opened here
        decode_image(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n", "upload")


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data", "https://example.com/cat.png",
                                 "HTTPS://example.com/cat.png", "ftp://example.com/cat.png"])
def test_remote_urls_are_refused_without_any_connection(url, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a socket was opened")
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(ImageError, match=r"^messages\[0\]: remote image URLs are refused: the server fetches nothing "
                                         r"from the network \(a request could otherwise make it reach internal "
                                         r"hosts\); send the image inline as a data: URL$"):
        image_from_url(url, "messages[0]", allow_local_files=True)


def test_local_files_only_where_allowed(tmp_path):
    image = random_image()
    path = tmp_path / "a photo.png"
    path.write_bytes(png_bytes(image))
    for url in (str(path), path.as_uri()):
        with pytest.raises(ImageError, match="local image files are off .*--allow-local-images"):
            image_from_url(url, "image_url")
        read = image_from_url(url, "image_url", allow_local_files=True)
        assert np.array_equal(np.asarray(read), np.asarray(image))
    with pytest.raises(ImageError, match=rf"^image_url: {tmp_path / 'gone.png'}: no such image file$"):
        image_from_url(str(tmp_path / "gone.png"), "image_url", allow_local_files=True)
    with pytest.raises(ImageError, match="does not name a local absolute path"):
        image_from_url("file://otherhost/a.png", "image_url", allow_local_files=True)
    with pytest.raises(ImageError, match="'a.png' is not an image URL"):
        image_from_url("a.png", "image_url", allow_local_files=True)


def test_read_image_file_checks_before_reading(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(random_image()))
    assert read_image_file(path).size == (17, 11)
    with pytest.raises(ImageError, match=rf"^{path}: image is {path.stat().st_size} bytes; the limit is 10 bytes$"):
        read_image_file(path, ImageLimits(max_bytes=10))
    with pytest.raises(ImageError, match=rf"^{tmp_path / 'no.png'}: no such image file$"):
        read_image_file(tmp_path / "no.png")
    with pytest.raises(ImageError, match=rf"^{tmp_path}: is a directory; expected an image file$"):
        read_image_file(tmp_path)


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,iVBOR$w0K", "image_url: data URL payload is not valid base64"),
    ("data:image/png;base64,iVBORw0", "image_url: data URL payload is not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "image_url: data URL media type 'text/plain' is not an image"),
    ("data:;base64,aGVsbG8=", "image_url: data URL media type '' is not an image"),
    ("data:image/png,rawbytes", "image_url: data URL 'data:image/png,rawbytes' is not base64-encoded"),
    ("data:image/png;base64", "has no ',' before its payload"),
])
def test_bad_data_urls(url, message):
    with pytest.raises(ImageError, match=message.replace("$", r"\$")):
        image_from_url(url, "image_url")


def test_errors_never_echo_a_whole_url():
    url = "data:image/png;base64" + "A" * 1_000_000  # no comma: the error quotes the URL
    with pytest.raises(ImageError) as error:
        image_from_url(url, "image_url")
    assert len(str(error.value)) < 200 and "1000021 characters" in str(error.value)


def test_error_types_and_limits():
    assert issubclass(ImageError, AccessoryError) and issubclass(ImageError, ValueError)
    for bad in ({"max_bytes": 0}, {"max_pixels": -1}, {"max_bytes": 1.5}):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            ImageLimits(**bad)
    with pytest.raises(ImageError, match="an image URL must be a string, got dict"):
        image_from_url({"url": "x"}, "image_url")


def test_exif_orientation_is_applied():
    """A phone photo stored sideways with an EXIF orientation tag reaches the model upright."""
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view"
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", exif=exif)
    upright = decode_image(buffer.getvalue(), "photo")
    assert upright.size == (20, 40) and upright.getpixel((10, 5)) == (0, 0, 255)
