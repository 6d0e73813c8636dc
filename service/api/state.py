"""What the routes share: the app's state — the settings, the engine once loaded, and each API's own
state, which its package builds and the app factory (app.py) hands in."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flask import Flask, current_app

from .. import startup
from ..engine.engine import Engine
from ..errors import Unavailable
from ..settings import Settings
from ..shared.affinity import AffinityLedger
from ..shared.link import SharedLink
from .access.rates import TenantRates
from .access.tenants import Tenants
from .batches.serving import Batches
from .context import RequestContext
from .conversations.store import ConversationStore
from .native.histories import HistoryStore
from .responses.store import ResponseStore

log = logging.getLogger("service.api")
EXTENSION = "qwen3vl"  # the app's key for its AppState in Flask's app.extensions


class AppState:
    """The settings, the engine once loaded (`load`, `require_engine`), and the APIs' state: the tenants
    of the API keys and their rates (access/), the native endpoint's chat histories (native/histories.py),
    the Responses API's stored responses (responses/store.py; the engine holds their keys and values in
    its conversation cache), OpenAI's Conversations (conversations/store.py), the Batch API's job store
    and runner (batches/serving.py); and, where many machines share state (service/shared/), the link to
    the shared store and the affinity ledger."""

    def __init__(
        self,
        settings: Settings,
        *,
        tenants: Tenants,
        rates: TenantRates,
        histories: HistoryStore,
        stored_responses: ResponseStore,
        conversations: ConversationStore,
        batches: Batches,
        shared: SharedLink | None = None,
    ):
        self.settings = settings
        self.tenants, self.rates = tenants, rates
        self.histories, self.stored_responses, self.batches = histories, stored_responses, batches
        self.conversations = conversations
        self.shared = shared
        self.affinity = (
            AffinityLedger(shared, settings.instance_name, settings.conversation_history_ttl) if shared else None
        )
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.loaded = threading.Event()
        self.on_serving: list[Callable[[Engine], None]] = []  # called in the serving process once warm

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
            hook(self.engine)

    def note_affinity(self, context: RequestContext, api: str) -> None:
        """This instance serves a request of `api` the proxy routed by an affinity key (counted as a miss
        where the key's last request ran on another instance: shared/affinity.py)."""
        if self.affinity is not None:
            self.affinity.note(context.affinity_key, api)

    def require_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.load_error:
            raise Unavailable(f"the model failed to load: {self.load_error}", code="model_load_failed")
        raise Unavailable(
            "the model is still loading; retry shortly", code="model_loading", headers={"Retry-After": "5"}
        )


def app_state(app: Flask) -> AppState:
    """The state of an app made by create_app (what gunicorn.conf.py's hooks reach)."""
    return app.extensions[EXTENSION]


def state() -> AppState:
    """The state of the app serving this request."""
    return app_state(current_app)
