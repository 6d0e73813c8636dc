"""Admission to the model: up to `slots` requests hold a place in the engine's batch at once; the
rest wait, most urgent first, in a bounded queue (the `qwen3vl_queue_depth` gauge, by class).

Urgency is a request's `priority` (lower first, default 0: vLLM's field) minus one for every `aging`
seconds since it reached the server: a request of priority 10 outranks new priority-0 ones after
10 × `aging` seconds, so no class waits forever. Equal urgency: first come, first served.

Preemption: a request that finds every place held, one of them by a request of a less urgent priority (a
higher value) that is still less urgent once aged, takes the place of the least urgent such holder (the
latest to arrive among equals) at once. The scheduler pauses that holder at its next step, its whole
state kept (service/engine/scheduler.py), and it waits here like any waiter — ahead of later arrivals of
its urgency — for a place to resume in. Paused requests are admitted already: they do not count against
the queue's bound and never time out (REQUEST_DEADLINE still ends them).

Fair share between tenants (a request's `TenantShare`, service/api/access/tenants.py): while another
tenant's request waits, a tenant's requests hold at most its `slots` places — the waiters of tenants
under their share go first, and a request of a tenant under its share takes the place of a holder of a
tenant over its own at once (the same pause). A tenant's requests wait in at most its `queue` places:
beyond, 429. Across tenants, a more urgent `priority` pauses another tenant's holder only for a tenant
under its share: a client's own priority never takes another tenant's share. Requests without a share
(no keys, one tenant, batch lines) are ordered by priority alone, as above.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import metrics
from ..errors import QueueFull, Unavailable
from ..generation import TenantShare, priority_class


@dataclass(eq=False)
class Ticket:
    """One request's hold on a place in the batch (or its wait for one)."""

    priority: int
    arrived: float  # perf_counter time the request reached the server
    order: int  # admission order: the tie-break between equal urgencies
    aging: float  # seconds of waiting that make it one priority more urgent
    tenant: TenantShare = TenantShare()
    holds: bool = False  # it has a place in the batch
    preempted: int = 0  # times it gave its place to a more urgent request
    paused_seconds: float = 0.0  # time spent paused, all pauses together
    _paused_at: float | None = None
    _turn: threading.Event = field(default_factory=threading.Event)

    @property
    def paused(self) -> bool:
        """It gave its place away and waits to get one back (the scheduler leaves it alone meanwhile)."""
        return self._paused_at is not None

    @property
    def label(self) -> str:
        return priority_class(self.priority)

    def urgency(self, now: float) -> float:
        """Its priority, one lower for every `aging` seconds since it arrived: lower goes first."""
        return self.priority - (now - self.arrived) / self.aging

    def rank(self, now: float) -> tuple[float, int]:
        """Its turn among others: the most urgent first, then the first to arrive."""
        return self.urgency(now), self.order


class Admission:
    """`acquire()` … `release(ticket)` holds one of `slots` places; see the module docstring.

    A request beyond the queue is refused at once (429, Retry-After); one that waits longer than
    `timeout` seconds gets a 503. `on_change` is called (outside the lock) when a holder is paused
    or a paused one may resume, so the scheduler looks at once.
    """

    def __init__(
        self,
        queue_size: int,
        timeout: float,
        retry_after: int = 2,
        slots: int = 1,
        aging: float = 30.0,
        on_change: Callable[[], None] | None = None,
    ):
        self.slots = slots
        self.queue_size = queue_size
        self.timeout = timeout
        self.retry_after = retry_after
        self.aging = aging
        self.on_change = on_change or (lambda: None)
        self._lock = threading.Lock()
        self._order = itertools.count()
        self._holders: list[Ticket] = []
        self._waiting: list[Ticket] = []  # new arrivals (blocked in acquire) and paused holders

    @property
    def busy(self) -> bool:
        return bool(self._holders or self._waiting)

    def has_room(self) -> bool:
        """A place is free and nobody waits for one: spare capacity (what batch lines use)."""
        with self._lock:
            return len(self._holders) < self.slots and not self._waiting

    def _blocked(self, tenant: str | None = None) -> int:
        """Waiters not paused (of `tenant`'s bounded requests only, if named)."""
        return sum(1 for t in self._waiting if not t.paused and (tenant is None or _bounded_of(t, tenant)))

    def _held(self, tenant: str) -> int:
        return sum(1 for t in self._holders if _bounded_of(t, tenant))

    def _under_share(self, ticket: Ticket) -> bool:
        return ticket.tenant.slots is not None and self._held(ticket.tenant.name) < ticket.tenant.slots

    def _over_share(self, ticket: Ticket) -> bool:
        return ticket.tenant.slots is not None and self._held(ticket.tenant.name) > ticket.tenant.slots

    def _fair_rank(self, ticket: Ticket, now: float) -> tuple[bool, float, int]:
        """Its turn: tenants under their share first, then the most urgent, then the first to arrive."""
        at_share = ticket.tenant.slots is not None and not self._under_share(ticket)
        return (at_share, *ticket.rank(now))

    def _first_waiter(self, now: float) -> Ticket | None:
        return min(self._waiting, key=lambda t: self._fair_rank(t, now), default=None)

    def acquire(
        self,
        priority: int = 0,
        arrived: float | None = None,
        timeout: float | None = None,
        tenant: TenantShare = TenantShare(),
    ) -> Ticket:
        """Wait for a place (taking a less urgent holder's, or an over-share tenant's, at once); pair
        with release(ticket)."""
        now = time.perf_counter()
        ticket = Ticket(priority, now if arrived is None else arrived, next(self._order), self.aging, tenant)
        timeout = self.timeout if timeout is None else timeout
        preempted = False
        with self._lock:
            first = self._first_waiter(now)
            ahead = first is not None and self._fair_rank(first, now) < self._fair_rank(ticket, now)
            if len(self._holders) < self.slots and not ahead:
                return self._hold(ticket)
            victim = None if ahead else self._victim(ticket, now)
            if victim is not None:
                self._pause(victim, now)
                preempted = True
                self._hold(ticket)
            elif tenant.queue is not None and self._blocked(tenant.name) >= tenant.queue:
                metrics.TENANT_REFUSED.labels(metrics.tenant_label(tenant.name), "queue").inc()
                raise QueueFull(
                    f"tenant {tenant.name!r} has {self._blocked(tenant.name)} requests waiting, its limit "
                    f"(queue={tenant.queue}: API_KEYS_FILE, or TENANT_MAX_QUEUE); retry shortly",
                    code="tenant_queue_full",
                    headers={"Retry-After": str(self.retry_after)},
                )
            elif self._blocked() >= self.queue_size:
                raise QueueFull(
                    f"the server is busy: {self._blocked()} requests are already waiting; retry shortly",
                    headers={"Retry-After": str(self.retry_after)},
                )
            else:
                self._waiting.append(ticket)
        if preempted:
            metrics.PREEMPTIONS.labels(victim.label).inc()
            self.on_change()
            return ticket
        return self._wait(ticket, timeout)

    def _victim(self, ticket: Ticket, now: float) -> Ticket | None:
        """The holder whose place `ticket` takes: for a tenant under its share, the least urgent holder of
        another tenant over its own; else the least urgent holder, if less urgent than it and its place
        may go to `ticket` (module docstring)."""
        if self._under_share(ticket):
            over = [t for t in self._holders if t.tenant.name != ticket.tenant.name and self._over_share(t)]
            if over:
                return max(over, key=lambda t: t.rank(now))
        # Only a less urgent priority: requests of one priority that arrived moments apart never pause
        # each other (aging orders waiters; it does not make a running request give way).
        candidates = [t for t in self._holders if t.priority > ticket.priority and self._may_pause_for(t, ticket)]
        least = max(candidates, key=lambda t: t.rank(now), default=None)
        if least is not None and least.urgency(now) > ticket.urgency(now):
            return least
        return None

    def _may_pause_for(self, holder: Ticket, ticket: Ticket) -> bool:
        """Whether priority may give `holder`'s place to `ticket`: never another tenant's share to a
        tenant at its own."""
        return holder.tenant.slots is None or holder.tenant.name == ticket.tenant.name or self._under_share(ticket)

    def _hold(self, ticket: Ticket) -> Ticket:
        ticket.holds = True
        self._holders.append(ticket)
        metrics.TENANT_PLACES.labels(metrics.tenant_label(ticket.tenant.name)).inc()
        return ticket

    def _pause(self, ticket: Ticket, now: float) -> None:
        self._holders.remove(ticket)
        metrics.TENANT_PLACES.labels(metrics.tenant_label(ticket.tenant.name)).dec()
        ticket.holds, ticket._paused_at = False, now
        ticket.preempted += 1
        self._waiting.append(ticket)

    def _wait(self, ticket: Ticket, timeout: float) -> Ticket:
        label, tenant = ticket.label, metrics.tenant_label(ticket.tenant.name)
        metrics.QUEUE_DEPTH.labels(label).inc()
        metrics.TENANT_QUEUE_DEPTH.labels(tenant).inc()
        try:
            if ticket._turn.wait(timeout):
                return ticket  # release() handed us a place
            with self._lock:
                if ticket.holds:  # handed over just as we timed out
                    return ticket
                self._waiting.remove(ticket)
        finally:
            metrics.QUEUE_DEPTH.labels(label).dec()
            metrics.TENANT_QUEUE_DEPTH.labels(tenant).dec()
        raise Unavailable(
            f"timed out after {timeout:.0f} s waiting for the model; retry later",
            code="queue_timeout",
            headers={"Retry-After": str(self.retry_after)},
        )

    def release(self, ticket: Ticket) -> None:
        """The request ended: its place (or its wait to resume) goes to the most urgent waiter."""
        resumed = False
        with self._lock:
            if ticket in self._holders:
                self._holders.remove(ticket)
                metrics.TENANT_PLACES.labels(metrics.tenant_label(ticket.tenant.name)).dec()
            elif ticket in self._waiting:  # ended while paused
                self._waiting.remove(ticket)
            ticket.holds = False
            now = time.perf_counter()
            while len(self._holders) < self.slots and self._waiting:
                waiter = self._first_waiter(now)
                self._waiting.remove(waiter)
                self._hold(waiter)
                if waiter.paused:
                    waiter.paused_seconds += now - waiter._paused_at
                    waiter._paused_at = None
                    resumed = True
                else:
                    waiter._turn.set()
        if resumed:
            self.on_change()


def _bounded_of(ticket: Ticket, tenant: str) -> bool:
    """A request of `tenant` that counts towards its share (one without bounds never does)."""
    return ticket.tenant.name == tenant and ticket.tenant.slots is not None
