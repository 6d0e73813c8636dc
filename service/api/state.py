"""What the routes share: the app's state (settings, the engine once loaded, the native endpoint's
chat histories) and the one way a ServiceError becomes a JSON response."""

from __future__ import annotations

import logging
import threading

from flask import current_app, jsonify, request
from pydantic import ValidationError

from .. import startup
from ..engine.engine import Engine
from ..errors import ServiceError, Unavailable
from ..settings import Settings
from .error_shapes import error_body
from .rate_limits import TenantRates
from .tenants import Tenants

log = logging.getLogger("service.api")


class AppState:
    """What the routes share: settings, the engine once loaded, the tenants of the API keys and their
    rates, the native endpoint's chat histories (`histories`) and the Responses API's stored responses
    (`responses`; the engine holds their keys and values in its conversation cache)."""

    def __init__(self, settings: Settings):
        from .histories import HistoryStore
        from .response_files import ResponseFiles
        from .stored_responses import ResponseStore

        self.settings = settings
        self.tenants = Tenants(settings)
        self.rates = TenantRates()
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.histories = HistoryStore(
            settings.conversation_history_max,
            settings.conversation_history_ttl,
            settings.conversation_history_max_bytes,
        )
        on_disk = settings.cache_enabled and settings.kv_disk_mb != 0  # where the KV disk tier is on
        folder = settings.cache_dir / "responses"
        files = ResponseFiles(folder, settings.responses_max, settings.responses_ttl) if on_disk else None
        self.responses = ResponseStore(
            settings.responses_max, settings.responses_ttl, settings.responses_max_bytes, files
        )
        self.loaded = threading.Event()
        self._jobs = None
        self._jobs_lock = threading.Lock()
        self.batch_runner = None
        self.on_serving: list = []  # called with this state in the serving process once warm (app.py)

    @property
    def jobs(self):
        """The job store of the Batch API (service/jobs/), opened on first use."""
        with self._jobs_lock:
            if self._jobs is None:
                from ..jobs import open_store

                s = self.settings
                self._jobs = open_store(s.job_store_url, s.cache_dir, s.batch_max_attempts)
            return self._jobs

    def load(self, threads: int | None = None, before_fork: bool = False) -> None:
        from ..model import prefault
        from ..model.loading import load_model

        try:
            self.engine = Engine(load_model(self.settings, threads), self.settings)
            startup.mark("engine")
            startup.log_timeline("model ready")
            if before_fork:  # the worker warms up itself (gunicorn.conf.py): read ahead only
                prefault.read_ahead(self.engine.loaded.path)
            else:
                self.serve_here()
        except Exception as exc:  # reported by /ready and every request, not a dead worker
            log.exception("model failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.loaded.set()

    def serve_here(self) -> None:
        """In the process that serves, once the model is ready: its weights warmed up
        (service/model/loading.warm_up), then the `on_serving` hooks (the batch runner)."""
        from ..model.loading import warm_up

        warm_up(self.engine.loaded)
        for hook in self.on_serving:
            hook(self)

    def wake_batch_runner(self) -> None:
        if self.batch_runner is not None:
            self.batch_runner.wake()

    def require_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.load_error:
            raise Unavailable(f"the model failed to load: {self.load_error}", code="model_load_failed")
        raise Unavailable(
            "the model is still loading; retry shortly", code="model_loading", headers={"Retry-After": "5"}
        )


def state() -> AppState:
    return current_app.extensions["qwen3vl"]


def validation_error(exc: ValidationError) -> ServiceError:
    """A request body's first schema violation as a 400 naming the field."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return ServiceError(
        f"{where}: {first['msg']}" if where else first["msg"], param=where or None, code="invalid_field"
    )


def error_response(exc: ServiceError):
    """The error as the API of the request's path shapes it (error_shapes.py), with its status and headers."""
    response = jsonify(error_body(exc, request.path))
    response.status_code = exc.status
    for name, value in exc.headers.items():
        response.headers[name] = value
    return response
