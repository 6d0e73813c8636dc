"""POST /v1/chat/completions — OpenAI Chat Completions, streaming (SSE) or not. Stateless: the
client sends the whole history; the KV cache finds the shared prefix by itself."""

from __future__ import annotations

from flask import Blueprint, jsonify

from ..http_io import conversation_header, json_body, request_context, stream_response
from ..state import state
from ..streaming import collect
from .protocol import ChatCompletionRequest
from .serving import OpenAIChunks, chat_request, completion_body

chat_api = Blueprint("openai", __name__)
ENDPOINT = "/v1/chat/completions"


@chat_api.post(ENDPOINT)
def chat_completions():
    app_state, context = state(), request_context()
    spend = app_state.rates.admit(context.tenant)
    body = ChatCompletionRequest.model_validate(json_body())
    engine = app_state.require_engine()
    app_state.note_affinity(context, "chat")
    gen_request, shape = chat_request(body, engine.limits, context, conversation_header() or body.user)
    generation = engine.submit(gen_request)

    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT, spend)
        return jsonify(completion_body(context.request_id, engine.info, done, shape))

    chunks = OpenAIChunks(
        context.request_id,
        engine.info,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=gen_request.params.logprobs is not None,
        parser=shape.tool_call_parser(),
    )
    return stream_response(generation, gen_request, ENDPOINT, chunks, spend, "text/event-stream")
