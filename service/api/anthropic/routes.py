"""POST /v1/messages — Anthropic's Messages API, streaming (its typed SSE events) or not — and
POST /v1/messages/count_tokens. Stateless like Chat Completions: the KV cache finds the shared prefix."""

from __future__ import annotations

from flask import Blueprint, jsonify

from ..http_io import json_body, request_context, stream_response
from ..state import state
from ..streaming import collect
from .protocol import CountTokensOut, CountTokensRequest, MessagesRequest
from .serving import AnthropicEvents, message_body, messages_request, new_message_id

anthropic_api = Blueprint("anthropic", __name__)
ENDPOINT = "/v1/messages"


@anthropic_api.post(ENDPOINT)
def messages():
    app_state, context = state(), request_context()
    spend = app_state.rates.admit(context.tenant)
    body = MessagesRequest.model_validate(json_body())
    engine = app_state.require_engine()
    app_state.note_affinity(context, "messages")
    gen_request, shape = messages_request(body, engine.limits, context)
    generation = engine.submit(gen_request)
    message_id, model = new_message_id(), engine.info.name
    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT, spend)
        return jsonify(message_body(message_id, model, done, shape))
    events = AnthropicEvents(message_id, model, generation.prompt_tokens, shape.tool_call_parser())
    return stream_response(generation, gen_request, ENDPOINT, events, spend, "text/event-stream")


@anthropic_api.post(ENDPOINT + "/count_tokens")
def count_tokens():
    app_state, context = state(), request_context()
    app_state.rates.admit(context.tenant)  # a request against the tenant's rpm; it generates no tokens
    body = CountTokensRequest.model_validate(json_body())
    engine = app_state.require_engine()
    gen_request, _ = messages_request(body, engine.limits, context)
    return jsonify(CountTokensOut(input_tokens=engine.count_tokens(gen_request)).model_dump())
