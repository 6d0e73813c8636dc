"""Chat Completions onto the one engine path: its request as the engine's GenerationRequest (for the
route and for a batch line alike), the engine's events as its chat.completion or its stream of
chat.completion.chunk events (streaming.StreamEncoder)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from ...answer.tools import ToolCall, ToolCallDelta, ToolCallParser
from ...engine.engine import ModelInfo
from ...errors import ServiceError
from ...generation import Completion, GenerationRequest, TextDelta
from ...limits import RequestLimits
from ..answer_shapes import AnswerShape, answer_shape
from ..context import RequestContext
from ..engine_requests import generation_request
from ..inputs import clip_limits, picture_limits, to_chat_messages
from ..schemas import LogprobEntry, box_out, dump, logprob_entries
from ..streaming import sse
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionTokensDetails,
    Delta,
    FinishReason,
    FunctionCallOut,
    FunctionDelta,
    PromptTokensDetails,
    Speculation,
    ToolCallDeltaOut,
    ToolCallOut,
    Usage,
)

_END = sse("[DONE]")


def _data(obj: dict) -> bytes:
    """An event of the stream: OpenAI's are unnamed, their data a JSON object."""
    return sse(json.dumps(obj, ensure_ascii=False))


def chat_request(
    body: ChatCompletionRequest, limits: RequestLimits, context: RequestContext, conversation_id: str | None
) -> tuple[GenerationRequest, AnswerShape]:
    """A Chat Completions body as the engine's request, and the shape its answer takes."""
    shape = answer_shape(
        body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls is not False, limits.tool_form
    )
    pictures = picture_limits(limits.image, grounding=body.grounding)
    messages = to_chat_messages(body.messages, limits, pictures, clip_limits(limits.video, *body.clip_sampling()))
    gen_request = generation_request(
        context,
        messages,
        body.sampling(body.max_completion_tokens),
        limits,
        shape=shape,
        max_tokens_param="max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
        conversation_id=conversation_id,
        cache_salt=body.cache_salt,
        speculative=body.speculative,
        priority=body.priority,
        **body.thinking(),
    )
    return gen_request, shape


def completion_body(request_id: str, info: ModelInfo, done: Completion, shape: AnswerShape) -> dict:
    """The non-streamed answer: OpenAI's chat.completion object."""
    content, calls = shape.split(done.text)
    content = content if content or not (calls or shape.forced_calls) else None
    logprobs = logprob_entries(done.logprobs)
    return chat_completion(request_id, info.name, info.fingerprint, done, content, calls, logprobs)


def _choice_logprobs(entries: list[LogprobEntry] | None) -> ChoiceLogprobs | None:
    return None if entries is None else ChoiceLogprobs(content=entries, refusal=None)


def usage(done: Completion) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=0, rejected_prediction_tokens=0, reasoning_tokens=done.reasoning_tokens
        ),
        speculation=Speculation(drafted_tokens=done.drafted_tokens, accepted_tokens=done.accepted_tokens),
    )


def openai_finish_reason(done: Completion, tool_calls: list[ToolCall] | None = None) -> FinishReason:
    """An answer cut short is "length" first (its last tool call may be cut too), as OpenAI says it."""
    if done.finish_reason in ("length", "deadline"):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def tool_call(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, type="function", function=FunctionCallOut(name=call.name, arguments=call.arguments))


def tool_call_delta(delta: ToolCallDelta) -> ToolCallDeltaOut:
    if delta.name is None:
        return ToolCallDeltaOut(index=delta.index, function=FunctionDelta(arguments=delta.arguments))
    return ToolCallDeltaOut(
        index=delta.index,
        id=delta.id,
        type="function",
        function=FunctionDelta(name=delta.name, arguments=delta.arguments),
    )


def chat_completion(
    request_id: str,
    model: str,
    fingerprint: str,
    done: Completion,
    content: str | None,
    tool_calls: list[ToolCall],
    logprobs: list[LogprobEntry] | None,
) -> dict:
    message = AssistantMessage(role="assistant", content=content, refusal=None)
    if done.reasoning is not None:
        message.reasoning_content = message.reasoning = done.reasoning
    if tool_calls:
        message.tool_calls = [tool_call(c) for c in tool_calls]
    if done.boxes:
        message.boxes = [box_out(b) for b in done.boxes]
    choice = Choice(
        index=0,
        message=message,
        logprobs=_choice_logprobs(logprobs),
        finish_reason=openai_finish_reason(done, tool_calls),
    )
    completion = ChatCompletion(
        id=request_id,
        object="chat.completion",
        created=int(time.time()),
        model=model,
        system_fingerprint=fingerprint,
        choices=[choice],
        usage=usage(done),
        answer_digest=done.answer_digest,
    )
    return dump(completion)


def chat_chunk(
    request_id: str,
    model: str,
    fingerprint: str,
    created: int,
    delta: Delta | None,
    finish_reason: FinishReason | None = None,
    usage_: Usage | None = None,
    logprobs: list[LogprobEntry] | None = None,
    answer_digest: str | None = None,
) -> dict:
    """A chunk with `delta` (None: the usage chunk, no choices); the finishing chunks carry the answer's digest."""
    choices = []
    if delta is not None:
        choices = [ChunkChoice(index=0, delta=delta, logprobs=_choice_logprobs(logprobs), finish_reason=finish_reason)]
    chunk = ChatCompletionChunk(
        id=request_id,
        object="chat.completion.chunk",
        created=created,
        model=model,
        system_fingerprint=fingerprint,
        choices=choices,
    )
    if usage_ is not None:
        chunk.usage = usage_
    if answer_digest is not None:
        chunk.answer_digest = answer_digest
    return dump(chunk)


class OpenAIChunks:
    """The OpenAI stream's server-sent events (streaming.StreamEncoder): a role chunk first, content and
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
        forced = self.parser is not None and self.parser.forced  # calls only: no content, as OpenAI streams them
        yield self._chunk(Delta(role="assistant", content=None if forced else "", refusal=None))

    def delta(self, event: TextDelta) -> Iterator[bytes]:
        if event.reasoning:  # reasoning_content (vLLM's and DeepSeek's name) and `reasoning`, its alias
            self.pending.extend(event.logprobs)
            delta = Delta(reasoning_content=event.text, reasoning=event.text)
            yield self._chunk(delta, logprobs=self._held_logprobs())
            return
        yield from self._pieces(event)

    def done(self, event: Completion) -> Iterator[bytes]:
        yield from self._pieces(event)
        finish = openai_finish_reason(event, self.parser.calls if self.parser else None)
        last = Delta()
        if event.boxes:
            last.boxes = [box_out(b) for b in event.boxes]
        held = self._held_logprobs()  # e.g. a call's closing tag
        yield self._chunk(last, finish_reason=finish, logprobs=held, answer_digest=event.answer_digest)
        if self.include_usage:
            yield self._chunk(None, usage_=usage(event), answer_digest=event.answer_digest)
        yield _END

    def error(self, exc: ServiceError) -> Iterator[bytes]:
        yield _data(exc.to_dict())
        yield _END

    def _chunk(self, delta: Delta | None, **kwargs) -> bytes:
        info = self.info
        return _data(chat_chunk(self.request_id, info.name, info.fingerprint, self.created, delta, **kwargs))

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
                delta = Delta(tool_calls=[tool_call_delta(piece)])
            else:
                delta = Delta(content=piece)
            yield self._chunk(delta, logprobs=self._held_logprobs())

    def _held_logprobs(self) -> list[LogprobEntry] | None:
        records = list(self.pending) if self.logprobs else None
        self.pending.clear()
        return logprob_entries(records)
