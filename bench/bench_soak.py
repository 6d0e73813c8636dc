"""Soak: many requests on the tiny model mixing images, multi-turn conversations, OpenAI streams and
mid-stream disconnects. Afterwards the worker's anonymous memory (what a leak grows; file-backed pages
of the mapped embedding and libraries are reclaimable, and fill as new token rows are read) must have
grown < 2 % since warm-up, with no leaked threads or file descriptors, and the caches within their budgets.

    python -m bench.bench_soak                 # 1,000 requests, results written to bench/RESULTS.md
    python -m bench.bench_soak --requests 150 --no-save
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import re
import socket
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import psutil
import requests
from tqdm import tqdm

from bench.core.client import chat, openai_chat
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server, metric
from service.memory import unreclaimable_bytes

# Small cache budgets, so the caches are full (and evicting) before warm-up ends: growth after
# that is a leak, not a cache filling up.
SOAK_ENV = {
    "CONVERSATION_CACHE_MAX_ENTRIES": "16",
    "VISION_CACHE_MAX_ENTRIES": "16",
    "CONVERSATION_CACHE_MAX_BYTES": str(32 * 1024**2),
    "VISION_CACHE_MAX_BYTES": str(16 * 1024**2),
    "CONVERSATION_HISTORY_MAX": "16",
    "QUEUE_SIZE": "4",
    "MAX_NEW_TOKENS": "48",
}
BUDGETS = {"conversation": 32 * 1024**2, "vision": 16 * 1024**2}


def png(seed: int, width: int, height: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    return cv2.imencode(".png", img)[1].tobytes()


class Soak:
    def __init__(self, base: str, seed: int = 0):
        self.base = base
        self.rng = random.Random(seed)
        self.pool = [png(i, 64 + 32 * i, 96) for i in range(6)]  # repeated images: vision-cache hits
        self.conversations: list[str] = []
        self.counts: dict[str, int] = {}

    def _image(self) -> bytes:
        if self.rng.random() < 0.3:
            return png(self.rng.randrange(10**9), self.rng.choice([64, 128, 200]), self.rng.choice([64, 160]))
        return self.rng.choice(self.pool)

    def native_image(self) -> int:
        form = {"prompt": "What is it?", "max_tokens": str(self.rng.randint(4, 24)), "stream": "false"}
        files = [("image", ("i.png", self._image(), "image/png"))]
        r = chat(self.base, form=form, files=files, timeout=60, check=False)
        if r.ok:
            self.conversations = (self.conversations + [r.done["conversation_id"]])[-8:]
        return r.status

    def follow_up(self) -> int:
        if not self.conversations:
            return self.native_image()
        form = {"prompt": "And then?", "max_tokens": "8", "conversation_id": self.rng.choice(self.conversations)}
        return chat(self.base, form=form, timeout=60, check=False).status

    def openai_stream(self) -> int:
        url = "data:image/png;base64," + base64.b64encode(self._image()).decode()
        history = [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}],
            },
            {"role": "assistant", "content": "It is noise."},
            {"role": "user", "content": "Again?"},
        ]
        body = {"messages": history, "max_tokens": 12, "stream": True}
        return openai_chat(self.base, body, timeout=60, check=False).status

    def disconnect(self) -> int:
        body = json.dumps({"prompt": "Go on and on.", "max_tokens": 48}).encode()
        host, port = self.base.rsplit("//", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            received = b""
            while received.count(b"\n") < 12 and (chunk := sock.recv(4096)):
                received += chunk
        self._until_nothing_generates()
        return 200 if received.startswith(b"HTTP/1.1 200") else int(received[9:12] or 0)

    def _until_nothing_generates(self, timeout: float = 30) -> None:
        """Wait for the abandoned stream's generation to stop: the next request must not overlap it, or
        Gunicorn's thread pool grows by one (its threads are made on demand, never ended) and a leak check
        over thread counts would see a thread that is no leak."""
        deadline = time.monotonic() + timeout
        while metric(self.base, "qwen3vl_generating") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)

    def step(self) -> int:
        kind = self.rng.choices(["native_image", "follow_up", "openai_stream", "disconnect"], [40, 25, 20, 15])[0]
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return getattr(self, kind)()


def worker_process(base: str) -> psutil.Process:
    pid = re.search(r'qwen3vl_process_rss_bytes\{pid="(\d+)"\}', requests.get(base + "/metrics").text).group(1)
    return psutil.Process(int(pid))


def snapshot(proc: psutil.Process) -> dict:
    """The worker's memory as its guard counts it (anonymous: RSS less file-backed and shared pages)
    and the file-backed rest, its threads and open files."""
    time.sleep(0.3)  # let disconnected streams finish their clean-up
    return {
        "anon": unreclaimable_bytes(proc),
        "file": proc.memory_info().shared,
        "threads": proc.num_threads(),
        "fds": proc.num_fds(),
    }


def run_soak(base: str, requests_total: int, warmup_fraction: float = 0.5) -> dict:
    """Run the mix; RSS is compared between the end of warm-up and the end. Warm-up is long
    (half the run) because per-shape kernel caches and allocator arenas keep filling for a few
    hundred requests before RSS flattens."""
    soak = Soak(base)
    proc = worker_process(base)
    statuses: dict[int, int] = {}
    warm = None
    for i in tqdm(range(requests_total), desc="soak", unit="req"):
        if i == int(requests_total * warmup_fraction):
            warm = snapshot(proc)
        status = soak.step()
        statuses[status] = statuses.get(status, 0) + 1
    end = snapshot(proc)
    cache_bytes = {name: metric(base, "qwen3vl_cache_bytes", f'cache="{name}"') for name in BUDGETS}
    return {
        "warm": warm,
        "end": end,
        "statuses": statuses,
        "kinds": soak.counts,
        "cache_bytes": cache_bytes,
        "anon_growth": (end["anon"] - warm["anon"]) / warm["anon"],  # anonymous memory: what leaks
        "same_worker": proc.is_running(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "qwen3vl-service"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    with gunicorn_server({**SOAK_ENV, "CACHE_DIR": args.cache_dir}, Path(args.cache_dir) / "soak.log") as (base, _):
        r = run_soak(base, args.requests)
    ok = (
        r["anon_growth"] < 0.02
        and r["end"]["threads"] <= r["warm"]["threads"]
        and r["end"]["fds"] <= r["warm"]["fds"]
        and all(r["cache_bytes"][k] <= BUDGETS[k] for k in BUDGETS)
        and not any(s >= 500 and s != 503 for s in r["statuses"])
    )
    table = markdown_table(
        [
            "requests",
            "statuses",
            "anonymous memory after warm-up → end (MiB)",
            "growth",
            "file-backed (MiB)",
            "threads",
            "fds",
            "KV / vision cache bytes (budget)",
            "verdict",
        ],
        [
            [
                args.requests,
                r["statuses"],
                f"{r['warm']['anon'] / 2**20:.1f} → {r['end']['anon'] / 2**20:.1f}",
                f"{100 * r['anon_growth']:+.2f} %",
                f"{r['warm']['file'] / 2**20:.1f} → {r['end']['file'] / 2**20:.1f}",
                f"{r['warm']['threads']} → {r['end']['threads']}",
                f"{r['warm']['fds']} → {r['end']['fds']}",
                f"{r['cache_bytes']['conversation'] / 2**20:.1f} / {r['cache_bytes']['vision'] / 2**20:.1f} MiB "
                f"({BUDGETS['conversation'] // 2**20} / {BUDGETS['vision'] // 2**20})",
                "pass" if ok else "FAIL",
            ]
        ],
    )
    settings = {
        "mix": r["kinds"],
        "weights": "embedded tiny random",
        **{k.lower(): v for k, v in SOAK_ENV.items()},
    }
    report(args, "Soak: images, conversations, disconnects", settings, table, threads=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
