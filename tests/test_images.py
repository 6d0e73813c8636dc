"""Image decoding as a client sees it: formats, orientation, alpha, depth, limits, bad bytes."""

from __future__ import annotations

import numpy as np
import pytest

from service.errors import ImageError, TooLarge
from service.media.images import ImageLimits, decode_image

from imaging import encode, pattern, png_claiming_size, with_exif_orientation

LIMITS = ImageLimits(
    max_bytes=5_000_000, max_decoded_pixels=40_000_000, max_pixels=448 * 448, min_pixels=64 * 64, factor=32
)


def bright_corner(rgb: np.ndarray) -> str:
    h, w = rgb.shape[:2]
    corners = {
        "top-left": rgb[: h // 6, : w // 6],
        "top-right": rgb[: h // 6, -w // 6 :],
        "bottom-left": rgb[-h // 6 :, : w // 6],
        "bottom-right": rgb[-h // 6 :, -w // 6 :],
    }
    return max(corners, key=lambda k: corners[k].mean())


@pytest.mark.parametrize("ext,fmt", [(".jpg", "jpeg"), (".png", "png"), (".webp", "webp"), (".bmp", "bmp")])
def test_each_format_decodes_to_rgb_at_budget_size(ext, fmt):
    img = decode_image(encode(pattern(320, 224), ext), LIMITS)
    assert img.source_format == fmt
    assert img.source_size == (320, 224)
    assert img.size == (320, 224)  # already multiples of 32 and inside the budget: untouched
    assert img.pixels.dtype == np.uint8 and img.pixels.shape == (224, 320, 3)
    assert bright_corner(img.pixels) == "top-left"


def test_channels_are_rgb_not_bgr():
    bgr = np.zeros((64, 64, 3), np.uint8)
    bgr[..., 2] = 255  # pure red in OpenCV's BGR order
    img = decode_image(encode(bgr, ".png"), LIMITS)
    assert tuple(img.pixels[10, 10]) == (255, 0, 0)


def test_grayscale_becomes_three_equal_channels():
    gray = pattern(96, 64, channels=1)[..., 0]
    img = decode_image(encode(gray, ".png"), LIMITS)
    assert img.pixels.shape == (64, 96, 3)
    assert np.array_equal(img.pixels[..., 0], img.pixels[..., 2])


def test_alpha_is_composited_on_white():
    bgra = np.zeros((64, 64, 4), np.uint8)
    bgra[:, :32] = (0, 0, 0, 255)  # opaque black left half
    bgra[:, 32:] = (0, 0, 0, 0)  # fully transparent right half
    img = decode_image(encode(bgra, ".png"), LIMITS)
    assert img.pixels[:, :30].max() == 0
    assert img.pixels[:, 34:].min() == 255


def test_16_bit_png_is_scaled_to_8_bit():
    img16 = pattern(64, 64, dtype=np.uint16)
    img = decode_image(encode(img16, ".png"), LIMITS)
    assert img.pixels.dtype == np.uint8
    assert img.pixels.max() == 255  # full range kept, not clipped to dark values


@pytest.mark.parametrize(
    "orientation,corner,size",
    [
        (1, "top-left", (320, 192)),
        (3, "bottom-right", (320, 192)),
        (6, "top-right", (192, 320)),
        (8, "bottom-left", (192, 320)),
    ],
)
def test_jpeg_exif_orientation_is_applied(orientation, corner, size):
    jpeg = with_exif_orientation(encode(pattern(320, 192), ".jpg"), orientation)
    img = decode_image(jpeg, LIMITS)
    assert img.size == size
    assert bright_corner(img.pixels) == corner


def test_large_photo_is_downscaled_into_the_budget():
    img = decode_image(encode(pattern(1920, 1080), ".jpg"), LIMITS)
    w, h = img.size
    assert w * h <= LIMITS.max_pixels
    assert w % 32 == 0 and h % 32 == 0
    assert abs(w / h - 1920 / 1080) < 0.1
    assert bright_corner(img.pixels) == "top-left"


def test_tiny_image_is_upscaled_to_the_minimum():
    img = decode_image(encode(pattern(20, 20), ".png"), LIMITS)
    assert img.size[0] * img.size[1] >= LIMITS.min_pixels


def test_same_pixels_give_same_digest_other_pixels_another():
    a = decode_image(encode(pattern(64, 64, seed=1), ".png"), LIMITS)
    b = decode_image(encode(pattern(64, 64, seed=1), ".png"), LIMITS)
    c = decode_image(encode(pattern(64, 64, seed=2), ".png"), LIMITS)
    assert a.digest == b.digest != c.digest


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "empty"),
        (b"hello, this is plain text, not a picture", "not a supported image"),
        (b"\x89PNG\r\n\x1a\n", "header"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "header"),
    ],
)
def test_bad_bytes_raise_image_error(data, message):
    with pytest.raises(ImageError, match=message):
        decode_image(data, LIMITS)


@pytest.mark.parametrize("ext", [".jpg", ".png", ".webp"])
def test_truncated_image_raises_image_error(ext):
    data = encode(pattern(256, 256), ext)
    with pytest.raises(ImageError):
        decode_image(data[: len(data) // 3], LIMITS)


def test_decompression_bomb_is_refused_from_the_header():
    with pytest.raises(TooLarge, match="100000x100000"):
        decode_image(png_claiming_size(100_000, 100_000), LIMITS)


def test_too_many_bytes_is_too_large():
    limits = ImageLimits(max_bytes=2048, max_decoded_pixels=LIMITS.max_decoded_pixels, max_pixels=LIMITS.max_pixels)
    with pytest.raises(TooLarge):
        decode_image(encode(pattern(256, 256), ".bmp"), limits)
