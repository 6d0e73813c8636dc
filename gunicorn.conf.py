"""Gunicorn settings for one service instance. A flag on the command line (e.g. --bind) wins.

Cores: one instance = one Gunicorn master with ONE worker process that owns the model and uses
THREADS torch threads (default: every CPU the process may use — pin instances with taskset and
each gets its own cores). Its `threads` are HTTP threads (gthread, needed for streaming): up to
MAX_BATCH_SIZE stream generations (decoded together by the engine's scheduler thread), up to
QUEUE_SIZE wait for the model, the rest answer /health, /ready and /metrics and refuse extra
requests with 429 at once. To use more cores, run more instances
(entrypoint / Nginx), not more workers: a second worker would load a second model.
"""

import os
import shutil
import tempfile

from service.settings import load_settings

_settings = load_settings()

bind = _settings.bind or f"{_settings.host}:{_settings.port}"
workers = 1  # the worker owns the model: a second one would load a second copy (run more instances)
worker_class = "gthread"
threads = _settings.max_batch_size + _settings.queue_size + 3
# gthread heartbeats from its main loop, so `timeout` never kills a long generation; it only
# restarts a worker whose main loop is stuck.
timeout = 120
graceful_timeout = _settings.graceful_timeout
keepalive = 5
# PRELOAD: the master loads the model (wsgi.py) and forks the worker from it, so a worker that dies
# is replaced in about a second, sharing the weights copy-on-write. A child forked after OpenMP
# ran in its parent hangs in its first parallel region (seen with torch here), so the master must
# never start an OpenMP thread team: every thread defaults to one OpenMP thread (set before torch
# is imported) and loading runs on one torch thread; the engine's scheduler sets THREADS for itself.
preload_app = _settings.preload_in_master
if preload_app:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
accesslog = "-" if _settings.access_log else None
errorlog = "-"
loglevel = _settings.log_level
forwarded_allow_ips = "127.0.0.1"

# Prometheus multiprocess mode: every worker writes its metrics to files in this directory.
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="qwen3vl-metrics-")
    _own_metrics_dir = True
else:
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
    _own_metrics_dir = False


def child_exit(server, worker):
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def when_ready(server):
    """SIGHUP re-reads the API keys in the worker (post_worker_init) instead of Gunicorn's reload, which
    would replace the worker and with it the conversations and caches in its memory."""
    import signal

    server.handle_hup = lambda: server.kill_workers(signal.SIGHUP)


def post_worker_init(worker):
    """On SIGTERM, let in-flight streams run, then cancel them cleanly before the grace period ends. On
    SIGHUP, re-read API_KEYS_FILE: requests in flight keep their tenant, the next ones use the new keys."""
    import signal
    import threading

    from service.api import app_state as state_of

    original = worker.handle_exit
    app_state = state_of(worker.wsgi)
    engine = app_state.engine  # None unless the master preloaded it
    app_state.tenants.reload()  # the file may have changed since the master read it
    signal.signal(signal.SIGHUP, lambda sig, frame: app_state.tenants.reload())

    def handle_exit(sig, frame):
        engine = app_state.engine
        if engine is not None:
            timer = threading.Timer(max(1.0, graceful_timeout * 0.8), engine.cancel_all)
            timer.daemon = True  # an idle worker exits at once instead of waiting for the timer
            timer.start()
        original(sig, frame)

    worker.handle_exit = handle_exit
    signal.signal(signal.SIGTERM, handle_exit)

    from service import startup

    startup.mark("worker")
    startup.log_timeline("serving")
    if engine is not None:  # preloaded: this process's own page-table entries, packed Linears, batch runner
        app_state.serve_here()


def on_exit(server):
    if _own_metrics_dir:
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
