"""The Flask app factory: each API's state built by its package and handed to the app's state, each
request's id and context (the one place an HTTP request's context is built), the one error handler,
and every API's blueprint."""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
import uuid

from flask import Flask, current_app, g, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from .. import metrics
from ..errors import InternalError, ServiceError
from ..settings import Settings
from ..shared.affinity import checked_key
from ..shared.pictures import Pictures
from ..shared.setup import shared_link
from .access.auth import authenticate
from .access.cors import allow_origin, preflight
from .access.rates import TenantRates
from .access.tenants import Tenants
from .anthropic.routes import anthropic_api
from .batches.routes import batch_api
from .batches.serving import Batches
from .chat.routes import chat_api
from .context import context_for
from .conversations.routes import conversations_api
from .conversations.store import ConversationStore
from .error_shapes import validation_error
from .http_io import error_response
from .native.histories import HistoryStore
from .native.routes import native_api
from .ops.routes import ops_api
from .ops.web import web_api
from .responses.routes import responses_api
from .responses.store import ResponseStore
from .search.routes import search_api
from .state import EXTENSION, AppState

log = logging.getLogger("service.api")
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,96}$")


def _http_error(exc: HTTPException) -> ServiceError:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "too_large", 415: "unsupported_media_type"}
    messages = {413: f"request body is larger than the limit of {current_app.config['MAX_CONTENT_LENGTH']} bytes"}
    err = ServiceError(
        messages.get(exc.code, exc.description or exc.name), status=exc.code, code=codes.get(exc.code, "http_error")
    )
    if exc.code == 405 and exc.valid_methods:
        err.headers["Allow"] = ", ".join(exc.valid_methods)
    return err


def create_app(settings: Settings, load: str = "background") -> Flask:
    """A new app with its own state. `load`: "background" (a thread: /health answers at once), "now",
    or "before_fork" (now, on one torch thread: Gunicorn's master then forks the worker, which
    shares the weights copy-on-write and sets THREADS when it starts generating)."""
    if load not in ("background", "now", "before_fork"):
        raise ValueError(f"unknown load mode {load!r}")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask("service", static_folder=None)  # ops/web.py serves the page's files
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["MAX_FORM_MEMORY_SIZE"] = settings.max_body_bytes
    app.json.sort_keys = False
    app.json.ensure_ascii = False
    tenants = Tenants(settings)
    batches = Batches(settings, tenants)
    shared, pictures = shared_link(settings), Pictures()
    app_state = AppState(
        settings,
        tenants=tenants,
        rates=TenantRates(),
        histories=HistoryStore.from_settings(settings, shared, pictures),
        stored_responses=ResponseStore.from_settings(settings, shared, pictures),
        conversations=ConversationStore.from_settings(settings, shared, pictures),
        batches=batches,
        shared=shared,
    )
    app_state.on_serving.append(batches.start_runner)
    app.extensions[EXTENSION] = app_state
    cors_origins = settings.cors_origin_list
    blueprints = (chat_api, responses_api, conversations_api, anthropic_api, native_api, search_api, batch_api)
    for blueprint in (*blueprints, ops_api, web_api):
        app.register_blueprint(blueprint)

    @app.before_request
    def _begin():
        """The request's id, then (a CORS preflight answered first, keyless) its tenant and context."""
        incoming = request.headers.get("X-Request-Id", "")
        g.request_id = incoming if _SANE_REQUEST_ID.match(incoming) else "req-" + uuid.uuid4().hex[:24]
        received_at = time.perf_counter()
        answer = preflight(cors_origins)
        if answer is not None:
            return answer
        tenant = authenticate(tenants)
        if tenant is not None:  # None: an open path (/health, the page) when keys are required
            affinity = checked_key(request.headers.get("X-Affinity-Key"))
            g.context = context_for(tenants, tenant, g.request_id, received_at, affinity_key=affinity)

    @app.after_request
    def _tag(response):
        response.headers["X-Request-Id"] = g.get("request_id", "")
        endpoint = request.url_rule.rule if request.url_rule else "unmatched"
        metrics.REQUESTS.labels(endpoint, str(response.status_code)).inc()
        context = g.get("context")
        if context is not None and context.tenant.name:
            label = metrics.tenant_label(context.tenant.name)
            metrics.TENANT_REQUESTS.labels(label, str(response.status_code)).inc()
        return allow_origin(response, cors_origins)

    @app.errorhandler(ServiceError)
    def _service_error(exc: ServiceError):
        if exc.status >= 500 and exc.status != 503:
            log.error("%s %s", g.get("request_id"), exc.message)
        return error_response(exc)

    @app.errorhandler(ValidationError)
    def _invalid(exc: ValidationError):
        return error_response(validation_error(exc))

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        return error_response(_http_error(exc))

    @app.errorhandler(Exception)
    def _bug(exc: Exception):
        log.exception("%s unhandled error", g.get("request_id"))
        return error_response(InternalError(g.get("request_id")))

    if load == "background":
        threading.Thread(target=app_state.load, name="model-loader", daemon=True).start()
    else:
        app_state.load(threads=1 if load == "before_fork" else None, before_fork=load == "before_fork")
    if load == "before_fork":
        gc.freeze()  # the loaded objects are never collected: the worker's GC leaves their pages shared
    return app
