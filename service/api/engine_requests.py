"""HTTP request in, engine request out: the JSON body (a clear 400/415), the X-Conversation-Id header,
the request's tenant (its fair share and cache namespace), and the `GenerationRequest` every chat
endpoint builds from them."""

from __future__ import annotations

import json
import re

from flask import g, request

from ..errors import BadRequest, UnsupportedMediaType
from ..generation import GenerationRequest, SamplingParams, TenantShare
from ..limits import RequestLimits
from ..model.prompts import ChatMessage
from .answer_shapes import AnswerShape
from .protocol import CONVERSATION_ID_PATTERN
from .state import state


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


def checked_max_tokens(value: int | None, limits: RequestLimits, param: str) -> int | None:
    """A request's token limit, if within the server's cap (MAX_NEW_TOKENS); else a 400 naming the cap,
    as OpenAI answers a max_tokens beyond the model's."""
    if value is not None and value > limits.max_new_tokens:
        raise BadRequest(
            f"{param} is {value}; this server generates at most {limits.max_new_tokens} tokens (MAX_NEW_TOKENS)",
            param=param,
            code="max_tokens_too_large",
        )
    return value


def generation_request(
    messages: list[ChatMessage],
    params: SamplingParams,
    conversation_id: str | None,
    *,
    remembered: int,
    shape: AnswerShape,
    speculative: bool | None = None,
    enable_thinking: bool = True,
    max_thinking_tokens: int | None = None,
    priority: int = 0,
    request_id: str | None = None,
    received_at: float | None = None,
    tenant: TenantShare = TenantShare(),
    cache_namespace: str = "",
) -> GenerationRequest:
    """The engine's request; its id and arrival are the HTTP request's unless given (a batch line's)."""
    return GenerationRequest(
        messages=messages,
        params=params,
        received_at=g.received_at if received_at is None else received_at,
        request_id=g.request_id if request_id is None else request_id,
        conversation_id=conversation_id,
        remembered=remembered,
        grammar=shape.grammar,
        tools=shape.prompt_tools,
        speculative=speculative is not False,
        enable_thinking=enable_thinking,
        max_thinking_tokens=max_thinking_tokens,
        priority=priority,
        tenant=tenant,
        cache_namespace=cache_namespace,
    )


def tenant_fields(cache_salt: str | None) -> dict:
    """The request's tenant (`g.tenant`) as the engine takes it: its fair share and the namespace of the
    caches it may reuse (its tenant's, narrowed by `cache_salt`)."""
    tenants = state().tenants
    return {"tenant": tenants.share(g.tenant), "cache_namespace": tenants.cache_namespace(g.tenant, cache_salt)}


def conversation_header() -> str | None:
    """The X-Conversation-Id header (what Nginx routes a conversation by), checked like the body field."""
    header = request.headers.get("X-Conversation-Id")
    if header is not None and not re.fullmatch(CONVERSATION_ID_PATTERN, header):
        raise BadRequest(
            "X-Conversation-Id must be 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'",
            param="X-Conversation-Id",
        )
    return header
