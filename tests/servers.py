"""Start real Gunicorn instances of the service for tests, on free loopback ports, alone or as the
whole deployment (`python -m service.deploy`: Nginx in front of pinned instances). One instance,
readiness and metrics: bench/core/servers.py's, which the benchmarks use too."""

from __future__ import annotations

import os
import shutil
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

from bench.core import ROOT
from bench.core.cluster import Redis
from bench.core.servers import free_port, gunicorn_server, metric, stop_process_group, wait_ready

__all__ = [
    "deployment", "free_port", "gunicorn_server", "metric", "nginx_proxy",
    "openai_client", "redis_server", "ROOT", "Stack",
]  # fmt: skip


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


@contextmanager
def redis_server(log_path: Path, folder: Path | None = None, port: int | None = None):
    """Yield the redis:// URL of Debian's redis-server on `port` (default: a free loopback port), its
    data in `folder` (default: a new one, removed afterwards) written as it changes (appendonly: a
    restart of the server keeps every job), stopped afterwards (bench/core/cluster.py's `Redis`)."""
    own = folder is None
    server = Redis(port or free_port(), Path(folder or tempfile.mkdtemp(prefix="test-redis-")), log_path)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()
        if own:
            shutil.rmtree(server.folder, ignore_errors=True)


def openai_client(base: str, api_key: str = "unused", timeout: float = 120, **kwargs):
    """The official client on a server's OpenAI endpoint, as a user makes it (no retries: a test sees
    every error); `kwargs` go to openai.OpenAI (default_headers, ...)."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=timeout, **kwargs)
