"""Interactive first: a picture question's first token while batch work runs, and the batch's own
throughput against the same requests sent over HTTP.

    flock /tmp/heavy.lock python -m bench.bench_priorities [--model-path DIR] [--threads 2]

One Gunicorn instance (MAX_BATCH_SIZE 4, QUEUE_SIZE 8, caches off: every picture and clip computed),
INT8, greedy. An interactive question: a 448×448 picture of its own and a question, 8 tokens, on the
native endpoint, streamed, one at a time with 0.5 s between them; its first token is timed by the server
(the done line's `time_to_first_token`: from the request's arrival, queue wait included), since a random
model's first tokens often decode to no text and so send no event a client could time. Measured (a) on
an idle server; (b) while batch jobs run: the OpenAI Batch API, 40 lines each (pictures of 336² and
4-frame clips inline as data URLs, 24 tokens), at BATCH_PRIORITY; (c) today's FIFO: the same 40 requests
sent as ordinary HTTP requests at priority 0 by 8 client threads (the batch's 4 places and half the
queue: none is refused), the interactive questions at priority 0 too. The load of (b) and (c) runs until
the last question has ended (two batches kept in the store / the 40 requests sent again), so every
question meets a full machine. Throughput: the 40 lines as one batch with nothing else (create →
completed) against the same 40 requests sent over HTTP by the 8 threads (first sent → last answered).
"""

from __future__ import annotations

import base64
import json
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path

import openai
from tqdm import tqdm

from bench.core.client import chat, openai_chat
from bench.core.harness import parse, parser, percentile
from bench.core.inputs import QUESTION, clip_bytes, photo_url, user
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server, metric

LINES = 40
HTTP_SENDERS = 8
QUESTIONS = 20
WARM_UP = 3
ENDED = ("completed", "failed", "expired", "cancelled")


def batch_requests(clip_url: str, tokens: int) -> list[dict]:
    """The 40 chat-completion bodies: pictures of their own and clips, alternating."""
    bodies = []
    for i in range(LINES):
        if i % 2:
            media = {"type": "video_url", "video_url": {"url": clip_url}}
            content = [media, {"type": "text", "text": f"Clip {i}: what moves, and where?"}]
            message = {"role": "user", "content": content}
        else:
            message = user(photo_url(seed=1000 + i, size=336), f"Picture {i}: what is in it?")
        bodies.append({"model": "qwen3-vl", "messages": [message], "max_tokens": tokens, "temperature": 0})
    return bodies


def batch_file(bodies: list[dict]) -> bytes:
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(bodies)
    ]
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def submit(client, content: bytes):
    uploaded = client.files.create(file=("lines.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client, batch_id: str, poll: float = 0.1):
    while (batch := client.batches.retrieve(batch_id)).status not in ENDED:
        time.sleep(poll)
    return batch


def batch_tokens(client, batch) -> int:
    text = client.files.content(batch.output_file_id).text
    return sum(json.loads(r)["response"]["body"]["usage"]["completion_tokens"] for r in text.splitlines())


def settle(base: str, timeout: float = 300) -> None:
    """Wait until nothing runs on the server (cancelled lines and streams have ended)."""
    deadline = time.monotonic() + timeout
    while metric(base, "qwen3vl_generating") or metric(base, "qwen3vl_batch_lines_running"):
        if time.monotonic() > deadline:
            raise RuntimeError("the server is still busy")
        time.sleep(0.2)


def ask(base: str, seed: int) -> float:
    """One interactive question (priority 0); its first-token time, from its arrival at the server."""
    body = {"prompt": QUESTION, "images": [photo_url(seed=seed)], "max_tokens": 8, "temperature": 0}
    return chat(base, {**body, "priority": 0}, timeout=600).ttft


def questions(base: str, first_seed: int, bar: tqdm, busy=lambda: True) -> tuple[list[float], list[float]]:
    """QUESTIONS interactive questions that met a busy server (`busy()` before and after each): their
    first-token times, and the batch lines running when each was sent."""
    times, running = [], []
    seed = first_seed
    while len(times) < QUESTIONS:
        time.sleep(0.5)
        seed += 1
        if not busy():
            continue
        lines = metric(base, "qwen3vl_batch_lines_running")
        t = ask(base, seed)
        if busy():
            times.append(t)
            running.append(lines)
            bar.update()
    return times, running


class HttpLoad:
    """HTTP_SENDERS client threads sending the bodies (again and again until stopped, or once)."""

    def __init__(self, base: str, bodies: list[dict], repeat: bool):
        self.base, self.repeat = base, repeat
        self.todo: queue.Queue = queue.Queue()
        for body in bodies:
            self.todo.put(body)
        self.stop, self.tokens = threading.Event(), []
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(HTTP_SENDERS)]

    def _send(self) -> None:
        while not self.stop.is_set():
            try:
                body = self.todo.get_nowait()
            except queue.Empty:
                return
            reply = openai_chat(self.base, {**body, "priority": 0}, timeout=900)
            self.tokens.append(reply.done["usage"]["completion_tokens"])
            if self.repeat:
                self.todo.put(body)

    def run(self) -> HttpLoad:
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


class BatchLoad:
    """Batches of the 40 lines kept in the store (two unfinished at any time) until stopped."""

    def __init__(self, client, content: bytes):
        self.client, self.content, self.stop = client, content, threading.Event()
        self.thread = threading.Thread(target=self._keep, daemon=True)
        self.batches: list = []

    def _keep(self) -> None:
        while not self.stop.is_set():
            open_ = [b for b in self.batches if self.client.batches.retrieve(b.id).status not in ENDED]
            if len(open_) < 2:
                self.batches.append(submit(self.client, self.content))
            self.stop.wait(0.5)

    def run(self) -> BatchLoad:
        self.batches.append(submit(self.client, self.content))
        self.thread.start()
        return self

    def join(self) -> None:
        self.stop.set()
        self.thread.join()
        for b in self.batches:
            if self.client.batches.retrieve(b.id).status not in ENDED:
                self.client.batches.cancel(b.id)


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=24, help="new tokens per batch line")
    args = parse(p, argv)
    env = {
        "MODEL_PATH": str(args.model_path),
        "QUANTIZATION": args.quantization,
        "THREADS": str(args.threads),
        "MAX_BATCH_SIZE": "4",
        "QUEUE_SIZE": "8",
        "CACHE_ENABLED": "false",
        "MAX_NEW_TOKENS": "64",
    }
    folder = Path(tempfile.mkdtemp(prefix="bench-priorities-"))
    log = folder / "gunicorn.log"
    print(f"server log: {log}")
    clip = clip_bytes(folder / "clip.mp4", (320, 240), seconds=2.0, fps=10.0)
    bodies = batch_requests("data:video/mp4;base64," + base64.b64encode(clip).decode(), args.tokens)
    content = batch_file(bodies)
    with gunicorn_server(env, log, timeout=600) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=900, max_retries=0)
        with tqdm(total=3 * QUESTIONS + 2 * LINES, desc="priorities", unit="request") as bar:
            for seed in range(WARM_UP):  # unmeasured: the first requests after a start
                ask(base, seed)
            idle, _ = questions(base, 100, bar)

            began = time.perf_counter()
            batch = wait_batch(client, submit(client, content).id)
            batch_wall = time.perf_counter() - began
            batch_done = batch.request_counts.completed
            batch_toks = batch_tokens(client, batch)
            bar.update(LINES)
            settle(base)

            began = time.perf_counter()
            alone = HttpLoad(base, bodies, repeat=False).run()
            for t in alone.threads:
                t.join()
            http_wall = time.perf_counter() - began
            bar.update(LINES)
            settle(base)

            preempted = metric(base, "qwen3vl_preemptions_total")
            load = BatchLoad(client, content).run()
            time.sleep(3)  # the runner has claimed its lines
            during_batch, lines_running = questions(
                base, 200, bar, lambda: metric(base, "qwen3vl_batch_lines_running") > 0
            )
            load.join()
            preempted = metric(base, "qwen3vl_preemptions_total") - preempted
            settle(base)

            load = HttpLoad(base, bodies, repeat=True).run()
            time.sleep(3)
            during_http, _ = questions(base, 300, bar)
            load.join()

    raw = {"idle": idle, "during_batch": during_batch, "during_http": during_http, "batch_wall": batch_wall}
    (folder / "times.json").write_text(json.dumps({**raw, "http_wall": http_wall, "lines_running": lines_running}))
    idle50, idle95 = statistics.median(idle), percentile(idle, 95)

    def row(name, times, note):
        p50, p95 = statistics.median(times), percentile(times, 95)
        return [name, len(times), p50, p95, f"{p50 / idle50:.2f}×", f"{p95 / idle95:.2f}×", note]

    rows = [
        row("idle server", idle, ""),
        row(
            "during batch jobs (priorities)",
            during_batch,
            f"{statistics.mean(lines_running):.1f} lines running when sent; {preempted:.0f} lines paused",
        ),
        row(f"during the same requests over HTTP at priority 0 (FIFO, {HTTP_SENDERS} senders)", during_http, ""),
    ]
    first = markdown_table(
        ["interactive question", "questions", "first token p50 (s)", "p95 (s)", "p50 ÷ idle", "p95 ÷ idle", ""], rows
    )
    http_toks = sum(alone.tokens)
    throughput = markdown_table(
        ["40 requests", "answered", "completion tokens", "wall (s)", "requests/s", "tok/s", "÷ over HTTP"],
        [
            ["as a batch job, nothing else running", batch_done, batch_toks, batch_wall, LINES / batch_wall,
             batch_toks / batch_wall, f"{http_wall / batch_wall:.2f}×"],
            [f"over HTTP, {HTTP_SENDERS} concurrent senders", len(alone.tokens), http_toks, http_wall,
             LINES / http_wall, http_toks / http_wall, "1.00×"],
        ],
    )  # fmt: skip
    b50 = rows[1][2] / idle50
    b95 = rows[1][3] / idle95
    ratio = http_wall / batch_wall
    verdict = (
        f"Targets: first token during a batch ≤ 1.25× idle at p50 — {b50:.2f}× "
        f"({'met' if b50 <= 1.25 else 'NOT met'}), "
        f"≤ 1.5× at p95 — {b95:.2f}× ({'met' if b95 <= 1.5 else 'NOT met'}); "
        f"batch throughput ≥ 0.9× the same requests over HTTP — {ratio:.2f}× ({'met' if ratio >= 0.9 else 'NOT met'})."
    )
    body = (
        f"{first}\n\n{throughput}\n\n{verdict}\n\n"
        "First tokens from the done line (the request's arrival → its first token), p95 the inclusive percentile; a "
        "question counts only while the load ran (batch lines running before and after it). The batch's "
        "wall time: `batches.create` → `completed` seen by polling every 0.1 s."
    )
    report(
        args,
        "Interactive first: picture questions during batch jobs",
        {
            "model": args.model_path.name,
            "QUANTIZATION": args.quantization,
            "MAX_BATCH_SIZE": 4,
            "QUEUE_SIZE": 8,
            "BATCH_PRIORITY": "10 (default)",
            "CACHE_ENABLED": "false",
            "interactive": "448² picture + question, 8 tokens",
            "batch lines": f"{LINES}: 336² pictures and 4-frame 320×240 clips, {args.tokens} tokens",
        },
        body,
    )


if __name__ == "__main__":
    main()
