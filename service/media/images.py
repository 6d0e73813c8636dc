"""Decode client image bytes with OpenCV into RGB arrays sized for the vision encoder.

Order matters for safety: size of the bytes → format from the magic bytes → dimensions from the
header (refusing decompression bombs before any pixel is decoded) → decode in full → alpha, bit
depth, grayscale → resize to the budget.

The resize is transformers' own for Qwen2-VL / Qwen3-VL pictures (`smart_resize`, then Pillow's
filter, bicubic, as `Qwen2VLImageProcessorPil` does), so the pixels the model sees are the bits
transformers' processor makes of the same decoded RGB (tests/test_official_pixels.py).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from dataclasses import dataclass, field, replace

import cv2
import numpy as np
from PIL import Image

from ..errors import ImageError, TooLarge
from ..settings import Settings

cv2.setNumThreads(1)  # decoding runs beside torch's threads; OpenCV's own pool would oversubscribe

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC: Qwen2VLImageProcessorPil's default


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_decoded_pixels: int
    max_pixels: int  # the budget the image is resized into
    min_pixels: int = 32 * 32
    factor: int = 32  # patch size × merge size: sides are multiples of it
    ceiling: int = 0  # the largest budget a request may ask for (0: max_pixels)
    resample: int = BICUBIC  # the Pillow filter the processor resizes with

    def with_budget(self, pixels: int) -> ImageLimits:
        """These limits with another pixel budget (a request's own, within `ceiling`)."""
        return replace(self, max_pixels=pixels, min_pixels=min(self.min_pixels, pixels))

    def with_floor(self, pixels: int) -> ImageLimits:
        """These limits with a floor: a smaller picture is scaled up to it (more visual tokens: small
        things located, small text read), the budget raised to it if below."""
        return replace(self, min_pixels=pixels, max_pixels=max(self.max_pixels, pixels))


@dataclass(frozen=True)
class DecodedImage:
    """An RGB uint8 image already at the size the processor will use (so it does not resize it)."""

    pixels: np.ndarray  # H × W × 3, RGB
    source_format: str
    source_size: tuple[int, int]  # (width, height) as stored, before orientation and resizing
    digest: str  # of the resized pixels: the vision-feature cache key
    decode_seconds: float = 0.0  # checking, decoding and resizing it
    oriented_size: tuple[int, int] | None = None  # (width, height) after EXIF orientation, before resizing
    # The bytes as sent and the limits they were decoded with, kept where they are fewer than the pixels:
    # decode_image(sent, limits) gives these pixels again (a shared store may keep them instead).
    sent: bytes | None = field(default=None, repr=False, compare=False)
    limits: ImageLimits | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.shape[1], self.pixels.shape[0]

    @property
    def nbytes(self) -> int:
        """What keeping it costs: its pixels, and the bytes as sent where they are kept."""
        return self.pixels.nbytes + len(self.sent or b"")

    @property
    def sent_size(self) -> tuple[int, int]:
        """(width, height) of the picture as the client sees it: stored size, EXIF orientation applied."""
        return self.oriented_size or self.source_size


def sniff_format(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:2] == b"BM":
        return "bmp"
    return None


def header_size(data: bytes, fmt: str) -> tuple[int, int]:
    """(width, height) read from the file header without decoding; ImageError if unreadable."""
    try:
        if fmt == "png":
            if data[12:16] != b"IHDR":
                raise ValueError("no IHDR")
            return struct.unpack(">II", data[16:24])
        if fmt == "bmp":
            width, height = struct.unpack("<ii", data[18:26])
            return abs(width), abs(height)
        if fmt == "webp":
            return _webp_size(data)
        return _jpeg_size(data)
    except (struct.error, ValueError, IndexError) as exc:
        raise ImageError(f"truncated or corrupt {fmt.upper()} header") from exc


def _webp_size(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8X":
        width = 1 + int.from_bytes(data[24:27], "little")
        height = 1 + int.from_bytes(data[27:30], "little")
        return width, height
    if chunk == b"VP8L":
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 ":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    raise ValueError("unknown WebP chunk")


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(data: bytes) -> tuple[int, int]:
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise ValueError("bad marker")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        length = struct.unpack(">H", data[pos + 2 : pos + 4])[0]
        if marker in _JPEG_SOF:
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return width, height
        pos += 2 + length
    raise ValueError("no SOF marker")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `qwen2_vl` smart_resize: sides multiples of `factor`, area within the bounds,
    aspect kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fit_to_budget(width: int, height: int, limits: ImageLimits) -> tuple[int, int]:
    """Target (width, height): the processor's `smart_resize` into [min_pixels, max_pixels]."""
    try:
        h_bar, w_bar = smart_resize(height, width, limits.factor, limits.min_pixels, limits.max_pixels)
    except ValueError as exc:  # its one refusal
        raise ImageError(f"aspect ratio of {width}x{height} is above 200:1") from exc
    return w_bar, h_bar


def to_rgb8(img: np.ndarray) -> np.ndarray:
    """Any OpenCV decode result → RGB uint8. Alpha is composited on white."""
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    elif img.dtype != np.uint8:
        img = cv2.normalize(img, None, 0, 255, cv2.NORM_MINMAX).astype(np.uint8)
    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    channels = img.shape[2]
    if channels == 1:
        return cv2.cvtColor(img[:, :, 0], cv2.COLOR_GRAY2RGB)
    if channels == 4:
        alpha = img[:, :, 3:4].astype(np.float32) / 255.0
        bgr = img[:, :, :3].astype(np.float32)
        img = (bgr * alpha + 255.0 * (1.0 - alpha) + 0.5).astype(np.uint8)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def resize_to(pixels: np.ndarray, target: tuple[int, int], resample: int = BICUBIC) -> np.ndarray:
    """`pixels` (H × W or H × W × 3 uint8) at `target` (width, height) by Pillow's `resample` filter,
    as transformers' PIL backend resizes (bicubic: a support widened by the scale when shrinking, so
    no aliasing); an array already at `target` is returned as it is."""
    if (pixels.shape[1], pixels.shape[0]) == target:
        return pixels
    return np.asarray(Image.fromarray(pixels).resize(target, resample=resample))


def checked_upload(data: bytes, kind: str, max_bytes: int, sniff, error, expected: str) -> str:
    """The format `sniff` finds in an upload of `kind` ("image", "video"), after the checks every
    upload gets: not empty (`error`, 400), not over `max_bytes` (TooLarge, 413), a known format."""
    if not data:
        raise error(f"{kind} is empty")
    if len(data) > max_bytes:
        raise TooLarge(f"{kind} is {len(data)} bytes; the limit is {max_bytes}", code=f"{kind}_too_large")
    fmt = sniff(data)
    if fmt is None:
        raise error(f"not a supported {kind}: {expected} expected")
    return fmt


def image_digest(pixels: np.ndarray) -> str:
    """A picture's key in the vision-feature cache: a digest of the pixels the model sees."""
    return hashlib.blake2b(pixels.tobytes(), digest_size=16, person=b"qwen3vl-img").hexdigest()


def decode_image(data: bytes, limits: ImageLimits) -> DecodedImage:
    """Bytes of a JPEG/PNG/WebP/BMP → RGB image resized into the pixel budget.

    Raises ImageError (400) for empty, unknown, truncated or corrupt data and TooLarge (413) for
    bytes or dimensions beyond the limits.
    """
    started = time.perf_counter()
    fmt = checked_upload(data, "image", limits.max_bytes, sniff_format, ImageError, "JPEG, PNG, WebP or BMP")
    width, height = header_size(data, fmt)
    if width <= 0 or height <= 0:
        raise ImageError(f"{fmt.upper()} header gives an empty image ({width}x{height})")
    if width * height > limits.max_decoded_pixels:
        raise TooLarge(
            f"image is {width}x{height} = {width * height} pixels; the limit is {limits.max_decoded_pixels}",
            code="image_too_large",
        )
    buffer = np.frombuffer(data, dtype=np.uint8)
    if fmt == "jpeg":
        img = cv2.imdecode(buffer, cv2.IMREAD_COLOR)  # applies the EXIF orientation
    else:
        img = cv2.imdecode(buffer, cv2.IMREAD_UNCHANGED)  # keeps alpha and 16-bit samples
    if img is None or img.size == 0:
        raise ImageError(f"could not decode the {fmt.upper()} image: truncated or corrupt")
    rgb = to_rgb8(img)
    oriented = rgb.shape[1], rgb.shape[0]  # its sides swapped by an EXIF orientation that turns it
    rgb = resize_to(rgb, fit_to_budget(*oriented, limits), limits.resample)
    return DecodedImage(
        pixels=rgb,
        source_format=fmt,
        source_size=(width, height),
        digest=image_digest(rgb),
        decode_seconds=time.perf_counter() - started,
        oriented_size=oriented,
        sent=data if len(data) < rgb.nbytes else None,
        limits=limits,
    )


def image_limits(processor, settings: Settings) -> ImageLimits:
    """The decode limits, the pixel budget clipped to what the processor itself allows."""
    ip = processor.image_processor
    factor = ip.patch_size * ip.merge_size
    largest = ip.size.longest_edge or settings.image_request_max_pixels
    max_pixels = min(settings.image_max_pixels, largest)
    ceiling = max(max_pixels, min(settings.image_request_max_pixels, largest))
    min_pixels = min(ip.size.shortest_edge or factor * factor, max_pixels)
    return ImageLimits(
        max_bytes=settings.image_max_bytes,
        max_decoded_pixels=settings.image_max_decoded_pixels,
        max_pixels=max_pixels,
        min_pixels=min_pixels,
        factor=factor,
        ceiling=ceiling,
        resample=int(ip.resample),
    )


def fit_processor(processor) -> None:
    """Have the processor take pictures as decode_image resized them (by its own resize: the same bits).
    By its size rule it would resize one again, scaling a picture sized into a request's budget below
    the checkpoint's floor back up to it."""
    processor.image_processor.do_resize = False
