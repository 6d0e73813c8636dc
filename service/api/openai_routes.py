"""POST /v1/chat/completions — OpenAI Chat Completions, streaming (SSE) or not. Stateless: the
client sends the whole history; the KV cache finds the shared prefix by itself."""

from __future__ import annotations

import json
import time

from flask import Blueprint, Response, g, jsonify, request

from ..answer.tools import ToolCallDelta, ToolCallParser, split_tool_calls
from ..errors import ServiceError
from ..generation import Completion, TextDelta
from . import protocol, responses
from .answer_shapes import answer_shape
from .engine_requests import conversation_header, generation_request, json_body
from .inputs import to_chat_messages
from .serving import EventStream, collect
from .state import state

openai_api = Blueprint("openai", __name__)
ENDPOINT = "/v1/chat/completions"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@openai_api.post(ENDPOINT)
def chat_completions():
    body = protocol.ChatCompletionRequest.model_validate(json_body())
    shape = answer_shape(body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls is not False)
    engine = state().require_engine()
    messages = to_chat_messages(body.messages, engine.limits)
    params = body.sampling(body.max_completion_tokens or body.max_tokens)
    gen_request = generation_request(
        messages, params, conversation_header() or body.user, remembered=0, shape=shape, speculative=body.speculative
    )
    generation = engine.submit(gen_request)
    model = engine.info.name

    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT)
        content, calls = split_tool_calls(done.text, shape.max_calls) if shape.parse_tool_calls else (done.text, [])
        content = content if content or not calls else None
        logprobs = responses.logprob_entries(done.logprobs)
        return jsonify(responses.chat_completion(g.request_id, model, done, content, calls, logprobs))

    request_id, created = g.request_id, int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    parser = ToolCallParser(shape.max_calls) if shape.parse_tool_calls else None
    pending: list = []  # logprob records of text the tool-call parser still holds

    def chunk(delta: responses.Delta | None, **kwargs) -> bytes:
        return _sse(responses.chat_chunk(request_id, model, created, delta, **kwargs))

    def pieces(event: TextDelta | Completion):
        """Content and tool-call chunks, each with the logprobs of the tokens behind it (so the
        chunks' logprobs add up to the non-streamed answer's)."""
        if isinstance(event, Completion):
            out = parser.flush() if parser else []
        else:
            out = parser.feed(event.text) if parser else [event.text]
            pending.extend(event.logprobs)
        for piece in out:
            if isinstance(piece, ToolCallDelta):
                yield chunk(responses.Delta(tool_calls=[responses.tool_call_delta(piece)]), logprobs=held_logprobs())
            else:
                yield chunk(responses.Delta(content=piece), logprobs=held_logprobs())

    def held_logprobs() -> list[responses.LogprobEntry] | None:
        records = list(pending) if params.logprobs is not None else None
        pending.clear()
        return responses.logprob_entries(records)

    def encode(event):
        if event is None:
            yield chunk(responses.Delta(role="assistant", content=""))
        elif isinstance(event, TextDelta):
            yield from pieces(event)
        elif isinstance(event, Completion):
            yield from pieces(event)
            finish = responses.openai_finish_reason(event, parser.calls if parser else None)
            last = responses.Delta()
            if event.boxes:
                last.boxes = [responses.box_out(b) for b in event.boxes]
            yield chunk(last, finish_reason=finish, logprobs=held_logprobs())  # e.g. a call's closing tag
            if include_usage:
                yield chunk(None, usage_=responses.usage(event))
            yield b"data: [DONE]\n\n"
        elif isinstance(event, ServiceError):
            yield _sse(event.to_dict())
            yield b"data: [DONE]\n\n"

    stream = EventStream(generation, gen_request, request.environ, ENDPOINT, encode)
    return Response(
        stream, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
