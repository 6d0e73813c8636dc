"""PRELOAD under the real Gunicorn: the master holds the loaded model, and a worker that dies is
replaced by a fork of it in about a second, answering as before."""

from __future__ import annotations

import time

import psutil
import pytest
import requests

QUESTION = {"prompt": "Tell me a story about a red square.", "max_tokens": 24, "temperature": 0, "stream": False}


@pytest.fixture(scope="module")
def preloaded(serve):
    """(base URL, master) of one Gunicorn with PRELOAD for this module: a worker killed by one test is
    replaced by a fork of the master, as the other test wants to find it."""
    with serve({"PRELOAD": "true"}, "preload") as (base, master):
        yield base, master


def only_worker(master_pid: int) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = psutil.Process(master_pid).children()
        if len(workers) == 1:
            return workers[0]
        time.sleep(0.05)
    raise AssertionError("no single worker")


def test_a_worker_killed_mid_stream_is_back_within_seconds_and_answers_the_same(preloaded):
    base, master = preloaded
    before = requests.post(base + "/v1/chat", json=QUESTION, timeout=60).json()
    worker = only_worker(master.pid)
    stream = requests.post(
        base + "/v1/chat",
        json={"prompt": "Talk forever.", "max_tokens": 1000, "temperature": 0},
        stream=True,
        timeout=30,
    )
    lines = stream.iter_lines()
    assert "conversation_id" in next(lines).decode()
    killed_at = time.monotonic()
    worker.kill()
    received = []
    try:
        received = [line for line in lines if line]
    except requests.RequestException:  # the connection was cut mid-chunk
        pass
    assert not any(b'"done": true' in line or b'"done":true' in line for line in received)
    while True:  # the master forks a new worker from the loaded model
        try:
            if requests.get(base + "/ready", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() - killed_at < 10, "no worker answered /ready within 10 s"
        time.sleep(0.05)
    back_after = time.monotonic() - killed_at
    replacement = only_worker(master.pid)
    assert replacement.pid != worker.pid
    assert back_after <= 3.0, f"back after {back_after:.1f} s"
    after = requests.post(base + "/v1/chat", json=QUESTION, timeout=60).json()
    assert after["text"] == before["text"] and after["usage"] == before["usage"]


def test_the_master_holds_the_model_and_the_worker_shares_its_memory(preloaded):
    base, master = preloaded
    worker = only_worker(master.pid)
    master_rss = psutil.Process(master.pid).memory_info().rss
    assert master_rss > 200 * 1024**2  # torch, transformers and the model were loaded here
    # Another question than the other test's: neither finds the other's answer cached, in either order.
    asked = requests.post(base + "/v1/chat", json={**QUESTION, "prompt": "A blue circle?"}, timeout=60)
    assert asked.status_code == 200
    # Copy-on-write: most of the worker's resident pages are still the master's.
    shared = psutil.Process(worker.pid).memory_full_info()
    assert shared.uss < 0.7 * shared.rss
