"""What a 10-second clip costs: decoding and sampling, visual tokens, vision encoding, time to first token.

Two tables. First, OpenCV decoding alone (no model): 10-second clips written with OpenCV
(MPEG-4 Part 2 in MP4, MJPEG in AVI, VP9 in WebM — OpenCV's wheel has no H.264 encoder; VP9 at
720p only, its encoder takes minutes) at 720p and 1080p, kept in --clip-dir for the next run,
sampled at the settings' VIDEO_FPS, best of three. Second, the engine with the
checkpoint (default: the 2B-shaped random one, INT8, 2 threads) answering a question about the
720p MP4 clip at each visual-token budget (VIDEO_MAX_VISUAL_TOKENS, default first), then a
follow-up question in the same conversation and the same clip opening a new conversation (the
caches at work). Timings are the engine's own (the `done` line's), time to first token counted
from before the clip is decoded. Prints both tables and writes them to bench/RESULTS.md.

    flock /tmp/heavy.lock python -m bench.bench_video
    python -m bench.bench_video --model-path /path/to/Qwen3-VL-2B-Instruct --threads 4 --budgets 1024
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import cv2
from tqdm import tqdm

from bench.core.harness import parse, parser
from bench.core.inputs import CODECS, clip_bytes
from bench.core.results import markdown_table, report
from bench.core.session import Session

CLIPS = [
    ("720p", (1280, 720), "mp4"),
    ("720p", (1280, 720), "avi"),
    ("720p", (1280, 720), "webm"),
    ("1080p", (1920, 1080), "mp4"),
    ("1080p", (1920, 1080), "avi"),
]
QUESTION = "What happens in this clip? Describe the motion."


def decoding_table(clips: dict[str, bytes], limits) -> str:
    """Decode each clip three times; bytes beyond VIDEO_MAX_BYTES are decoded anyway and marked."""
    from service.media.video import decode_video

    unlimited = dataclasses.replace(limits, max_bytes=2**40)
    rows = []
    for name, data in tqdm(clips.items(), desc="decoding", unit="clip"):
        best, video = float("inf"), None
        for _ in range(3):
            t0 = time.perf_counter()
            video = decode_video(data, unlimited)
            best = min(best, time.perf_counter() - t0)
        w, h = video.size
        accepted = "yes" if len(data) <= limits.max_bytes else "no (413)"
        rows.append(
            [
                name,
                f"{len(data) / 1e6:.1f} MB",
                accepted,
                video.source_frames,
                len(video.frames),
                f"{w}x{h}",
                best,
                best / video.source_frames * 1000,
            ]
        )
    header = [
        "clip (10 s, 30 fps)",
        "file",
        "within VIDEO_MAX_BYTES",
        "frames in clip",
        "frames sampled",
        "sampled size",
        "decode (s)",
        "ms per source frame",
    ]
    return markdown_table(header, rows)


def encoder_calls(engine, video) -> tuple[float, float]:
    """Seconds to encode `video` one frame pair per call (the service) and in one call (get_video_features)."""
    import torch

    from service.media.video import video_patches
    from service.vision.steps import run_to_end, video_steps

    pixel_values, grid = video_patches(video, engine.processor.image_processor)
    with torch.inference_mode():
        t0 = time.perf_counter()
        run_to_end(video_steps(engine.vision_encoder, pixel_values, grid))
        t1 = time.perf_counter()
        engine.model.model.get_video_features(pixel_values, grid)
        return t1 - t0, time.perf_counter() - t1


def model_rows(session: Session, clip: bytes, budgets: list[int], max_tokens: int, bar: tqdm) -> tuple[list, tuple]:
    from service.media.video import decode_video, video_patches

    image_processor = session.processor.image_processor
    rows = []
    for budget in budgets:
        engine = session.variant(video_max_visual_tokens=budget)
        engine.ask(engine.picture(0, 224), "Warm-up.", max_tokens=2, conversation_id="warm-up")  # first-call costs

        def row(label, done, video, budget=budget):
            _, grid = video_patches(video, image_processor)
            t = done.timings
            tokens = int(grid[0].prod()) // image_processor.merge_size**2
            return [
                label,
                budget,
                len(video.frames),
                "{}x{}".format(*video.size),
                tokens,
                done.prompt_tokens,
                done.cached_tokens,
                done.vision_cache_hits,
                t.video_decode,
                t.vision_encode,
                t.prefill,
                t.time_to_first_token,
                t.decode_tokens_per_s,
            ]

        def ask(video, *messages, question=QUESTION, conversation=f"clip-{budget}", start=None, engine=engine):
            """The clip (decoded from `start` on: the request's arrival) after `messages`, or `messages` alone."""
            history = [*messages, engine.message(video, question)] if question else list(messages)
            kwargs = {"received_at": start or time.perf_counter(), "conversation_id": conversation}
            return engine.ask(messages=history, max_tokens=max_tokens, **kwargs), history

        start = time.perf_counter()
        video = decode_video(clip, engine.engine.limits.video)
        first, history = ask(video, start=start)
        rows.append(row("new clip", first, video))
        bar.update()
        if budget != budgets[0]:
            continue
        said = [engine.message(first.text, role="assistant"), engine.message("And what happens at the end?")]
        follow, _ = ask(video, *history, *said, question=None)
        rows.append(row("follow-up question, same conversation", follow, video))
        bar.update()
        start = time.perf_counter()
        again = decode_video(clip, engine.engine.limits.video)
        reopened, _ = ask(again, question="Who is in it?", conversation="another", start=start)
        rows.append(row("same clip, new conversation", reopened, again))
        bar.update()
        calls = encoder_calls(engine.engine, video)
        bar.update()
    return rows, calls


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--budgets", default="1024,512,256", help="VIDEO_MAX_VISUAL_TOKENS values, the default first")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length of each request")
    p.add_argument(
        "--clip-dir", type=Path, default=None, help="where the test clips are kept (default: CACHE_DIR/bench-clips)"
    )
    args = parse(p, argv)
    budgets = [int(b) for b in args.budgets.split(",")]

    from service.limits import RequestLimits
    from service.media.images import fit_processor
    from service.model.loading import load_processor
    from service.settings import load_settings

    settings = {"model_path": args.model_path, "quantization": args.quantization, "threads": args.threads}
    base = load_settings(**settings)
    processor = load_processor(args.model_path)
    fit_processor(processor)
    limits = RequestLimits.build(base, processor).video
    clip_dir = args.clip_dir or base.cache_dir / "bench-clips"
    clips = {
        f"{label} {CODECS[container][1]} ({container.upper()})": clip_bytes(clip_dir / f"{label}.{container}", size)
        for label, size, container in tqdm(CLIPS, desc="test clips", unit="clip")
    }
    decode_body = decoding_table(clips, limits)
    decode_settings = {
        "VIDEO_FPS": base.video_fps,
        "VIDEO_MAX_FRAMES": base.video_max_frames,
        "VIDEO_MAX_VISUAL_TOKENS": base.video_max_visual_tokens,
        "decoder threads": 1,
        "OpenCV": cv2.__version__,
    }
    title = "Video decoding and sampling with OpenCV"
    report(args, title, decode_settings, decode_body, threads=1)

    bar = tqdm(total=len(budgets) + 3, desc="requests", unit="req")
    t0 = time.perf_counter()
    session = Session(args.model_path, args.threads, quantization=args.quantization, cache_enabled=True)
    load_seconds = time.perf_counter() - t0
    rows, (per_pair, whole) = model_rows(
        session, clips[f"720p {CODECS['mp4'][1]} (MP4)"], budgets, args.max_tokens, bar
    )
    bar.close()
    header = [
        "request",
        "VIDEO_MAX_VISUAL_TOKENS",
        "frames",
        "frame size",
        "visual tokens",
        "prompt tokens",
        "cached tokens",
        "vision cache hits",
        "video decode (s)",
        "vision encode (s)",
        "prefill (s)",
        "time to first token (s)",
        "decode (tok/s)",
    ]
    default = rows[0]
    body = markdown_table(header, rows) + (
        f"\n\nThe 10-second 720p clip at the default budget: {default[2]} frames, {default[4]} visual tokens, "
        f"first token after {default[11]:.1f} s (of which vision encoding {default[9]:.1f} s, prefill "
        f"{default[10]:.1f} s, decoding the clip {default[8]:.2f} s). Model load: {load_seconds:.0f} s.\n"
        f"Vision encoder on that clip: one call per frame pair (what the service does) {per_pair:.1f} s, one call "
        f"for the whole video (get_video_features) {whole:.1f} s."
    )
    model_settings = {
        "MODEL_PATH": args.model_path.name,
        "QUANTIZATION": args.quantization,
        "THREADS": args.threads,
        "VIDEO_FPS": base.video_fps,
        "VIDEO_MAX_FRAMES": base.video_max_frames,
        "IMAGE_MAX_PIXELS": base.image_max_pixels,
        "max_tokens": args.max_tokens,
        "clip": "10 s, 1280x720, 30 fps, MPEG-4 Part 2 in MP4",
    }
    title = "A 10-second clip through the engine"
    return report(args, title, model_settings, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
