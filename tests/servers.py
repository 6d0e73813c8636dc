"""Start real Gunicorn instances of the service for tests, on free loopback ports, alone or as the
whole deployment (`python -m service.deploy`: Nginx in front of pinned instances)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports."""
    while True:
        first = free_port()
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


def wait_ready(
    base: str,
    proc: subprocess.Popen | None = None,
    timeout: float = 120.0,
    path: str = "/ready",
    headers: dict[str, str] | None = None,
    poll: float = 0.2,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if requests.get(base + path, timeout=2, headers=headers).status_code == 200:
                return
        except requests.RequestException:  # refused, or busy loading the model
            pass
        time.sleep(poll)
    raise TimeoutError(f"{base}{path} not ready after {timeout} s")


@contextmanager
def gunicorn_server(
    env: dict[str, str],
    log_path: Path,
    ready_path: str = "/ready",
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
    preexec_fn=None,
    root: Path = ROOT,
    poll: float = 0.2,
):
    """Yield (base_url, process) of `gunicorn -c gunicorn.conf.py wsgi:app` run in `root` (another
    checkout, for a benchmark's baseline) with `env` added, once `ready_path` answers 200 (`headers`:
    e.g. the API key a server with API_KEYS wants), asking every `poll` seconds."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "PROMETHEUS_MULTIPROC_DIR")}
    full_env.update({"THREADS": "2", **env})
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app", "--bind", f"127.0.0.1:{port}"],
        cwd=root,
        env=full_env,
        stdout=log,
        stderr=log,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout, ready_path, headers, poll)
        yield base, proc
    finally:
        stop_process_group(proc)
        log.close()


def metric(base: str, name: str, labels: str = "") -> float:
    """The value of one Prometheus sample (0 if absent), e.g. metric(b, 'x_total', 'status="200"')."""
    text = requests.get(base + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or (key.startswith(name + "{") and all(label in key for label in labels.split(",") if label)):
            total += float(value)
    return total


@dataclass
class Stack:
    """A running `python -m service.deploy`: the Nginx URL, the instances' ports, the supervisor."""

    url: str
    ports: list[int]
    supervisor: subprocess.Popen

    def backend(self, index: int) -> str:
        return f"http://127.0.0.1:{self.ports[index]}"

    def master(self, index: int) -> psutil.Process:
        """The Gunicorn master of instance `index` now (a restarted instance has a new one)."""
        for child in psutil.Process(self.supervisor.pid).children():
            if f"127.0.0.1:{self.ports[index]}" in child.cmdline():
                return child
        raise LookupError(f"no instance on port {self.ports[index]}")

    def workers(self, index: int) -> list[psutil.Process]:
        return self.master(index).children()


def stop_process_group(proc: subprocess.Popen, timeout: float = 40) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def deployment(env: dict[str, str], log_path: Path, instances: int = 2, timeout: float = 120.0):
    """Yield a Stack of `python -m service.deploy` with INSTANCES=`instances` and `env` added."""
    first_port, nginx_port = free_ports(instances), free_port()
    full_env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "PROMETHEUS_MULTIPROC_DIR")}
    full_env.update(
        {"INSTANCES": str(instances), "PORT": str(first_port), "NGINX_LISTEN": f"127.0.0.1:{nginx_port}", **env}
    )
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.deploy"], cwd=ROOT, env=full_env, stdout=log, stderr=log, start_new_session=True
    )
    stack = Stack(f"http://127.0.0.1:{nginx_port}", list(range(first_port, first_port + instances)), proc)
    try:
        wait_ready(stack.url, proc, timeout, "/health")  # Nginx starts once every instance is ready
        yield stack
    finally:
        stop_process_group(proc)
        log.close()


@contextmanager
def nginx_proxy(addresses: list[str], log_path: Path, **settings):
    """Yield the URL of an Nginx rendered from nginx/ for the instances at `addresses` ("host:port"),
    with `settings` overriding the service settings (e.g. proxy_read_timeout=0.5)."""
    from service.deploy.nginx import nginx_config, start_nginx, write_config
    from service.deploy.planning import Instance
    from service.settings import load_settings

    port = free_port()
    config_settings = load_settings(nginx_listen=f"127.0.0.1:{port}", **settings)
    hosts_ports = [address.rsplit(":", 1) for address in addresses]
    instances = [Instance(i, (), host, int(p)) for i, (host, p) in enumerate(hosts_ports)]
    run_dir = Path(tempfile.mkdtemp(prefix="test-nginx-"))
    run_dir.chmod(0o755)  # workers of a root Nginx run as nobody
    log = open(log_path, "ab")
    config = write_config(nginx_config(config_settings, instances, run_dir, access_log=str(log_path)), run_dir)
    proc = start_nginx(config, run_dir, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:  # any answer will do: its instances may be down on purpose
            try:
                requests.get(url + "/health", timeout=2)
                break
            except requests.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)
        yield url
    finally:
        stop_process_group(proc, timeout=10)
        log.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def openai_client(base: str, api_key: str = "unused", timeout: float = 120, **kwargs):
    """The official client on a server's OpenAI endpoint, as a user makes it (no retries: a test sees
    every error); `kwargs` go to openai.OpenAI (default_headers, ...)."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=timeout, **kwargs)
