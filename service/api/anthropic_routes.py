"""POST /v1/messages — Anthropic's Messages API, streaming (its typed SSE events) or not — and
POST /v1/messages/count_tokens. Stateless like Chat Completions: the KV cache finds the shared prefix."""

from __future__ import annotations

from flask import Blueprint, Response, g, jsonify, request

from ..answer.tools import ToolCallParser
from . import anthropic_protocol as ap
from .anthropic_serving import AnthropicEvents, message_body, messages_request, new_message_id
from .engine_requests import json_body
from .serving import EventStream, collect
from .state import state

anthropic_api = Blueprint("anthropic", __name__)
ENDPOINT = "/v1/messages"


@anthropic_api.post(ENDPOINT)
def messages():
    app_state = state()
    spend = app_state.rates.admit(g.tenant)
    body = ap.MessagesRequest.model_validate(json_body())
    engine = app_state.require_engine()
    gen_request, shape = messages_request(body, engine.limits)
    generation = engine.submit(gen_request)
    message_id, model = new_message_id(), engine.info.name
    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT, spend)
        return jsonify(message_body(message_id, model, done, shape))
    parser = ToolCallParser(shape.max_calls) if shape.parse_tool_calls else None
    events = AnthropicEvents(message_id, model, generation.prompt_tokens, parser)
    stream = EventStream(generation, gen_request, request.environ, ENDPOINT, events, spend)
    return Response(
        stream, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


@anthropic_api.post(ENDPOINT + "/count_tokens")
def count_tokens():
    body = ap.CountTokensRequest.model_validate(json_body())
    engine = state().require_engine()
    gen_request, _ = messages_request(body, engine.limits)
    return jsonify(ap.CountTokensOut(input_tokens=engine.count_tokens(gen_request)).model_dump())
