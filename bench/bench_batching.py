"""Continuous batching through the HTTP API: aggregate tokens/s and time to first token of 1, 2 and
4 concurrent text streams, and the longest gap between a stream's tokens while a neighbour's 448²
picture is encoded and prefilled.

    flock /tmp/heavy.lock python -m bench.bench_batching [--model-path DIR] [--threads 2]

One Gunicorn instance (bench/core/servers.py), INT8, caches off (every prompt computed in full), greedy
decoding, each stream its own question. Token counts, times to first token and the longest gap
between two tokens are the server's (the stream's done line): a random checkpoint's tokens mostly
have no text, so streamed deltas would not time tokens. How batched logits differ from alone ones
is measured by `python -m bench.bench_batch_exactness`.
"""

from __future__ import annotations

import base64
import os
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from bench.core.client import chat
from bench.core.harness import concurrently, parse, parser
from bench.core.inputs import DECODE_PROMPT, encoded_photo
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server

QUESTIONS = [
    DECODE_PROMPT,
    "Explain in detail how a bicycle works, from the pedals to the wheels, for a curious child.",
    "Describe a busy market in the morning: the sounds, the colors, the people and what they sell.",
    "Write a letter to a friend about a long train journey through mountains, rivers and old towns.",
]


def ask(base: str, prompt: str, tokens: int, **body):
    """One streamed greedy request; its Reply (the done line: the server's counts and times)."""
    return chat(base, {"prompt": prompt, "max_tokens": tokens, "temperature": 0, **body}, timeout=600)


def concurrent(base: str, questions: list[str], tokens: int) -> tuple[list, float]:
    return concurrently([lambda q=q: ask(base, q, tokens) for q in questions])


def neighbour_run(base: str, tokens: int, picture: bytes) -> list:
    """A text stream; 3 s after it was sent a neighbour sends a new picture (448², vision encoder and
    prefill) with a short question. Their Replies."""
    image = "data:image/png;base64," + base64.b64encode(picture).decode()

    def neighbour():
        time.sleep(3.0)  # well into the runner's decoding (its first token comes after ~0.3 s)
        return ask(base, "What is in this picture?", 4, images=[image])

    return concurrently([lambda: ask(base, QUESTIONS[0], tokens), neighbour])[0]


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per text stream")
    p.add_argument(
        "--prefill-chunk-tokens", type=int, default=None, help="PREFILL_CHUNK_TOKENS (default: the setting's)"
    )
    args = parse(p, argv)
    model_path = args.model_path
    from service.settings import load_settings

    chunk = args.prefill_chunk_tokens or load_settings(model_path=model_path).prefill_chunk_tokens
    env = {
        "MODEL_PATH": str(model_path),
        "QUANTIZATION": args.quantization,
        "THREADS": str(args.threads),
        "MAX_BATCH_SIZE": "4",
        "CACHE_ENABLED": "false",
        "MAX_NEW_TOKENS": str(max(args.tokens * 2, 64)),
        "PREFILL_CHUNK_TOKENS": str(chunk),
    }
    log = Path(tempfile.mkdtemp(prefix="bench-batching-")) / "gunicorn.log"
    print(f"server log: {log}")
    picture = encoded_photo(".png", 448, 448)
    load = os.getloadavg()[0]
    with gunicorn_server(env, log, timeout=600) as (base, _):
        runs = 4 + 1 + 1 + 1 + 1  # warm-up, each question alone, 2 and 4 together, neighbour
        with tqdm(total=runs, desc="batching", unit="run") as bar:
            concurrent(base, QUESTIONS[:1], 4)
            bar.update()
            alone = []
            for question in QUESTIONS:
                (stream,), wall = concurrent(base, [question], args.tokens)
                alone.append((stream, wall))
                bar.update()
            together = {}
            for n in (2, 4):
                together[n] = concurrent(base, QUESTIONS[:n], args.tokens)
                bar.update()
            runner, neighbour = neighbour_run(base, args.tokens * 2, picture)
            bar.update()

    rows = []
    one_rate = statistics.mean(s.tokens / wall for s, wall in alone)
    rows.append(
        [
            1,
            sum(s.tokens for s, _ in alone) // len(alone),
            one_rate,
            1.0,
            statistics.mean(s.ttft for s, _ in alone),
            max(s.ttft for s, _ in alone),
        ]
    )
    for n, (streams, wall) in together.items():
        rate = sum(s.tokens for s in streams) / wall
        rows.append(
            [
                n,
                sum(s.tokens for s in streams),
                rate,
                rate / one_rate,
                statistics.mean(s.ttft for s in streams),
                max(s.ttft for s in streams),
            ]
        )
    table = markdown_table(["streams", "tokens", "aggregate tok/s", "× one stream", "mean TTFT s", "max TTFT s"], rows)
    timings = runner.done["timings"]
    gap = timings["longest_token_gap"]
    gap_rows = [
        [
            f"{gap:.3f}",
            f"{1 / timings['decode_tokens_per_s']:.3f}",
            f"{neighbour.ttft:.2f}",
            neighbour.done["usage"]["prompt_tokens"],
            f"{neighbour.done['timings']['vision_encode']:.2f}",
            f"{neighbour.done['timings']['prefill']:.2f}",
        ]
    ]
    gaps = markdown_table(
        [
            "runner's longest gap between tokens s",
            "runner's mean gap s",
            "neighbour TTFT s",
            "neighbour prompt tokens",
            "neighbour vision_encode s (wall)",
            "neighbour prefill s (wall)",
        ],
        gap_rows,
    )
    four = rows[-1][3]
    verdict = (
        f"Targets: 4 streams ≥ 2.5× one stream — {four:.2f}× ({'met' if four >= 2.5 else 'NOT met'}); "
        f"longest gap while a neighbour prefills ≤ 1 s — {gap:.2f} s ({'met' if gap <= 1 else 'NOT met'}). "
        f"Load average when it started: {load:.2f} (other jobs share these cores)."
    )
    body = (
        f"{table}\n\nAggregate tok/s = all streams' completion tokens ÷ wall time from sending the first "
        f"request to the last answer's end (prefill included); TTFT per stream as the server measured it.\n\n{gaps}\n\n"
        f"{verdict}"
    )
    report(
        args,
        "Batching: concurrent streams through the HTTP API",
        {
            "model": model_path.name,
            "QUANTIZATION": args.quantization,
            "MAX_BATCH_SIZE": 4,
            "PREFILL_CHUNK_TOKENS": chunk,
            "tokens per stream": args.tokens,
            "CACHE_ENABLED": "false",
        },
        body,
    )


if __name__ == "__main__":
    main()
