"""OpenCV versus PIL decoding of a 1920×1080 photo as JPEG, PNG and WebP (to an RGB numpy array),
plus OpenCV's reduced JPEG decode and the service's whole `decode_image` (decode + resize to the budget)."""

from __future__ import annotations

import io
import statistics
import time

from bench.harness import encoded_photo

FORMATS = [".jpg", ".png", ".webp"]


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def measure(threads: int, repeats: int, image_max_pixels: int) -> list[dict]:
    import cv2
    import numpy as np
    from PIL import Image

    from service.media.images import ImageLimits, decode_image
    from service.settings import load_settings

    cv2.setNumThreads(threads)
    settings = load_settings(image_max_pixels=image_max_pixels)
    limits = ImageLimits(
        max_bytes=settings.image_max_bytes,
        max_decoded_pixels=settings.image_max_decoded_pixels,
        max_pixels=image_max_pixels,
        min_pixels=32 * 32,
        factor=32,
    )
    rows = []
    for ext in FORMATS:
        data = encoded_photo(ext)
        buffer = np.frombuffer(data, np.uint8)
        row = {
            "format": ext.lstrip(".").upper(),
            "kib": len(data) / 1024,
            "opencv_ms": _median_ms(
                lambda buffer=buffer: cv2.cvtColor(cv2.imdecode(buffer, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB), repeats
            ),
            "pil_ms": _median_ms(lambda data=data: np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), repeats),
            "service_ms": _median_ms(lambda data=data: decode_image(data, limits), repeats),
        }
        if ext == ".jpg":
            row["opencv_reduced_ms"] = _median_ms(
                lambda buffer=buffer: cv2.imdecode(buffer, cv2.IMREAD_REDUCED_COLOR_2), repeats
            )
        rows.append(row)
    return rows


def table(rows: list[dict], image_max_pixels: int) -> str:
    from bench.results import markdown_table

    return markdown_table(
        [
            "1920×1080 photo",
            "file (KiB)",
            "OpenCV imdecode → RGB (ms)",
            "PIL open → RGB array (ms)",
            "PIL / OpenCV",
            "OpenCV reduced ½ decode (ms)",
            f"service decode_image into {image_max_pixels} px (ms)",
        ],
        [
            [
                r["format"],
                f"{r['kib']:.0f}",
                f"{r['opencv_ms']:.1f}",
                f"{r['pil_ms']:.1f}",
                f"{r['pil_ms'] / r['opencv_ms']:.2f}×",
                f"{r['opencv_reduced_ms']:.1f}" if "opencv_reduced_ms" in r else "—",
                f"{r['service_ms']:.1f}",
            ]
            for r in rows
        ],
    )
