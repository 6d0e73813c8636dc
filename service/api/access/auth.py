"""Optional API keys (API_KEYS, API_KEYS_FILE): `Authorization: Bearer <key>` (or `x-api-key: <key>`, as
Anthropic's clients send it), resolved once per request to its tenant (tenants.py), which the request's
context carries (service/api/context.py).

Open without a key: /health and /ready (liveness and readiness probes carry none; they reveal only
whether the server is up and loaded, and the model's name) and the static page (it only asks for
the key).
The key is never logged or echoed, not even in the error message.
"""

from __future__ import annotations

from flask import request

from ...errors import ServiceError
from .tenants import Tenant, Tenants

OPEN_PATHS = ("/health", "/ready")
OPEN_PREFIXES = ("/static/",)


class Unauthorized(ServiceError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


def presented_key() -> str:
    """The request's bearer token, else its x-api-key header ("" if neither)."""
    header = request.headers.get("Authorization")
    if header is None:
        return request.headers.get("X-Api-Key", "").strip()
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def authenticate(tenants: Tenants) -> Tenant | None:
    """The request's tenant (tenants.NO_KEYS without keys; None on an open path with keys); 401 for a
    missing or unknown key."""
    if tenants.required and (
        request.path in OPEN_PATHS or request.path == "/" or request.path.startswith(OPEN_PREFIXES)
    ):
        return None
    tenant = tenants.resolve(presented_key())
    if tenant is None:
        raise Unauthorized(
            "missing or invalid API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
            headers={"WWW-Authenticate": 'Bearer realm="qwen3vl"'},
        )
    return tenant
