"""Pixel budget versus visual tokens versus time to first token, for a 1920×1080 JPEG; and a plot."""

from __future__ import annotations

import time
from pathlib import Path

from bench.harness import encoded_photo

BUDGETS = [224 * 224, 320 * 320, 448 * 448, 640 * 640, 896 * 896, 1920 * 1080]
PLOT = Path(__file__).resolve().parent / "pixel_budget.png"


def sweep(model_path: str, threads: int, budgets: list[int]) -> list[dict]:
    """One engine; for each budget, the photo resized into it and a one-token question about it."""
    from transformers.image_utils import SizeDict

    from service.engine.engine import Engine, GenerationRequest, SamplingParams
    from service.media.images import decode_image, fit_processor
    from service.model.loading import load_model
    from service.model.prompts import ChatMessage, ImagePart, TextPart, prepare_prompt
    from service.settings import load_settings

    loaded = load_model(
        load_settings(model_path=model_path, threads=threads, cache_enabled=False, image_max_pixels=max(budgets))
    )
    jpeg = encoded_photo(".jpg")
    merge = loaded.processor.image_processor.merge_size**2
    results = []
    for i, budget in enumerate([min(budgets), *budgets]):  # the first run warms up
        settings = load_settings(model_path=model_path, threads=threads, cache_enabled=False, image_max_pixels=budget)
        loaded.processor.image_processor.size = SizeDict(longest_edge=max(budgets))  # as loaded, then the budget's
        fit_processor(loaded.processor, settings)
        engine = Engine(loaded, settings)
        t0 = time.perf_counter()
        image = decode_image(jpeg, engine.limits.image)
        request = GenerationRequest(
            [ChatMessage("user", [ImagePart(image), TextPart("What is in this picture?")])],
            SamplingParams(max_tokens=1, temperature=0),
            received_at=t0,
        )
        prompt = prepare_prompt(engine.processor, request.messages, engine.limits.prompt)
        t = list(engine.generate(request))[-1].timings
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


def plot(results: list[dict], title: str, path: Path = PLOT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["visual_tokens"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(tokens, [r["ttft_s"] for r in results], "o-", label="time to first token")
    ax.plot(tokens, [r["vision_encode_s"] for r in results], "s--", label="vision encode")
    ax.plot(tokens, [r["prefill_s"] for r in results], "^--", label="prefill")
    for r in results:
        ax.annotate(
            f"{r['width']}×{r['height']}",
            (r["visual_tokens"], r["ttft_s"]),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
        )
    ax.set_xlabel("visual tokens (1920×1080 JPEG resized into the pixel budget)")
    ax.set_ylabel("seconds")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def table(results: list[dict]) -> str:
    from bench.results import markdown_table

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
