"""Test images made with OpenCV, plus helpers to forge headers and EXIF."""

from __future__ import annotations

import base64
import struct

import cv2
import numpy as np


def pattern(width: int, height: int, channels: int = 3, dtype=np.uint8, seed: int = 0) -> np.ndarray:
    """A picture with structure (so resizing and rotation are visible): a gradient plus a block."""
    rng = np.random.default_rng(seed)
    img = np.zeros((height, width, channels), dtype=np.float32)
    img[..., 0] = np.linspace(0, 1, width)[None, :]
    if channels > 1:
        img[..., 1] = np.linspace(0, 1, height)[:, None]
    if channels > 2:
        img[..., 2] = rng.random((height, width))
    img[: height // 3, : width // 3] = 1.0  # bright top-left block: the orientation marker
    top = np.iinfo(dtype).max
    return (img * top).astype(dtype)


def encode(img: np.ndarray, ext: str, params=()) -> bytes:
    ok, buf = cv2.imencode(ext, img, list(params))
    assert ok
    return buf.tobytes()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """`data` as a data: URL (base64), as clients send pictures and clips inline."""
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    """Insert a minimal EXIF APP1 segment holding only the Orientation tag after the SOI marker."""
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8)  # big-endian TIFF header, IFD at offset 8
    ifd = struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    payload = b"Exif\x00\x00" + tiff + ifd
    app1 = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    return jpeg[:2] + app1 + jpeg[2:]


def png_claiming_size(width: int, height: int) -> bytes:
    """A tiny real PNG whose IHDR was rewritten to announce giant dimensions."""
    data = bytearray(encode(pattern(8, 8), ".png"))
    data[16:24] = struct.pack(">II", width, height)
    return bytes(data)
