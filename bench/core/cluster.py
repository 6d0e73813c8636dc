"""Many machines on one: a loopback cluster of Gunicorn instances on 127.0.0.2, 127.0.0.3, … (separate
processes, each its own CACHE_DIR and port, as separate machines have), one Redis (appendonly, so a
restart keeps everything) and the front proxy rendered by service.deploy (Nginx with affinity.js, or
round-robin for comparison). tests/test_cluster.py and bench_cluster start it; machines are killed
(SIGKILL) and started again, Redis stopped and started again on its folder, as a test needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.core import ROOT
from bench.core.servers import free_port, stop_process_group, wait_ready


@dataclass
class Machine:
    """One instance standing for a machine: its name, address, CACHE_DIR and process (None: down)."""

    name: str
    host: str
    port: int
    cache_dir: Path
    log: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app", "--bind", self.address]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=log, start_new_session=True
            )

    def wait_ready(self, timeout: float = 180) -> None:
        wait_ready(self.url, self.process, timeout, poll=0.1)

    def kill(self) -> None:
        """SIGKILL, master and worker at once: the machine is gone, its sockets closed by the kernel."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process, timeout=20)
        self.process = None


@dataclass
class Redis:
    """redis-server on a loopback port, its data in `folder`, written as it changes (appendonly)."""

    port: int
    folder: Path
    log: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is missing: `make redis` (apt-get install redis-server)")
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        command += ["--save", "", "--appendonly", "yes", "--protected-mode", "yes"]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: see {self.log}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: Redis writes what it holds and exits (its appendonly file keeps every change anyway)."""
        if self.process is not None:
            stop_process_group(self.process, timeout=10)
        self.process = None


@dataclass
class Cluster:
    machines: list[Machine]
    redis: Redis | None
    proxy_url: str
    access_log: Path
    run_dir: Path
    _proxy: subprocess.Popen | None = field(default=None, repr=False)

    def machine_at(self, address: str) -> Machine:
        return next(m for m in self.machines if m.address == address)

    def served_by(self, request_id: str) -> Machine:
        """The machine the proxy sent the request with this X-Request-Id to (its access log); LookupError
        if the log has no line for it — never None, which two lookups would find "the same machine"."""
        pattern = re.compile(rf"id={re.escape(request_id)} .*upstream=(.+?) upstream_status=")
        for _ in range(50):  # Nginx writes the line when the request ends
            for line in reversed(self.access_log.read_text().splitlines()):
                found = pattern.search(line)
                if found:
                    return self.machine_at(found.group(1).split(",")[-1].strip())
            time.sleep(0.02)
        raise LookupError(f"the proxy's access log has no line for request {request_id}")

    def restart(self, machine: Machine) -> None:
        machine.kill()
        machine.start()
        machine.wait_ready()


def _machine_cache(template: Path | None, folder: Path) -> None:
    """A machine's own CACHE_DIR, with the kernels of its CPU kind already built (a machine image of
    the service carries them: the cluster's start is not spent compiling them three times)."""
    folder.mkdir(parents=True)
    if template is None:
        return
    if (template / "kernels").is_dir():
        shutil.copytree(template / "kernels", folder / "kernels")
    if (template / "int8-kernels.json").is_file():
        shutil.copy(template / "int8-kernels.json", folder / "int8-kernels.json")


@contextmanager
def loopback_cluster(
    log_dir: Path,
    model_path: Path,
    env: dict[str, str] | None = None,
    machines: int = 3,
    shared: bool = True,
    balance: str = "affinity",
    cache_template: Path | None = None,
    timeout: float = 300,
):
    """Yield a Cluster of `machines` instances serving `model_path` on 127.0.0.2… with `env` added,
    one Redis (their job store and, `shared`, their shared state) and the proxy (`balance`: "affinity"
    or "round-robin"). `cache_template`: a CACHE_DIR whose built kernels each machine gets a copy of."""
    from service.deploy.nginx import nginx_config, start_nginx, write_config
    from service.settings import load_settings

    log_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="cluster-"))
    run_dir.chmod(0o755)  # workers of a root Nginx run as nobody
    redis = Redis(free_port("127.0.0.1"), run_dir / "redis", log_dir / "redis.log")
    redis.folder.mkdir()
    base_env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "PROMETHEUS_MULTIPROC_DIR")}
    base_env.update(
        {"MODEL_PATH": str(model_path), "THREADS": "1", "JOB_STORE_URL": redis.url, "SHARED_STATE": str(shared)}
    )
    base_env.update(env or {})
    nodes = []
    for i in range(machines):
        host = f"127.0.0.{i + 2}"
        cache = run_dir / f"machine-{i + 1}"
        _machine_cache(cache_template, cache)
        machine_env = {**base_env, "CACHE_DIR": str(cache), "INSTANCE_NAME": f"m{i + 1}"}
        nodes.append(Machine(f"m{i + 1}", host, free_port(host), cache, log_dir / f"m{i + 1}.log", machine_env))
    proxy = None
    try:
        redis.start()
        for node in nodes:
            node.start()
        waits = [threading.Thread(target=node.wait_ready, args=(timeout,)) for node in nodes]
        for wait in waits:
            wait.start()
        for wait in waits:
            wait.join()
        for node in nodes:
            node.wait_ready(1)  # raises if one did not come up
        port = free_port("127.0.0.1")
        access_log = log_dir / "proxy-access.log"
        settings = load_settings(nginx_listen=f"127.0.0.1:{port}", proxy_read_timeout=60)
        config = nginx_config(settings, [n.address for n in nodes], run_dir, str(access_log), balance=balance)
        with open(log_dir / "proxy.log", "ab") as log:
            proxy = start_nginx(write_config(config, run_dir), run_dir, stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                requests.get(url + "/health", timeout=2)
                break
            except requests.ConnectionError:
                if proxy.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the proxy did not start: see {log_dir / 'proxy.log'}") from None
                time.sleep(0.05)
        yield Cluster(nodes, redis, url, access_log, run_dir, proxy)
    finally:
        if proxy is not None:
            stop_process_group(proxy, timeout=10)
        for node in nodes:
            node.stop()
        redis.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
