"""Start real Gunicorn instances of the service for tests, on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen | None = None, timeout: float = 120.0, path: str = "/ready") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if requests.get(base + path, timeout=2).status_code == 200:
                return
        except requests.RequestException:  # refused, or busy loading the model
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base}{path} not ready after {timeout} s")


@contextmanager
def gunicorn_server(env: dict[str, str], log_path: Path, ready_path: str = "/ready", timeout: float = 120.0):
    """Yield (base_url, process) of `gunicorn -c gunicorn.conf.py wsgi:app` with `env` added."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "PROMETHEUS_MULTIPROC_DIR")}
    full_env.update({"THREADS": "2", **env})
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app",
                             "--bind", f"127.0.0.1:{port}"], cwd=ROOT, env=full_env, stdout=log, stderr=log,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout, ready_path)
        yield base, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def metric(base: str, name: str, labels: str = "") -> float:
    """The value of one Prometheus sample (0 if absent), e.g. metric(b, 'x_total', 'status="200"')."""
    text = requests.get(base + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or (key.startswith(name + "{") and all(l in key for l in labels.split(",") if l)):
            total += float(value)
    return total
