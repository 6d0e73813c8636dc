"""Who sent a request and when: its context, built once — per HTTP request by the app (app.py, from
its headers and API key) and per batch line by the batch runner (batches/runner.py) — and passed to
every translation of a body into the engine's request, which so reads no framework globals and serves a
batch line exactly as it serves an HTTP request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from ..generation import TenantShare
from .access.tenants import Tenant, Tenants


@dataclass(frozen=True)
class RequestContext:
    """A request's id, arrival (time.perf_counter), tenant and place in the engine's fair share, the
    caches' namespace its tenant may reuse (`cache_namespace`), and the affinity key the proxy routed it
    by (service/shared/affinity.py; None when it came another way), which the ids it makes begin with."""

    request_id: str
    received_at: float
    tenant: Tenant
    share: TenantShare
    namespace_of: Callable[[str | None], str] = field(repr=False, compare=False)  # cache_salt → namespace
    affinity_key: str | None = None

    @property
    def owner(self) -> str:
        """Whose what the request stores is (histories, responses, batches): its tenant's owner hash."""
        return self.tenant.owner

    def cache_namespace(self, cache_salt: str | None) -> str:
        """The caches' namespace of the request: its tenant's, narrowed by the body's `cache_salt`."""
        return self.namespace_of(cache_salt)


def context_for(
    tenants: Tenants,
    tenant: Tenant,
    request_id: str,
    received_at: float,
    fair_share: bool = True,
    affinity_key: str | None = None,
) -> RequestContext:
    """`tenant`'s request in the engine's fair share between tenants (Tenants.share), or, without
    `fair_share` (a batch line), ordered by its priority alone."""
    share = tenants.share(tenant) if fair_share else TenantShare(tenant.name)
    namespace_of = partial(tenants.cache_namespace, tenant)
    return RequestContext(request_id, received_at, tenant, share, namespace_of, affinity_key)
