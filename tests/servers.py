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
import threading
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
    "openai_client", "redis_server", "ROOT", "Stack", "TcpRelay",
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


class TcpRelay:
    """A loopback TCP relay to `target_port`: a client connected through it can be cut off (its
    connections closed, new ones refused) and let back (`mend`) while others reach the server directly —
    one machine losing its Redis while the rest keep it. Stop it with `cut`."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.mend()

    def mend(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread accepting on it
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread reading it
                except OSError:
                    pass
                sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass


def openai_client(base: str, api_key: str = "unused", timeout: float = 120, **kwargs):
    """The official client on a server's OpenAI endpoint, as a user makes it (no retries: a test sees
    every error); `kwargs` go to openai.OpenAI (default_headers, ...)."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=timeout, **kwargs)
