"""Run the deployment: pinned Gunicorn instances, Nginx in front, restarts, a graceful stop."""

from __future__ import annotations

import ctypes
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..settings import Settings
from .nginx import ROOT, nginx_config, start_nginx, write_config
from .planning import Instance, instance_budget_mb

log = logging.getLogger("service.deploy")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each child before exec: if the supervisor itself is killed, the child gets SIGTERM."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def get_status(url: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a GET; (0, {}) if nothing answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url), timeout=5) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, http.client.HTTPException):  # nothing listening yet; or, the port being free, a
        return 0, {}  # TCP self-connect echoing our own request (BadStatusLine) while an instance loads
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {}


def client_url(listen: str) -> str:
    """Where a local client reaches an Nginx `listen` address ("8080", "0.0.0.0:8080", "[::]:8080")."""
    host, _, port = listen.rpartition(":")
    if host in ("", "*", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "[::]":
        host = "[::1]"
    return f"http://{host}:{port}"


@dataclass
class _Slot:
    """An instance and the process serving it now."""

    instance: Instance
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    backoff: float = 1.0


class Deployment:
    """Nginx in front of one Gunicorn instance per planned core set; `run()` until SIGTERM/SIGINT."""

    def __init__(self, settings: Settings, instances: list[Instance], access_log: str = "/dev/stdout"):
        self.settings = settings
        self.slots = [_Slot(i) for i in instances]
        self.access_log = access_log
        self.nginx: subprocess.Popen | None = None
        self.run_dir = Path(tempfile.mkdtemp(prefix="qwen3vl-deploy-"))
        self.run_dir.chmod(0o755)  # Nginx workers started by root run as nobody and need their temp dirs
        self._stop = threading.Event()
        self._signals = 0

    def run(self) -> int:
        """Start everything, print how to try it, keep it running; the exit code when it stops."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._reload_keys)
        try:
            if self.settings.proxy_read_timeout <= self.settings.queue_timeout:
                log.warning(
                    "PROXY_READ_TIMEOUT (%s s) <= QUEUE_TIMEOUT (%s s): Nginx will cut requests that wait in the queue",
                    self.settings.proxy_read_timeout,
                    self.settings.queue_timeout,
                )
            for slot in self.slots:
                self._start_instance(slot)
            # Nginx starts once every model is loaded: before, it would only hand out 503s.
            if not self._wait_ready():
                return 0 if self._stop.is_set() else 1
            config = nginx_config(
                self.settings,
                [s.instance for s in self.slots],
                self.run_dir,
                self.access_log,
                self.settings.graceful_timeout,
            )
            self.nginx = start_nginx(write_config(config, self.run_dir), self.run_dir, preexec_fn=_die_with_parent)
            if not self._wait_nginx():
                return 0 if self._stop.is_set() else 1
            self._announce()
            return self._supervise()
        finally:
            self._shutdown()

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s: stopping gracefully (again to stop at once)", signal.Signals(signum).name)
        self._stop.set()

    def _reload_keys(self, signum, frame) -> None:
        """SIGHUP: every instance re-reads API_KEYS_FILE (gunicorn.conf.py), nothing restarts."""
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(signal.SIGHUP)

    def _start_instance(self, slot: _Slot) -> None:
        inst, threads = slot.instance, str(len(slot.instance.cores))
        metrics_dir = self.run_dir / f"metrics-{inst.index}"
        shutil.rmtree(metrics_dir, ignore_errors=True)  # a restarted instance starts its counters afresh
        metrics_dir.mkdir()
        env = {
            **os.environ,
            "THREADS": threads,
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        }
        env["INSTANCE_NAME"] = f"{self.settings.instance_name}-{inst.index}"  # its own, in the affinity ledger
        if self.settings.max_memory_mb is None:  # each instance its share of the machine's memory
            env["MAX_MEMORY_MB"] = str(instance_budget_mb(len(self.slots)))
        command = [
            "taskset",
            "-c",
            inst.cpu_list,
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "gunicorn.conf.py",
            "wsgi:app",
            "--bind",
            f"{inst.host}:{inst.port}",
            "--control-socket",
            str(self.run_dir / f"gunicorn-{inst.index}.ctl"),
        ]
        slot.process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        slot.started_at, slot.restart_at = time.monotonic(), None
        log.info(
            "instance %d: pid %d on cores %s, port %d, %s threads",
            inst.index,
            slot.process.pid,
            inst.cpu_list,
            inst.port,
            threads,
        )

    def _wait_ready(self) -> bool:
        """Wait until every instance has loaded its model; False if one died or failed to load, or a stop came."""
        waiting = list(self.slots)
        deadline = time.monotonic() + self.settings.start_timeout
        while waiting:
            if self._stop.wait(0.25):
                return False
            if time.monotonic() > deadline:
                log.error(
                    "instance(s) %s not ready after START_TIMEOUT=%g s: see their log lines above",
                    ", ".join(str(s.instance.index) for s in waiting),
                    self.settings.start_timeout,
                )
                return False
            for slot in list(waiting):
                if slot.process.poll() is not None:
                    log.error(
                        "instance %d exited with code %d while starting", slot.instance.index, slot.process.returncode
                    )
                    return False
                status, body = get_status(f"http://{slot.instance.address}/ready")
                if status == 200:
                    log.info("instance %d ready", slot.instance.index)
                    waiting.remove(slot)
                elif body.get("error", {}).get("code") == "model_load_failed":
                    log.error("instance %d: %s", slot.instance.index, body["error"]["message"])
                    return False
        return True

    def _wait_nginx(self) -> bool:
        """Wait until Nginx answers; False if it exited (a bad listen address, a port in use) or a stop came."""
        url = client_url(self.settings.nginx_listen) + "/health"
        while get_status(url)[0] != 200:
            if self.nginx.poll() is not None:
                log.error("nginx exited with code %d", self.nginx.returncode)
                return False
            if self._stop.wait(0.1):
                return False
        return True

    def _announce(self) -> None:
        url = client_url(self.settings.nginx_listen)
        _, ready = get_status(f"http://{self.slots[0].instance.address}/ready")
        auth = " -H 'Authorization: Bearer <one of API_KEYS>'" if self.settings.keys_required else ""
        cores = " | ".join(s.instance.cpu_list for s in self.slots)
        print(
            f"\nServing {ready.get('model', 'the model')} on {url}: {len(self.slots)} instance(s), cores {cores}."
            + (" The embedded model is RANDOM: its answers are noise." if ready.get("random_model") else "")
            + f"\nTry:\n  curl -N {url}/v1/chat{auth} -H 'X-Conversation-Id: demo-1' "
            f"-F image=@{ROOT / 'tests' / 'data' / 'demo.png'} -F prompt='What is in this picture?'\n",
            flush=True,
        )

    def _supervise(self) -> int:
        """Restart instances that die (with a growing delay); stop when asked or when Nginx dies."""
        while not self._stop.wait(0.5):
            if self.nginx.poll() is not None:
                log.error("nginx exited with code %d; stopping", self.nginx.returncode)
                return 1
            now = time.monotonic()
            for slot in self.slots:
                if slot.process.poll() is None:
                    continue
                if slot.restart_at is None:
                    # Quick crashes back off up to 30 s; an instance that ran a while restarts at once.
                    slot.backoff = min(slot.backoff * 2, 30.0) if now - slot.started_at < 60 else 1.0
                    slot.restart_at = now + slot.backoff
                    log.warning(
                        "instance %d exited with code %d; restarting in %.0f s (Nginx sends its "
                        "conversations elsewhere meanwhile)",
                        slot.instance.index,
                        slot.process.returncode,
                        slot.backoff,
                    )
                elif now >= slot.restart_at:
                    self._start_instance(slot)
        return 0

    def _shutdown(self) -> None:
        """Graceful: Nginx finishes open streams, Gunicorn lets requests end; then anything left is killed."""
        nginx = [self.nginx] if self.nginx is not None else []
        children = nginx + [s.process for s in self.slots if s.process is not None]
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGQUIT if child is self.nginx else signal.SIGTERM)
        deadline = time.monotonic() + self.settings.graceful_timeout + 10
        while any(c.poll() is None for c in children) and time.monotonic() < deadline and self._signals < 2:
            time.sleep(0.1)
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped")
