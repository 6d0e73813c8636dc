"""POST /v1/chat/completions — OpenAI Chat Completions, streaming (SSE) or not. Stateless: the
client sends the whole history; the KV cache finds the shared prefix by itself."""

from __future__ import annotations

import json
import time

from flask import Blueprint, Response, g, jsonify, request

from ..errors import ServiceError
from ..generation import Completion, TextDelta
from ..tools import ToolCall, ToolCallDelta, ToolCallParser
from . import protocol
from .inputs import to_chat_messages
from .outputs import answer_shape
from .requests import conversation_header, generation_request, json_body
from .serving import EventStream, collect
from .state import state

openai_api = Blueprint("openai", __name__)
ENDPOINT = "/v1/chat/completions"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _split(text: str) -> tuple[str, list[ToolCall]]:
    """An answer's content and the tool calls in it."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.flush()
    return "".join(p for p in pieces if isinstance(p, str)), parser.calls


@openai_api.post(ENDPOINT)
def chat_completions():
    body = protocol.ChatCompletionRequest.model_validate(json_body())
    shape = answer_shape(body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls is not False)
    engine = state().require_engine()
    messages = to_chat_messages(body.messages, engine.limits)
    params = body.sampling(body.max_completion_tokens or body.max_tokens)
    gen_request = generation_request(messages, params, conversation_header() or body.user, shape=shape)
    generation = engine.submit(gen_request)
    model = engine.info.name

    def logprobs(records) -> list[dict] | None:
        return None if records is None else protocol.logprob_entries(records, engine.token_text)

    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT)
        content, calls = _split(done.text) if shape.parse_tool_calls else (done.text, [])
        content = content if content or not calls else None
        return jsonify(protocol.chat_completion(g.request_id, model, done, content, calls, logprobs(done.logprobs)))

    request_id, created = g.request_id, int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    parser = ToolCallParser() if shape.parse_tool_calls else None
    pending: list = []  # logprob records of text the tool-call parser still holds

    def chunk(delta: dict | None, **kwargs) -> bytes:
        return _sse(protocol.chat_chunk(request_id, model, created, delta, **kwargs))

    def pieces(event: TextDelta | Completion):
        if isinstance(event, Completion):
            out = parser.flush() if parser else []
        else:
            out = parser.feed(event.text) if parser else [event.text]
            pending.extend(event.logprobs)
        for piece in out:
            if isinstance(piece, ToolCallDelta):
                yield chunk({"tool_calls": [protocol.tool_call_delta(piece)]})
            else:
                records = list(pending) if params.logprobs is not None else None
                pending.clear()
                yield chunk({"content": piece}, logprobs=logprobs(records))

    def encode(event):
        if event is None:
            yield chunk({"role": "assistant", "content": ""})
        elif isinstance(event, TextDelta):
            yield from pieces(event)
        elif isinstance(event, Completion):
            yield from pieces(event)
            yield chunk({}, finish_reason=protocol.openai_finish_reason(event, parser.calls if parser else None))
            if include_usage:
                yield chunk(None, usage_=protocol.usage(event))
            yield b"data: [DONE]\n\n"
        elif isinstance(event, ServiceError):
            yield _sse(event.to_dict())
            yield b"data: [DONE]\n\n"

    stream = EventStream(generation, gen_request, request.environ, ENDPOINT, encode)
    return Response(
        stream, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
