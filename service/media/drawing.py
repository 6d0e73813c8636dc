"""Boxes and points drawn over a picture with OpenCV (the CLI's `chat --boxes`), at the pixel
coordinates answer/grounding.py mapped them to, with their labels."""

from __future__ import annotations

import cv2
import numpy as np

COLOURS = [(66, 135, 245), (245, 96, 66), (66, 245, 135), (245, 200, 66), (200, 66, 245), (66, 230, 245)]  # BGR


def draw_boxes(picture: np.ndarray, boxes) -> np.ndarray:
    """A copy of `picture` (BGR, as the client sent it) with each box's rectangle, or each point's
    dot, and its label; lines scale with the picture."""
    out = picture.copy()
    thickness = max(2, round(max(out.shape[:2]) / 300))
    font = max(0.4, max(out.shape[:2]) / 1200)
    for i, box in enumerate(boxes):
        colour = COLOURS[i % len(COLOURS)]
        if box.kind == "bbox":
            x1, y1, x2, y2 = (round(c) for c in box.pixels)
            cv2.rectangle(out, (x1, y1), (x2, y2), colour, thickness)
            anchor = (x1, max(y1 - thickness - 2, 12))
        else:
            x, y = (round(c) for c in box.pixels)
            cv2.circle(out, (x, y), 3 * thickness, colour, -1)
            anchor = (x + 3 * thickness, y)
        if box.label:
            cv2.putText(out, box.label, anchor, cv2.FONT_HERSHEY_SIMPLEX, font, colour, max(1, thickness // 2))
    return out
