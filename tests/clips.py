"""Test clips written with OpenCV's VideoWriter: a red square moving across a gradient, or noise."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

# Containers and codecs OpenCV's wheel writes here (it has no H.264 encoder; it decodes H.264).
WRITABLE = {"mp4": "mp4v", "avi": "MJPG", "webm": "VP90"}


def moving_square(index: int, width: int, height: int) -> np.ndarray:
    """Frame `index` (BGR): the square's position tells the frames apart."""
    frame = np.zeros((height, width, 3), np.uint8)
    frame[..., 1] = np.linspace(0, 200, width, dtype=np.uint8)[None, :]
    side = max(4, min(width, height) // 4)
    x = (index * 3) % max(1, width - side)
    frame[height // 3 : height // 3 + side, x : x + side] = (0, 0, 255)
    return frame


def noise(index: int, width: int, height: int) -> np.ndarray:
    """Frame `index` (BGR): coarse random blocks, unlike every other frame."""
    blocks = np.random.default_rng(index).integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    return np.ascontiguousarray(np.kron(blocks, np.ones((8, 8, 1), np.uint8))[:height, :width])


def write_clip(
    path: Path,
    frames: int = 40,
    fps: float = 10.0,
    size: tuple[int, int] = (160, 120),
    container: str | None = None,
    frame=moving_square,
) -> bytes:
    """Write a clip of `frame(index, width, height)` images (container from the suffix unless given)
    and return its bytes."""
    container = container or path.suffix[1:]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*WRITABLE[container]), fps, size)
    assert writer.isOpened(), f"OpenCV cannot write {container}"
    for i in range(frames):
        writer.write(frame(i, *size))
    writer.release()
    return path.read_bytes()
