"""Pixel budget versus visual tokens versus time to first token, for a 1920×1080 JPEG; and a plot.

    flock /tmp/heavy.lock python -m bench.bench_pixels       # the INT8 copy of CACHE_DIR/qwen3vl-2b-random
    python -m bench.bench_pixels --tiny --no-save            # the embedded model: a quick check

One model (the source's INT8 copy, written if missing as bench_quantize does) in a fresh process; for
each IMAGE_MAX_PIXELS budget, the photo resized into it and a one-token question about it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.core import int8_suite
from bench.core.harness import isolated
from bench.core.inputs import encoded_photo
from bench.core.results import line_plot, markdown_table, plot_file, plot_link
from bench.core.session import Session

BUDGETS = [224 * 224, 320 * 320, 448 * 448, 640 * 640, 896 * 896, 1920 * 1080]


def sweep(model_path: str, threads: int, budgets: list[int]) -> list[dict]:
    """One model; for each budget, the photo resized into it and a one-token question about it."""
    from transformers.image_utils import SizeDict

    from service.media.images import decode_image, fit_processor
    from service.model.prompts import prepare_prompt

    session = Session(model_path, threads, image_max_pixels=max(budgets))
    processor = session.processor
    jpeg = encoded_photo(".jpg")
    merge = processor.image_processor.merge_size**2
    results = []
    for i, budget in enumerate([min(budgets), *budgets]):  # the first run warms up
        processor.image_processor.size = SizeDict(longest_edge=max(budgets))  # as loaded, then the budget's
        engine = session.variant(image_max_pixels=budget)
        fit_processor(processor)
        t0 = time.perf_counter()
        image = decode_image(jpeg, engine.engine.limits.image)
        request = engine.request(image, "What is in this picture?", received_at=t0)
        prompt = prepare_prompt(processor, request.messages, engine.engine.limits.prompt)
        t = list(engine.engine.generate(request))[-1].timings
        if i:
            width, height = image.size
            results.append(
                {
                    "budget": budget,
                    "width": width,
                    "height": height,
                    "visual_tokens": int(prompt.image_grid_thw.prod()) // merge,
                    "image_decode_ms": t.image_decode * 1000,
                    "vision_encode_s": t.vision_encode,
                    "prefill_s": t.prefill,
                    "ttft_s": t.time_to_first_token,
                }
            )
    return results


def plot(results: list[dict], title: str, path: Path) -> Path:
    tokens = [r["visual_tokens"] for r in results]
    lines = [
        (tokens, [r["ttft_s"] for r in results], "o-", "time to first token"),
        (tokens, [r["vision_encode_s"] for r in results], "s--", "vision encode"),
        (tokens, [r["prefill_s"] for r in results], "^--", "prefill"),
    ]
    notes = [(f"{r['width']}×{r['height']}", r["visual_tokens"], r["ttft_s"]) for r in results]
    xlabel = "visual tokens (1920×1080 JPEG resized into the pixel budget)"
    return line_plot(path, title, xlabel, "seconds", lines, notes=notes)


def table(results: list[dict]) -> str:
    return markdown_table(
        [
            "IMAGE_MAX_PIXELS",
            "resized to",
            "visual tokens",
            "image decode (ms)",
            "vision encode (s)",
            "prefill (s)",
            "time to first token (s)",
        ],
        [
            [
                r["budget"],
                f"{r['width']}×{r['height']}",
                r["visual_tokens"],
                f"{r['image_decode_ms']:.1f}",
                f"{r['vision_encode_s']:.2f}",
                f"{r['prefill_s']:.2f}",
                f"{r['ttft_s']:.2f}",
            ]
            for r in results
        ],
    )


def main(argv=None) -> int:
    args = int8_suite.parse(int8_suite.parser(__doc__), argv)
    model_path = int8_suite.int8_copy(args)
    results = isolated("bench.bench_pixels:sweep", model_path=str(model_path), threads=args.threads, budgets=BUDGETS)
    title = f"{args.int8_path.name}, {args.threads} threads: time to first token vs visual tokens"
    path = plot(results, title, plot_file("pixel_budget", save=not args.no_save))
    int8_suite.save(
        args,
        "Pixel budget → visual tokens → time to first token",
        table(results) + f"\n\n![time to first token versus visual tokens]({plot_link(path)})",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
