"""Optional API keys (API_KEYS): `Authorization: Bearer <key>`, compared in constant time.

Open without a key: /health and /ready (liveness and readiness probes carry none; they reveal only
whether the server is up and loaded, and the model's name) and the static page (it only asks for
the key).
The key is never logged or echoed, not even in the error message.
"""

from __future__ import annotations

import hmac

from flask import request

from ..errors import ServiceError

OPEN_PATHS = ("/health", "/ready")
OPEN_PREFIXES = ("/static/",)


class Unauthorized(ServiceError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


def presented_key() -> str:
    """The request's bearer token ("" if none)."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_is_valid(candidate: str, keys: list[str]) -> bool:
    """Constant time in the candidate's content: every key is compared, no early exit."""
    presented = candidate.encode()
    valid = False
    for key in keys:
        valid |= hmac.compare_digest(presented, key.encode())
    return valid


def check_api_key(keys: list[str]) -> None:
    """Raise 401 unless the request may pass (no keys configured, an open path, or a valid key)."""
    if not keys or request.path in OPEN_PATHS or request.path == "/" or request.path.startswith(OPEN_PREFIXES):
        return
    if not key_is_valid(presented_key(), keys):
        raise Unauthorized(
            "missing or invalid API key: send Authorization: Bearer <key>",
            headers={"WWW-Authenticate": 'Bearer realm="qwen3vl"'},
        )
