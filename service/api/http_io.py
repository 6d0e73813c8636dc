"""The Flask side every route shares: the request's context (built by app.py), its JSON body (a clear
400/415) and X-Conversation-Id header, a streamed answer, and the one way a ServiceError becomes a
JSON response."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from flask import Response, g, jsonify, request

from ..errors import BadRequest, ServiceError, UnsupportedMediaType
from ..generation import Generation, GenerationRequest
from .context import RequestContext
from .error_shapes import error_body
from .schemas import CONVERSATION_ID_PATTERN
from .streaming import EventStream, StreamEncoder


def request_context() -> RequestContext:
    """This request's context (app.py builds it once the API key is checked)."""
    return g.context


def json_body() -> dict:
    """The body as a JSON object; 415 for another content type, 400 for malformed JSON."""
    if not request.is_json:
        raise UnsupportedMediaType(f"expected Content-Type: application/json, got {request.mimetype or 'none'!r}")
    try:
        body = json.loads(request.get_data(cache=False))
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be an object", code="invalid_json")
    return body


def conversation_header() -> str | None:
    """The X-Conversation-Id header (what Nginx routes a conversation by), checked like the body field."""
    header = request.headers.get("X-Conversation-Id")
    if header is not None and not re.fullmatch(CONVERSATION_ID_PATTERN, header):
        raise BadRequest(
            "X-Conversation-Id must be 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'",
            param="X-Conversation-Id",
        )
    return header


def stream_response(
    generation: Generation,
    gen_request: GenerationRequest,
    endpoint: str,
    encoder: StreamEncoder,
    spend: Callable[[int], None] | None,
    mimetype: str,
) -> Response:
    """The generation's events streamed as `encoder` writes them while the client is there (an
    EventStream; `spend` gets its tokens), never cached, never buffered by Nginx."""
    stream = EventStream(generation, gen_request, request.environ, endpoint, encoder, spend)
    return Response(stream, mimetype=mimetype, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def error_response(exc: ServiceError) -> Response:
    """The error as the API of the request's path shapes it (error_shapes.py), with its status and headers."""
    response = jsonify(error_body(exc, request.path))
    response.status_code = exc.status
    for name, value in exc.headers.items():
        response.headers[name] = value
    return response
