"""A short bounded load: more concurrent clients than the queue holds; every request ends in
success or 429/503 within its timeout, none hangs. (`python -m bench.bench_load` is the long version.)"""

from __future__ import annotations

import asyncio

import pytest

from bench.bench_load import run_load, summarize

from servers import gunicorn_server

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_more_clients_than_the_queue_all_end_in_success_or_429(cache_dir, tiny_dir, tmp_path):
    env = {"QUEUE_SIZE": "2", "CACHE_DIR": str(cache_dir)}
    with gunicorn_server(env, tmp_path / "log") as (base, _):
        results, elapsed = asyncio.run(run_load(base, clients=8, requests=32, max_tokens=24, timeout=60, time_cap=60))
    s = summarize(results, elapsed)
    assert len(results) == 32
    assert s["unexpected"] == 0, s["statuses"]  # no timeouts, no 5xx other than 503
    assert s["statuses"].get(200, 0) >= 3  # the running one and the queue are served
    assert s["statuses"].get(429, 0) >= 1  # and the rest were refused at once, not left hanging
