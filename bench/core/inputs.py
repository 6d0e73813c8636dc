"""What the benchmarks send: a photo-like test picture, a test clip, prose of a given token count, the
questions, an extraction schema."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np

QUESTION = "What is in this picture? Describe the objects, their colours and where they are."
DECODE_PROMPT = "Tell me a long story about a red square that travels across a blue sky to find a yellow circle."
SENTENCE = (
    "The harbour was quiet in the early morning, boats resting on grey water while gulls "
    "circled above the old stone pier and a few fishermen mended their nets. "
)
CODECS = {"mp4": ("mp4v", "MPEG-4 Part 2"), "avi": ("MJPG", "MJPEG"), "webm": ("VP90", "VP9")}  # fourcc, name

# An extraction schema of the kind users send: nested objects, arrays, enums, numbers, a pattern.
RECEIPT = {
    "type": "object",
    "properties": {
        "shop": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "currency": {"enum": ["EUR", "USD", "CHF", "GBP"]},
        "items": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 30},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["label", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
        "paid_by_card": {"type": "boolean"},
    },
    "required": ["shop", "date", "currency", "items", "total", "paid_by_card"],
    "additionalProperties": False,
}


def photo(width: int = 1920, height: int = 1080, seed: int = 0) -> np.ndarray:
    """A photo-like BGR picture: smooth gradients, shapes with edges, and sensor-like noise."""
    import cv2

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([x / width, y / height, 0.5 + 0.5 * np.sin(x / 90 + y / 140)], axis=-1) * 200
    for _ in range(24):
        center = (int(rng.integers(width)), int(rng.integers(height)))
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        cv2.circle(img, center, int(rng.integers(20, height // 4)), color, -1, lineType=cv2.LINE_AA)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encoded_photo(ext: str = ".jpg", width: int = 1920, height: int = 1080, seed: int = 0) -> bytes:
    import cv2

    params = (
        [cv2.IMWRITE_JPEG_QUALITY, 90] if ext == ".jpg" else [cv2.IMWRITE_WEBP_QUALITY, 90] if ext == ".webp" else []
    )
    ok, buf = cv2.imencode(ext, photo(width, height, seed), params)
    assert ok
    return buf.tobytes()


def photo_url(seed: int = 0, size: int = 448) -> str:
    """A size × size JPEG of `photo` as a data URL, for a message's image part."""
    return "data:image/jpeg;base64," + base64.b64encode(encoded_photo(".jpg", size, size, seed)).decode()


def message(role: str, *parts: str) -> dict:
    """A chat message in the API's JSON: data URLs become image parts, other strings text parts."""
    return {
        "role": role,
        "content": [
            {"type": "image_url", "image_url": {"url": p}} if p.startswith("data:") else {"type": "text", "text": p}
            for p in parts
        ],
    }


def user(*parts: str) -> dict:
    return message("user", *parts)


def text_of_tokens(model_path: Path, tokens: int) -> str:
    """Repeated prose of about `tokens` tokens in this checkpoint's tokenizer."""
    from service.model.loading import load_processor

    tokenizer = load_processor(model_path).tokenizer
    words = (SENTENCE * (tokens // 4 + 1)).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words within the token count
        mid = (lo + hi + 1) // 2
        if len(tokenizer(" ".join(words[:mid]))["input_ids"]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def clip_bytes(path: Path, size: tuple[int, int], seconds: float = 10.0, fps: float = 30.0) -> bytes:
    """A photo-like background with a square moving across it, written with OpenCV (once: kept at `path`)."""
    import cv2

    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name("partial-" + path.name)
    width, height = size
    background = photo(width, height)
    writer = cv2.VideoWriter(str(partial), cv2.VideoWriter_fourcc(*CODECS[path.suffix[1:]][0]), fps, size)
    side = height // 5
    for i in range(int(seconds * fps)):
        frame = background.copy()
        x = int((width - side) * i / (seconds * fps))
        frame[height // 3 : height // 3 + side, x : x + side] = (40, 40, 230)
        writer.write(frame)
    writer.release()
    partial.rename(path)
    return path.read_bytes()
