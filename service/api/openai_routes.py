"""POST /v1/chat/completions — OpenAI Chat Completions, streaming (SSE) or not. Stateless: the
client sends the whole history; the KV cache finds the shared prefix by itself."""

from __future__ import annotations

import json
import time

from flask import Blueprint, Response, g, jsonify, request

from ..errors import BadRequest, ServiceError
from ..generation import Completion, TextDelta
from . import protocol
from .inputs import to_chat_messages
from .requests import conversation_header, generation_request, json_body
from .serving import EventStream, collect
from .state import state

openai_api = Blueprint("openai", __name__)
ENDPOINT = "/v1/chat/completions"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@openai_api.post(ENDPOINT)
def chat_completions():
    body = protocol.ChatCompletionRequest.model_validate(json_body())
    if body.tools:
        raise BadRequest("tools are not supported by this server", param="tools", code="unsupported_parameter")
    engine = state().require_engine()
    messages = to_chat_messages(body.messages, engine.limits)
    gen_request = generation_request(
        messages, body.sampling(body.max_completion_tokens or body.max_tokens), conversation_header() or body.user
    )
    generation = engine.submit(gen_request)
    model = engine.info.name
    if not body.stream:
        return jsonify(protocol.chat_completion(g.request_id, model, collect(generation, gen_request, ENDPOINT)))

    request_id, created = g.request_id, int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def encode(event):
        if event is None:
            yield _sse(protocol.chat_chunk(request_id, model, created, {"role": "assistant", "content": ""}))
        elif isinstance(event, TextDelta):
            yield _sse(protocol.chat_chunk(request_id, model, created, {"content": event.text}))
        elif isinstance(event, Completion):
            yield _sse(protocol.chat_chunk(request_id, model, created, {}, protocol.openai_finish_reason(event)))
            if include_usage:
                yield _sse(protocol.chat_chunk(request_id, model, created, None, usage_=protocol.usage(event)))
            yield b"data: [DONE]\n\n"
        elif isinstance(event, ServiceError):
            yield _sse(event.to_dict())
            yield b"data: [DONE]\n\n"

    stream = EventStream(generation, gen_request, request.environ, ENDPOINT, encode)
    return Response(
        stream, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
