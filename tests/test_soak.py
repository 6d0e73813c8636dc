"""A short soak (the long one is `python -m bench.soak`): images, conversations, OpenAI streams and
mid-stream disconnects leave no leaked threads or file descriptors, caches within budget, anonymous
memory flat."""

from __future__ import annotations

from bench.soak import BUDGETS, SOAK_ENV, run_soak

from servers import gunicorn_server


def test_short_soak_leaks_nothing(cache_dir, tiny_dir, tmp_path):
    with gunicorn_server({**SOAK_ENV, "CACHE_DIR": str(cache_dir)}, tmp_path / "log") as (base, _):
        r = run_soak(base, 240)
    assert set(r["statuses"]) == {200}, r["statuses"]
    assert r["end"]["threads"] <= r["warm"]["threads"]
    assert r["end"]["fds"] <= r["warm"]["fds"]
    assert all(r["cache_bytes"][k] <= BUDGETS[k] for k in BUDGETS)
    assert r["cache_bytes"]["vision"] > 0  # the caches were in use
    # A leak of one decoded image per request would add ~10 % here; the long run holds this to 2 %.
    assert r["rss_growth"] < 0.05, r
