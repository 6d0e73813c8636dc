"""A short soak (the long one is `python -m bench.bench_soak`): images, conversations, OpenAI streams and
mid-stream disconnects leave no leaked threads or file descriptors, caches within budget, anonymous
memory flat."""

from __future__ import annotations

import pytest

from bench.bench_soak import BUDGETS, SOAK_ENV, run_soak

from servers import gunicorn_server

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_short_soak_leaks_nothing(cache_dir, tiny_dir, tmp_path):
    with gunicorn_server({**SOAK_ENV, "CACHE_DIR": str(cache_dir)}, tmp_path / "log") as (base, _):
        r = run_soak(base, 240)
    assert set(r["statuses"]) == {200}, r["statuses"]
    assert r["end"]["threads"] <= r["warm"]["threads"]
    assert r["end"]["fds"] <= r["warm"]["fds"]
    assert all(r["cache_bytes"][k] <= BUDGETS[k] for k in BUDGETS)
    assert r["cache_bytes"]["vision"] > 0  # the caches were in use
    # A leak of one decoded image per request would add ~10 % here; the long run holds this to 2 %.
    assert r["anon_growth"] < 0.05, r


def test_onednn_kernel_cache_is_capped_unless_the_environment_says_otherwise():
    """The cap that keeps the soak flat is set before torch loads, by importing the service at all."""
    import os
    import subprocess
    import sys

    probe = "import service.engine.engine, os; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "64"
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "200"
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "200"
