"""Only the engine's scheduler computes on several cores (service/threads.py): any other thread that
runs torch ops — a request thread preparing a picture, the caller of the loader — computes on one
and starts no OpenMP team of its own, whose threads would make libgomp stop spinning between the
decode step's parallel regions (a decode step measured 2x slower on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from test_caches import image

import service
from service.engine.engine import GenerationRequest, SamplingParams
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.threads import compute_on


def os_threads() -> int:
    """The process's OS threads, once the count holds still (an ended thread's team takes a moment to go)."""
    count = -1
    while count != (count := len(os.listdir("/proc/self/task"))):
        time.sleep(0.2)
    return count


def on_a_thread_that_stays(work) -> tuple[object, int, int]:
    """Run `work()` on a new thread that then waits: (its result, its torch threads, OS threads
    the process gained while it ran and waits — itself and any OpenMP team it started)."""
    before, out, done, leave = os_threads(), {}, threading.Event(), threading.Event()

    def run():
        out["value"] = work()
        out["threads"] = torch.get_num_threads()
        done.set()
        leave.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    done.wait(120)
    gained = os_threads() - before
    leave.set()
    thread.join()
    return out["value"], out["threads"], gained


def test_a_picture_request_from_another_thread_starts_no_team_of_its_own(engine):
    def ask():
        parts = [ImagePart(image(engine, 320, 240, seed=5)), TextPart("What is this?")]
        request = GenerationRequest([ChatMessage("user", parts)], SamplingParams(max_tokens=4, temperature=0))
        return list(engine.generate(request))[-1]

    ask()  # the scheduler (and its team) exist before the count
    done, threads, gained = on_a_thread_that_stays(ask)
    assert done.completion_tokens == 4
    assert threads == 1 and gained == 1  # the request thread itself, and no OpenMP worker beside it


def test_a_thread_that_asks_for_cores_gets_them_and_the_others_keep_one():
    def big_op():
        x = torch.randn(2_000_000)
        return float((x * 2).sum())

    _, threads, gained = on_a_thread_that_stays(lambda: (compute_on(2), big_op()))
    assert threads == 2 and gained >= 2  # itself and its team (the control: a team shows in the count)
    _, threads, gained = on_a_thread_that_stays(big_op)
    assert threads == 1 and gained == 1


def _import_warnings(code: str) -> str:
    """What `code` run in a fresh interpreter (the repository's root on its path) warns on stderr."""
    env = {name: value for name, value in os.environ.items() if name not in service.SETTINGS}  # a user's shell
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_program_that_loads_torch_before_the_service_is_told_its_thread_settings_came_too_late():
    warned = _import_warnings("import torch\nimport service")
    assert "torch was imported before the service" in warned
    assert "OMP_WAIT_POLICY" in warned and "GOMP_SPINCOUNT" in warned


def test_the_service_and_the_benchmarks_load_their_settings_before_torch():
    assert "torch was imported" not in _import_warnings("import service\nimport torch")
    # a benchmark module that imports torch at its top (the ceiling's bandwidth probe) comes after them
    assert "torch was imported" not in _import_warnings("import bench.core.ceiling\nimport service")
