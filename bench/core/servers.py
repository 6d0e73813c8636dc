"""Servers on free loopback ports: a Gunicorn instance of the service, a llama.cpp `llama-server`,
either inside a memory-limited cgroup; one Prometheus sample. tests/servers.py and tests/cgroups.py
start the tests' servers with these too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import requests
from tqdm import tqdm

from bench.core import ROOT


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (any loopback address: the loopback cluster's machines)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def stop_process_group(proc: subprocess.Popen, timeout: float = 40) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def _serving(command: list[str], log_path: Path, ready_path: str, timeout: float, poll: float, headers=None, **popen):
    """Yield (base_url, process) of `command` (its port: the `{port}` in it) once `ready_path` answers
    200; the process group is stopped afterwards."""
    port = free_port()
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [part.format(port=port) for part in command], stdout=log, stderr=log, start_new_session=True, **popen
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout, ready_path, headers, poll)
        yield base, proc
    finally:
        stop_process_group(proc)
        log.close()


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
    e.g. the API key a server with API_KEYS wants), asking every `poll` seconds. Unless `env` names
    them, the server's disk tier and job store are its own, new, folder: what an earlier run left
    under CACHE_DIR (cached pictures' keys and values, batch jobs) must not help or feed it."""
    with tempfile.TemporaryDirectory(prefix="server-state-") as own:
        full_env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "PROMETHEUS_MULTIPROC_DIR")}
        full_env.update({"THREADS": "2", "KV_DISK_DIR": f"{own}/kv", "JOB_STORE_URL": f"sqlite:///{own}/jobs.sqlite3"})
        full_env.update(env)
        command = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app", "--bind", "127.0.0.1:{port}"]
        popen = {"cwd": root, "env": full_env, "preexec_fn": preexec_fn}
        with _serving(command, log_path, ready_path, timeout, poll, headers, **popen) as up:
            yield up


# The tokens of context llama-server's 4 slots share: one conversation may take ~8,000 of them (bench_peer
# gives its own server the same CONTEXT_LIMIT).
LLAMA_CONTEXT = 16384


def llama_options(threads: int) -> list[str]:
    """How `llama_server` runs llama-server: `threads` threads, 4 slots sharing one KV cache of
    LLAMA_CONTEXT tokens (`-kvu`, as llama-server sets up when it chooses the slot count itself; without
    it each slot would have a quarter)."""
    return ["-t", str(threads), "-tb", str(threads), "-np", "4", "-c", str(LLAMA_CONTEXT), "-kvu"]


def llama_settings(threads: int) -> str:
    """`llama_options` as a section's settings name them."""
    return " ".join(["llama-server", *llama_options(threads)])


def peer_environment() -> dict[str, str]:
    """This process's environment without the thread settings the service's package gave it (bench imports
    the service first): llama.cpp runs with its own defaults, as its users run it."""
    import service

    return {name: value for name, value in os.environ.items() if name not in service.DEFAULTED}


@contextmanager
def llama_server(llama: Path, text: Path, mmproj: Path, threads: int, log_path: Path, no_repack: bool = False):
    """Yield (base_url, process) of a llama.cpp `llama-server` built in `llama` (build/bin) on the GGUF
    files `text` and `mmproj` (`llama_options`), once its /health answers; `no_repack`: with `-nr` (its
    weights not repacked for this CPU: the default segfaulted on a Xeon with AMX)."""
    command = [
        str(llama / "build" / "bin" / "llama-server"), "-m", str(text), "--mmproj", str(mmproj),
        *llama_options(threads), "--jinja",
        "--host", "127.0.0.1", "--port", "{port}", "--no-webui", *(["-nr"] if no_repack else []),
    ]  # fmt: skip
    with _serving(command, log_path, "/health", 900, 0.05, env=peer_environment()) as up:
        yield up


@contextmanager
def llama_embedding_server(llama: Path, text: Path, threads: int, log_path: Path, no_repack: bool = False):
    """Yield (base_url, process) of `llama-server --embeddings` on the text GGUF `text`: last-token pooling
    (L2-normalised, its default), batches of up to 4096 tokens, 8 slots sharing one cache (a request's
    inputs are computed together)."""
    command = [
        str(llama / "build" / "bin" / "llama-server"), "-m", str(text), "--embeddings", "--pooling", "last",
        "-t", str(threads), "-tb", str(threads), "-c", "16384", "-b", "4096", "-ub", "4096", "-np", "8", "-kvu",
        "--host", "127.0.0.1", "--port", "{port}", "--no-webui", *(["-nr"] if no_repack else []),
    ]  # fmt: skip
    with _serving(command, log_path, "/health", 900, 0.05, env=peer_environment()) as up:
        yield up


def without_repacking_if_it_crashes(run, kind: str, no_repack: set[str]):
    """run(no_repack) for the llama.cpp server `kind`: if it crashes (exits, or drops a connection under
    a request) with its default weight repacking, once more with `-nr` — the default segfaulted on a
    Xeon with AMX — and `kind` stays in `no_repack` for the run (its table says so)."""
    while True:
        try:
            return run(kind in no_repack)
        except (RuntimeError, OSError) as exc:  # requests' errors are OSErrors
            if kind in no_repack:
                raise
            tqdm.write(f"{kind} crashed ({exc}): started again with -nr (no weight repacking)")
            no_repack.add(kind)


def metric(base: str, name: str, labels: str = "", headers: dict[str, str] | None = None) -> float:
    """The value of one Prometheus sample (0 if absent), e.g. metric(b, 'x_total', 'status="200"');
    summed over the samples whose labels include `labels` (`headers`: e.g. an API key)."""
    text = requests.get(base + "/metrics", timeout=10, headers=headers).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or (key.startswith(name + "{") and all(label in key for label in labels.split(",") if label)):
            total += float(value)
    return total


# -- a memory-limited cgroup (v2 or v1, whichever this machine's own cgroup is in) --------------------


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here: it needs root and a writable memory controller."""


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """(folder of this process's memory cgroup, "v1" | "v2"), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2: children get memory only if the parent delegates it
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            delegated = folder / "cgroup.subtree_control"
            if delegated.exists() and "memory" in delegated.read_text().split():
                return folder, "v2"
        elif "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "v1"
    return None


class MemoryCgroup:
    def __init__(self, folder: Path, version: str):
        self.folder, self.version = folder, version

    def enter(self) -> None:
        """Move the calling process in (use as Popen's preexec_fn: it and its children are limited)."""
        (self.folder / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        return int((self.folder / ("memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes")).read_text())

    def oom_kills(self) -> int:
        events = self.folder / ("memory.events" if self.version == "v2" else "memory.oom_control")
        return int(dict(line.split() for line in events.read_text().splitlines()).get("oom_kill", 0))


def _unavailable(reason: str):
    raise CgroupUnavailable(reason)


@contextmanager
def memory_cgroup(limit_bytes: int, unavailable=_unavailable):
    """A new child cgroup of this process's own with `limit_bytes` of memory; removed afterwards.
    Where none can be made, `unavailable(reason)` (raising CgroupUnavailable; the tests skip)."""
    own = _own_memory_cgroup()
    if own is None or os.geteuid() != 0:
        unavailable("needs root and a writable memory cgroup (v1 or v2)")
    parent, version = own
    folder = parent / f"qwen3vl-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as exc:
        unavailable(f"cannot create a memory cgroup under {parent}: {exc}")
    try:
        if version == "v2":
            (folder / "memory.max").write_text(str(limit_bytes))
            (folder / "memory.swap.max").write_text("0")
        else:
            (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield MemoryCgroup(folder, version)
    finally:
        for _ in range(50):
            try:
                folder.rmdir()
                break
            except OSError:  # processes still leaving
                time.sleep(0.1)
