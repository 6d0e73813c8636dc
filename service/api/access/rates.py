"""A tenant's requests and tokens a minute (`rpm=` and `tpm=` in API_KEYS_FILE), on this instance: a
request beyond either gets 429 at once, with Retry-After the seconds until the last minute's count
falls below the limit. Requests count when admitted here; tokens (prompt and answer) when a request
ends, so a request is refused once the tokens of those that ended within the minute reach the limit."""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

from ... import metrics
from ...errors import RateLimited
from .tenants import Tenant

WINDOW_SECONDS = 60.0


class _Window:
    """(time, amount) events of the last WINDOW_SECONDS and their sum."""

    def __init__(self):
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - WINDOW_SECONDS:
            self.total -= self.events.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        self.events.append((now, amount))
        self.total += amount

    def seconds_until_below(self, limit: int, now: float) -> int:
        """Seconds until the sum falls below `limit` as events age out."""
        total = self.total
        for at, amount in self.events:
            total -= amount
            if total < limit:
                return max(1, math.ceil(at + WINDOW_SECONDS - now))
        return 1


class TenantRates:
    """Each tenant's last minute of requests and tokens, by tenant name (kept across key reloads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: dict[str, _Window] = defaultdict(_Window)
        self._tokens: dict[str, _Window] = defaultdict(_Window)

    def admit(self, tenant: Tenant) -> Callable[[int], None] | None:
        """Count a request of `tenant`, or raise 429 naming the limit it is over; what counts its tokens
        once it has ended (None: no tokens limit) — one call, so no route counts requests but not tokens."""
        if tenant.rpm is None and tenant.tpm is None:
            return None
        now = time.monotonic()
        with self._lock:
            requests, tokens = self._requests[tenant.name], self._tokens[tenant.name]
            requests.expire(now)
            tokens.expire(now)
            if tenant.rpm is not None and requests.total >= tenant.rpm:
                self._refuse(tenant, "rpm", f"{requests.total} requests", tenant.rpm, requests, now)
            if tenant.tpm is not None and tokens.total >= tenant.tpm:
                self._refuse(tenant, "tpm", f"{tokens.total} tokens", tenant.tpm, tokens, now)
            requests.add(now, 1)
        if tenant.tpm is None:
            return None

        def spend(tokens: int) -> None:
            with self._lock:
                self._tokens[tenant.name].add(time.monotonic(), tokens)

        return spend

    @staticmethod
    def _refuse(tenant: Tenant, limit: str, used: str, value: int, window: _Window, now: float):
        metrics.TENANT_REFUSED.labels(metrics.tenant_label(tenant.name), limit).inc()
        raise RateLimited(
            f"tenant {tenant.name!r} used {used} in the last minute, its limit ({limit}={value}); retry later",
            code=f"tenant_{limit}_exceeded",
            headers={"Retry-After": str(window.seconds_until_below(value, now))},
        )
