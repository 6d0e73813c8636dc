"""The job store as the Batch API uses it: opened on first use and looked at before every call. A
store that cannot be used — its SQLite file garbage, a folder, unreadable, replaced or removed
underneath; Redis unreachable — makes each call raise StoreUnavailable (503 job_store_unavailable,
naming the store), sets qwen3vl_job_store_usable to 0 and logs why once, while the rest of the
service serves; it is opened again, as a restart would open it, at most every REOPEN_SECONDS (so a
fixed file or a Redis back brings the Batch API back with no restart)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

from .. import metrics
from ..errors import StoreUnavailable
from .store import JobStore

log = logging.getLogger("service.jobs")

REOPEN_SECONDS = 5.0
# The contract's calls, each passed to the store in force (the guard's own methods aside).
CALLS = frozenset(name for name, value in vars(JobStore).items() if callable(value) and not name.startswith("_"))


class GuardedStore:
    """A JobStore opened by `opener` when first needed; `failures`: the exceptions of a store that
    cannot be used (each put in words a client may read by `explain`); `label`: the store in those
    words ("SQLite file jobs.sqlite3", "Redis"), `where`: for the log (a path, never a password)."""

    def __init__(
        self,
        label: str,
        where: str,
        opener: Callable[[], JobStore],
        failures: tuple[type[BaseException], ...],
        explain: Callable[[BaseException], str],
    ):
        self.label, self.where = label, where
        self._opener, self._failures, self._explain = opener, failures, explain
        self._store: JobStore | None = None
        self._problem: str | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        """Why the store cannot be used, as last seen (None: usable, or not needed yet); a replaced
        SQLite file is noticed here at once. Never opens the store nor waits on it (/ready asks)."""
        with self._lock:
            if self._store is not None and (found := self._store.problem()) is not None:
                self._fail(self._store, found, found)
            return self._problem

    def check(self) -> None:
        """Raise StoreUnavailable unless the store can be used now (opening it if need be)."""
        self._current()

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()

    def __getattr__(self, call: str):
        if call not in CALLS:
            raise AttributeError(call)

        def guarded(*args, **kwargs):
            store = self._current()
            try:
                result = getattr(store, call)(*args, **kwargs)
            except self._failures as exc:
                raise self._failed(store, exc) from None
            return self._chunks(store, result) if isinstance(result, Iterator) else result

        return guarded

    def _chunks(self, store: JobStore, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """A file's content read lazily, its failures the guard's like any call's."""
        try:
            yield from chunks
        except self._failures as exc:
            raise self._failed(store, exc) from None

    def _current(self) -> JobStore:
        with self._lock:
            if self._store is not None:
                found = self._store.problem()
                if found is None:
                    return self._store
                self._fail(self._store, found, found)
            if time.monotonic() < self._retry_at:
                raise self._unavailable()
            try:
                self._store = self._opener()
            except self._failures as exc:
                self._fail(None, self._explain(exc), repr(exc))
                raise self._unavailable() from None
            if self._problem is not None:
                log.warning("job store %s usable again: the Batch API answers", self.where)
            self._problem = None
            metrics.JOB_STORE_USABLE.set(1)
            return self._store

    def _failed(self, store: JobStore, exc: BaseException) -> StoreUnavailable:
        with self._lock:
            if store is self._store:  # not a call that began before the store was opened again
                self._fail(store, self._explain(exc), repr(exc))
            return self._unavailable()

    def _fail(self, store: JobStore | None, problem: str, detail: str) -> None:
        """The store in force (if any) given up, why logged once, the next opening in REOPEN_SECONDS."""
        if store is not None:
            store.close()
            self._store = None
        if self._problem is None:
            log.error(
                "job store %s unusable (%s): the Batch API answers 503, the rest serves; opened again every %.0f s",
                self.where,
                detail,
                REOPEN_SECONDS,
            )
        self._problem = problem
        self._retry_at = time.monotonic() + REOPEN_SECONDS
        metrics.JOB_STORE_USABLE.set(0)

    def _unavailable(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"the job store ({self.label}) is unusable: {self._problem}; the Batch API is off until it is fixed, "
            "the rest of the service serves",
            headers={"Retry-After": str(math.ceil(REOPEN_SECONDS))},
        )
