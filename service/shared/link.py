"""The shared store's connection: a Redis client that fails fast (a second to connect, two to answer),
and whose failure sets the store aside for REOPEN_SECONDS — each call meanwhile raises SharedUnavailable
at once, so a Redis that is down costs requests nothing but the shared state (every instance serves
from its own). The gauge qwen3vl_shared_state_usable and /ready (`problem`) say which it is."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from .. import metrics

log = logging.getLogger("service.shared")

REOPEN_SECONDS = 5.0
FAILURES = (redis.RedisError, OSError)
T = TypeVar("T")


class SharedUnavailable(Exception):
    """The shared store cannot be used now: the caller serves from this instance's own state."""


class SharedLink:
    """The Redis at `url`, used through `run`. `where`: the store in a log line (never a password)."""

    def __init__(self, url: str):
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=1)
        self.where = f"redis {url.rpartition('@')[2]}"
        self._problem: str | None = None
        self._retry_at = 0.0
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self.on_back: list[Callable[[], None]] = []  # run (in a thread of their own) when Redis is back
        metrics.SHARED_STATE_USABLE.set(1)

    def run(self, call: Callable[[redis.Redis], T]) -> T:
        """call(client), or SharedUnavailable: while set aside after a failure, or when this call fails."""
        with self._lock:
            if self._problem is not None and time.monotonic() < self._retry_at:
                raise SharedUnavailable(self._problem)
        try:
            result = call(self.client)
        except FAILURES as exc:
            self._fail(exc)
            raise SharedUnavailable(self._problem) from None
        self._succeeded()
        return result

    def usable(self) -> bool:
        """Whether a call would be tried now (not inside the pause after a failure)."""
        with self._lock:
            return self._problem is None or time.monotonic() >= self._retry_at

    def problem(self) -> str | None:
        """Why the store cannot be used, or None. Redis is asked (a ping) when it has not been for
        REOPEN_SECONDS, so /ready sees an outage without traffic."""
        if time.monotonic() - self._checked_at >= REOPEN_SECONDS:
            try:
                self.run(lambda r: r.ping())
            except SharedUnavailable:
                pass
        return self._problem

    def _succeeded(self) -> None:
        with self._lock:
            self._checked_at = time.monotonic()
            back = self._problem is not None
            if back:
                log.warning("shared store %s usable again: conversations are shared again", self.where)
                self._problem = None
            metrics.SHARED_STATE_USABLE.set(1)
        if back:
            for call in self.on_back:
                threading.Thread(target=call, name="shared-state-back", daemon=True).start()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._checked_at = time.monotonic()
            self._retry_at = time.monotonic() + REOPEN_SECONDS
            if self._problem is None:
                log.error(
                    "shared store %s unusable (%r): each instance serves conversations from its own state; "
                    "tried again every %.0f s",
                    self.where,
                    exc,
                    REOPEN_SECONDS,
                )
            unreachable = isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError))
            self._problem = "Redis is unreachable" if unreachable else f"Redis answered {type(exc).__name__}"
            metrics.SHARED_STATE_USABLE.set(0)
