"""CORS for pages of other origins that call the API from a browser (CORS_ORIGINS; off by default):
a preflight from an allowed origin is answered before the API key is checked (a browser sends no
key with it), and every answer to that origin says it may read it."""

from __future__ import annotations

from flask import Response, request

MAX_AGE_SECONDS = 600
EXPOSED = "X-Request-Id, Retry-After"  # what a page's code may read of an answer, beyond the basic headers
METHODS = "GET, POST, DELETE, OPTIONS"


def _allowed(origins: list[str]) -> str | None:
    """The value for Access-Control-Allow-Origin, or None when this request's origin may not read."""
    origin = request.headers.get("Origin")
    if not origins or origin is None:
        return None
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


def preflight(origins: list[str]) -> Response | None:
    """The answer to a browser's preflight (OPTIONS with Access-Control-Request-Method) from an allowed
    origin: the methods, and the headers it asked for (SDKs send headers of their own), for a while."""
    allowed = _allowed(origins)
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers or allowed is None:
        return None
    response = Response(status=204)
    response.headers["Access-Control-Allow-Methods"] = METHODS
    asked = request.headers.get("Access-Control-Request-Headers")
    if asked:
        response.headers["Access-Control-Allow-Headers"] = asked
    response.headers["Access-Control-Max-Age"] = str(MAX_AGE_SECONDS)
    return response


def allow_origin(response: Response, origins: list[str]) -> Response:
    """`response` readable by the request's origin, if CORS_ORIGINS allows it."""
    allowed = _allowed(origins)
    if allowed is not None:
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = EXPOSED
    if origins and "*" not in origins:  # the answer depends on the origin, allowed or not: caches must know
        response.headers.add("Vary", "Origin")
    return response
