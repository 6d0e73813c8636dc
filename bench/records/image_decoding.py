"""OpenCV versus PIL decoding of a 1920×1080 photo as JPEG, PNG and WebP (to an RGB numpy array),
plus OpenCV's reduced JPEG decode and the service's whole `decode_image` (decode + resize to the budget).

Decision record, frozen at commit 1c7f47a (bench/RESULTS.md § "Image decoding: OpenCV versus PIL"):
the service decodes pictures with OpenCV since. It was the `images` scenario of the INT8 suite;
rerun it as it was there:

    git worktree add /tmp/images-record 1c7f47a && cd /tmp/images-record && python -m bench images
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

from bench.core.harness import isolated
from bench.core.inputs import encoded_photo
from bench.core.results import markdown_table, report

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--image-max-pixels", type=int, help="IMAGE_MAX_PIXELS (default: the service's)")
    p.add_argument("--no-save", action="store_true", help="print the table, leave bench/RESULTS.md alone")
    args = p.parse_args(argv)
    from service.settings import load_settings

    pixels = args.image_max_pixels or load_settings().image_max_pixels
    target = "bench.records.image_decoding:measure"
    rows = isolated(target, threads=args.threads, repeats=args.repeats, image_max_pixels=pixels)
    settings = {"THREADS": args.threads, "repeats": f"median of {args.repeats}"}
    title = "Image decoding: OpenCV versus PIL (1920×1080)"
    return report(args, title, settings, table(rows, pixels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
