"""Grounding: the boxes and points Qwen3-VL writes in its answers, in the pixels of the user's picture.

Qwen3-VL answers a "locate …" question with JSON such as `[{"bbox_2d": [x1, y1, x2, y2], "label":
"cat"}]` or `{"point_2d": [x, y], "label": …}`, its coordinates relative to the picture and scaled
0–1000 (Qwen2.5-VL used absolute pixels of its resized input). `find_boxes` reads them out of an
answer — a list, a single object, several objects, fenced JSON, prose around it — and maps them onto
the picture the client sent, as oriented (EXIF applied) and before the service's own resize, since
that is the picture the client holds. Coordinates outside 0–1000 are clipped and flagged; an answer
with no well-formed box gives no boxes, never an error.

`GROUNDING_SCHEMA` is the JSON Schema of `response_format: {"type": "grounding"}`: with it the
grammar path (answer/structured.py) makes even a random model answer a well-formed list.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

SCALE = 1000  # Qwen3-VL's relative coordinates run from 0 to 1000

GROUNDING_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 80},
            "bbox_2d": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": SCALE},
                "minItems": 4,
                "maxItems": 4,
            },
        },
        "required": ["bbox_2d", "label"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 32,
}


@dataclass(frozen=True)
class Box:
    """A box (`bbox`: x1, y1, x2, y2) or a point (`point`: x, y) the answer names, on picture `image`
    (its index among the message's pictures). `written`: the 0–1000 coordinates as the answer wrote
    them; `relative`: the same clipped to 0–1000 (a box's corners in order); `pixels`: those in the
    picture as the client sent it (width × height after EXIF orientation)."""

    kind: str
    label: str | None
    written: tuple[float, ...]
    relative: tuple[float, ...]
    pixels: tuple[float, ...]
    image: int
    clipped: bool = False


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def _json_values(text: str):
    """Every JSON value a text holds: fenced blocks first, then each object or list found by scanning."""
    decoder, seen = json.JSONDecoder(), []
    for chunk in [*_FENCE.findall(text), text]:
        at = 0
        while True:
            starts = [i for i in (chunk.find("[", at), chunk.find("{", at)) if i >= 0]
            if not starts:
                break
            start = min(starts)
            try:
                value, end = decoder.raw_decode(chunk, start)
            except ValueError:
                at = start + 1
                continue
            seen.append(value)
            at = end
        if seen:
            return seen
    return seen


def _objects(value):
    """The dicts of a JSON value: itself, or the items of a list (nested lists flattened)."""
    if isinstance(value, dict):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _objects(item)


def _numbers(value, count: int) -> tuple[float, ...] | None:
    if not isinstance(value, list | tuple) or len(value) != count:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return None
    return tuple(float(v) for v in value)


def find_boxes(text: str, pictures: list[tuple[int, int]]) -> list[Box]:
    """The boxes and points in an answer, mapped onto `pictures` (each one's width and height as the
    client sent it). An object names its picture by `"image"` (1-based, as one says "image 2"), else
    it is the first. Nothing when there is no picture or no well-formed box."""
    if not pictures:
        return []
    boxes = []
    for value in _json_values(text):
        for item in _objects(value):
            for kind, key, count in (("bbox", "bbox_2d", 4), ("point", "point_2d", 2)):
                coords = _numbers(item.get(key), count)
                if coords is None:
                    continue
                index = item.get("image", 1)
                index = index - 1 if isinstance(index, int) and 1 <= index <= len(pictures) else 0
                width, height = pictures[index]
                clipped = tuple(min(max(c, 0.0), float(SCALE)) for c in coords)
                if kind == "bbox":
                    clipped = (
                        min(clipped[0], clipped[2]),
                        min(clipped[1], clipped[3]),
                        max(clipped[0], clipped[2]),
                        max(clipped[1], clipped[3]),
                    )
                scale = [width / SCALE, height / SCALE] * (count // 2)
                label = item.get("label")
                boxes.append(
                    Box(
                        kind=kind,
                        label=str(label) if label is not None else None,
                        written=tuple(int(c) if c.is_integer() else c for c in coords),
                        relative=clipped,
                        pixels=tuple(round(c * s, 1) for c, s in zip(clipped, scale)),
                        image=index,
                        clipped=any(not 0 <= c <= SCALE for c in coords),
                    )
                )
    return boxes
