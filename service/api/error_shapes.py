"""One error type (service/errors.py), each API's error body: OpenAI's `{"error": {message, type,
param, code}}` everywhere but Anthropic's Messages API, which gets its own `{"type": "error", "error":
{type, message}}` — the status is the same, the type named as Anthropic names it. A schema violation
is a ServiceError too (`validation_error`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pydantic import ValidationError

from ..errors import ServiceError

ANTHROPIC_PATHS = ("/v1/messages",)  # and below it: /v1/messages/count_tokens
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(exc: ServiceError) -> dict:
    """Anthropic's error body (its `type` by status; a 5xx other than 503 is an api_error)."""
    kind = _ANTHROPIC_TYPES.get(exc.status) or ("api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_body(exc: ServiceError, path: str) -> dict:
    """The error body in the shape of the API at `path`."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error(exc)
    return exc.to_dict()


def validation_error(exc: ValidationError) -> ServiceError:
    """A request body's first schema violation as a 400 naming the field."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return ServiceError(
        f"{where}: {first['msg']}" if where else first["msg"], param=where or None, code="invalid_field"
    )


@contextmanager
def params_renamed(rename: Callable[[str], str]) -> Iterator[None]:
    """A ServiceError raised inside names its field as `rename` says: the engine and the answer shapes
    every API shares name Chat Completions' fields (messages, response_format), which an API of other
    names translates for its own clients."""
    try:
        yield
    except ServiceError as exc:
        if exc.param is not None:
            exc.param = rename(exc.param)
        raise
