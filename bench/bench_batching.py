"""Continuous batching through the HTTP API: aggregate tokens/s and time to first token of 1, 2 and
4 concurrent text streams, and the longest gap between a stream's tokens while a neighbour's 448²
picture is encoded and prefilled.

    flock /tmp/heavy.lock python -m bench.bench_batching [--model-path DIR] [--threads 2]

One Gunicorn instance (tests/servers.py), INT8, caches off (every prompt computed in full), greedy
decoding, each stream its own question. Token counts, times to first token and the longest gap
between two tokens are the server's (the stream's done line): a random checkpoint's tokens mostly
have no text, so streamed deltas would not time tokens. How batched logits differ from alone ones
is measured by `python -m bench.batch_exactness`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench.harness import add_checkpoint_args, checkpoint_of, encoded_photo  # noqa: E402
from bench.results import append_section, markdown_table  # noqa: E402

from servers import gunicorn_server  # noqa: E402

QUESTIONS = [
    "Tell me a long story about a red square that travels across a blue sky to find a yellow circle.",
    "Explain in detail how a bicycle works, from the pedals to the wheels, for a curious child.",
    "Describe a busy market in the morning: the sounds, the colors, the people and what they sell.",
    "Write a letter to a friend about a long train journey through mountains, rivers and old towns.",
]


class Stream:
    """One streaming /v1/chat request on its own thread, and its final line."""

    def __init__(self, base: str, body: dict):
        self.base, self.body = base, {"stream": True, "temperature": 0, **body}
        self.done: dict = {}
        self.thread = threading.Thread(target=self._run)

    def start(self) -> Stream:
        self.thread.start()
        return self

    def _run(self) -> None:
        with requests.post(self.base + "/v1/chat", json=self.body, stream=True, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line:
                    continue
                obj = json.loads(line)
                if obj.get("done"):
                    self.done = obj

    def join(self) -> Stream:
        self.thread.join()
        return self

    @property
    def ttft(self) -> float:
        """The server's time to first token (a token without text streams no delta to time)."""
        return self.done["timings"]["time_to_first_token"]

    @property
    def tokens(self) -> int:
        return self.done["usage"]["completion_tokens"]


def concurrent(base: str, questions: list[str], tokens: int) -> tuple[list[Stream], float]:
    streams = [Stream(base, {"prompt": q, "max_tokens": tokens}) for q in questions]
    t0 = time.perf_counter()
    for s in streams:
        s.start()
    for s in streams:
        s.join()
    return streams, time.perf_counter() - t0


def neighbour_run(base: str, tokens: int, picture: bytes) -> tuple[Stream, Stream]:
    """A text stream; 3 s after it was sent a neighbour sends a new picture (448², vision encoder and
    prefill) with a short question."""
    runner = Stream(base, {"prompt": QUESTIONS[0], "max_tokens": tokens}).start()
    time.sleep(3.0)  # well into its decoding (its first token comes after ~0.3 s)
    image = "data:image/png;base64," + base64.b64encode(picture).decode()
    neighbour = Stream(base, {"prompt": "What is in this picture?", "images": [image], "max_tokens": 4}).start()
    return runner.join(), neighbour.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(parser)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per text stream")
    parser.add_argument(
        "--prefill-chunk-tokens", type=int, default=None, help="PREFILL_CHUNK_TOKENS (default: the setting's)"
    )
    args = parser.parse_args()
    model_path = checkpoint_of(args)
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
    append_section(
        "Batching: concurrent streams through the HTTP API (python -m bench.bench_batching)",
        {
            "model": model_path.name,
            "QUANTIZATION": args.quantization,
            "MAX_BATCH_SIZE": 4,
            "PREFILL_CHUNK_TOKENS": chunk,
            "tokens per stream": args.tokens,
            "CACHE_ENABLED": "false",
        },
        body,
        threads=args.threads,
    )


if __name__ == "__main__":
    main()
