"""POST /v1/chat/completions — OpenAI Chat Completions, streaming (SSE) or not. Stateless: the
client sends the whole history; the KV cache finds the shared prefix by itself."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from flask import Blueprint, Response, g, jsonify, request

from ..answer.tools import ToolCallDelta, ToolCallParser, split_tool_calls
from ..engine.engine import ModelInfo
from ..errors import ServiceError
from ..generation import Completion, GenerationRequest, TenantShare, TextDelta
from . import protocol, responses
from .answer_shapes import AnswerShape, answer_shape
from .engine_requests import checked_max_tokens, conversation_header, generation_request, json_body, tenant_fields
from .inputs import clip_limits, picture_limits, to_chat_messages
from .serving import EventStream, collect
from .state import state

openai_api = Blueprint("openai", __name__)
ENDPOINT = "/v1/chat/completions"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


_END = b"data: [DONE]\n\n"


class OpenAIChunks:
    """The OpenAI stream's server-sent events (serving.StreamEncoder): a role chunk first, content and
    tool-call chunks per text delta, the finishing chunk (and the usage chunk when asked) then
    `[DONE]`, or an error event then `[DONE]`."""

    def __init__(
        self, request_id: str, info: ModelInfo, include_usage: bool, logprobs: bool, parser: ToolCallParser | None
    ):
        self.request_id, self.info, self.created = request_id, info, int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.parser = parser
        self.pending: list = []  # logprob records of text the tool-call parser still holds

    def head(self) -> Iterator[bytes]:
        yield self._chunk(responses.Delta(role="assistant", content="", refusal=None))

    def delta(self, event: TextDelta) -> Iterator[bytes]:
        if event.reasoning:  # reasoning_content (vLLM's and DeepSeek's name) and `reasoning`, its alias
            self.pending.extend(event.logprobs)
            delta = responses.Delta(reasoning_content=event.text, reasoning=event.text)
            yield self._chunk(delta, logprobs=self._held_logprobs())
            return
        yield from self._pieces(event)

    def done(self, event: Completion) -> Iterator[bytes]:
        yield from self._pieces(event)
        finish = responses.openai_finish_reason(event, self.parser.calls if self.parser else None)
        last = responses.Delta()
        if event.boxes:
            last.boxes = [responses.box_out(b) for b in event.boxes]
        yield self._chunk(last, finish_reason=finish, logprobs=self._held_logprobs())  # e.g. a call's closing tag
        if self.include_usage:
            yield self._chunk(None, usage_=responses.usage(event))
        yield _END

    def error(self, exc: ServiceError) -> Iterator[bytes]:
        yield _sse(exc.to_dict())
        yield _END

    def _chunk(self, delta: responses.Delta | None, **kwargs) -> bytes:
        info = self.info
        return _sse(responses.chat_chunk(self.request_id, info.name, info.fingerprint, self.created, delta, **kwargs))

    def _pieces(self, event: TextDelta | Completion) -> Iterator[bytes]:
        """Content and tool-call chunks, each with the logprobs of the tokens behind it (so the
        chunks' logprobs add up to the non-streamed answer's)."""
        if isinstance(event, Completion):
            out = self.parser.flush() if self.parser else []
        else:
            out = self.parser.feed(event.text) if self.parser else [event.text]
            self.pending.extend(event.logprobs)
        for piece in out:
            if isinstance(piece, ToolCallDelta):
                delta = responses.Delta(tool_calls=[responses.tool_call_delta(piece)])
            else:
                delta = responses.Delta(content=piece)
            yield self._chunk(delta, logprobs=self._held_logprobs())

    def _held_logprobs(self) -> list[responses.LogprobEntry] | None:
        records = list(self.pending) if self.logprobs else None
        self.pending.clear()
        return responses.logprob_entries(records)


def chat_request(
    body: protocol.ChatCompletionRequest,
    engine,
    conversation_id: str | None,
    priority: int | None = None,
    request_id: str | None = None,
    received_at: float | None = None,
    tenant: TenantShare = TenantShare(),
    cache_namespace: str = "",
) -> tuple[GenerationRequest, AnswerShape]:
    """A Chat Completions body as the engine's request (the route's, and a batch line's), and the
    shape its answer takes."""
    shape = answer_shape(body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls is not False)
    limits = engine.limits
    pictures = picture_limits(limits.image, grounding=body.grounding)
    messages = to_chat_messages(body.messages, limits, pictures, clip_limits(limits.video, *body.clip_sampling()))
    max_tokens = checked_max_tokens(body.max_completion_tokens, limits, "max_completion_tokens") or checked_max_tokens(
        body.max_tokens, limits, "max_tokens"
    )
    gen_request = generation_request(
        messages,
        body.sampling(max_tokens),
        conversation_id,
        remembered=0,
        shape=shape,
        speculative=body.speculative,
        priority=body.priority if priority is None else priority,
        request_id=request_id,
        received_at=received_at,
        tenant=tenant,
        cache_namespace=cache_namespace,
        **body.thinking(),
    )
    return gen_request, shape


def completion_body(request_id: str, info: ModelInfo, done: Completion, shape: AnswerShape) -> dict:
    """The non-streamed answer: OpenAI's chat.completion object."""
    content, calls = split_tool_calls(done.text, shape.max_calls) if shape.parse_tool_calls else (done.text, [])
    content = content if content or not calls else None
    logprobs = responses.logprob_entries(done.logprobs)
    return responses.chat_completion(request_id, info.name, info.fingerprint, done, content, calls, logprobs)


@openai_api.post(ENDPOINT)
def chat_completions():
    app_state = state()
    spend = app_state.rates.admit(g.tenant)
    body = protocol.ChatCompletionRequest.model_validate(json_body())
    engine = app_state.require_engine()
    conversation = conversation_header() or body.user
    gen_request, shape = chat_request(body, engine, conversation, **tenant_fields(body.cache_salt))
    generation = engine.submit(gen_request)

    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT, spend)
        return jsonify(completion_body(g.request_id, engine.info, done, shape))

    chunks = OpenAIChunks(
        g.request_id,
        engine.info,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=gen_request.params.logprobs is not None,
        parser=ToolCallParser(shape.max_calls) if shape.parse_tool_calls else None,
    )
    stream = EventStream(generation, gen_request, request.environ, ENDPOINT, chunks, spend)
    return Response(
        stream, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
