"""Bounded load test: more concurrent clients than the queue holds, on loopback only.

Every request must end in 200, 429 or 503 within its timeout — none may hang. Prints throughput and
latency percentiles and writes them to bench/RESULTS.md.

    python -m bench.bench_load                      # tiny embedded model, 16 clients, 96 requests
    python -m bench.bench_load --clients 32 --requests 400 --model-path /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from tqdm import tqdm

from bench.core.client import chat
from bench.core.harness import add_speculation, percentile
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server

PROMPTS = ["What is in this picture?", "Describe the colours.", "Count the shapes.", "Tell me a story."]


def one_request(base: str, i: int, max_tokens: int, timeout: float) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    try:
        r = chat(base, body, timeout=timeout, check=False)
    except requests.RequestException:  # timed out (or the connection failed): a hung request
        return {"status": "timeout", "total": time.perf_counter() - t0, "tokens": 0}
    if r.status == 200 and not r.ok:  # a 200 whose stream ended without its done line (an error event after it)
        return {"status": "incomplete", "total": r.total, "tokens": 0}
    return {"status": r.status, "ttft": r.first_text, "total": r.total, "tokens": r.tokens if r.ok else 0}


async def run_load(
    base: str, clients: int, requests: int, max_tokens: int, timeout: float, time_cap: float, backoff: float = 0.5
) -> tuple[list[dict], float]:
    """`clients` workers (each a thread of its own) share `requests` requests, each pausing `backoff` s
    after a refusal; stops starting new ones after `time_cap` s."""
    results: list[dict] = []
    todo = iter(range(requests))
    start = time.perf_counter()
    bar = tqdm(total=requests, desc="load", unit="req")
    loop = asyncio.get_running_loop()

    async def worker(pool):
        for i in todo:
            if time.perf_counter() - start > time_cap:
                return
            result = await loop.run_in_executor(pool, one_request, base, i, max_tokens, timeout)
            results.append(result)
            bar.update()
            if result["status"] in (429, 503):
                await asyncio.sleep(backoff)  # a polite client backs off before its next request

    with ThreadPoolExecutor(max_workers=clients) as pool:
        await asyncio.gather(*(worker(pool) for _ in range(clients)))
    bar.close()
    return results, time.perf_counter() - start


def summarize(results: list[dict], elapsed: float) -> dict:
    statuses = Counter(r["status"] for r in results)
    ok = [r for r in results if r["status"] == 200]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    total = [r["total"] for r in ok]
    return {
        "statuses": dict(statuses),
        "elapsed": elapsed,
        "requests_per_s": len(ok) / elapsed,
        "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "total_p50": percentile(total, 50),
        "total_p90": percentile(total, 90),
        "total_p99": percentile(total, 99),
        "unexpected": sum(n for s, n in statuses.items() if s not in (200, 429, 503)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--queue-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--time-cap", type=float, default=300.0, help="no new requests after this, seconds")
    parser.add_argument("--model-path", help="default: the embedded tiny random model")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "qwen3vl-service"))
    parser.add_argument("--no-save", action="store_true")
    add_speculation(parser)
    args = parser.parse_args(argv)
    env = {"QUEUE_SIZE": str(args.queue_size), "CACHE_DIR": args.cache_dir, "SPECULATIVE": args.speculative}
    if args.model_path:
        env["MODEL_PATH"] = args.model_path
    log = Path(args.cache_dir) / "load-gunicorn.log"
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    with gunicorn_server(env, log) as (base, _):
        results, elapsed = asyncio.run(
            run_load(base, args.clients, args.requests, args.max_tokens, args.timeout, args.time_cap)
        )
    s = summarize(results, elapsed)
    table = markdown_table(
        [
            "requests",
            "200",
            "429",
            "503",
            "other/hung",
            "req/s",
            "tokens/s",
            "TTFT p50/p90/p99 s",
            "total p50/p90/p99 s",
        ],
        [
            [
                len(results),
                s["statuses"].get(200, 0),
                s["statuses"].get(429, 0),
                s["statuses"].get(503, 0),
                s["unexpected"],
                s["requests_per_s"],
                s["tokens_per_s"],
                f"{s['ttft_p50']:.3f} / {s['ttft_p90']:.3f} / {s['ttft_p99']:.3f}",
                f"{s['total_p50']:.3f} / {s['total_p90']:.3f} / {s['total_p99']:.3f}",
            ]
        ],
    )
    settings = {
        "clients": args.clients,
        "queue_size": args.queue_size,
        "max_tokens": args.max_tokens,
        "weights": args.model_path or "embedded tiny random",
    }
    report(args, "Load: more clients than the queue holds", settings, table)
    return 1 if s["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
