"""What the endpoints answer, typed: the OpenAI `chat.completion` and `chat.completion.chunk`, the
native endpoint's JSON lines, the model list. The routes build their bodies from these models and
/openapi.json publishes their schemas, so the two cannot drift apart.

Fields that OpenAI always sends, null or not, are always present; the others (tool calls, usage on
a chunk, logprobs on a native line) only when there is something to say (`dump`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Literal

from pydantic import BaseModel, Field

from ..answer.grounding import Box
from ..answer.logprobs import TokenLogprob
from ..answer.tools import ToolCall, ToolCallDelta
from ..generation import Completion


def dump(model: BaseModel) -> dict:
    """The JSON body: every field that was given (a None given is a null), none that was not."""
    return model.model_dump(mode="json", exclude_unset=True, by_alias=True)


# -- logprobs ------------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] = Field(description="the token's exact bytes (a token may hold part of a character)")


class LogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]
    reasoning: bool | None = Field(None, description="true on a token of a thinking model's reasoning (or its tags)")


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry]
    refusal: None = None


def logprob_entries(records: list[TokenLogprob] | None) -> list[LogprobEntry] | None:
    """OpenAI's `logprobs.content` items (None when not asked): each token's text, bytes and
    log-probability, with its top alternatives (the records come with their tokens' bytes)."""
    if records is None:
        return None

    def entry(token: bytes, logprob: float) -> dict:
        return {"token": token.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(token)}

    return [
        LogprobEntry(
            **entry(r.token_bytes, r.logprob),
            top_logprobs=[TopLogprob(**entry(b, lp)) for (_, lp), b in zip(r.top, r.top_bytes)],
            **({"reasoning": True} if r.reasoning else {}),
        )
        for r in records
    ]


def _choice_logprobs(entries: list[LogprobEntry] | None) -> ChoiceLogprobs | None:
    return None if entries is None else ChoiceLogprobs(content=entries, refusal=None)


# -- OpenAI Chat Completions -----------------------------------------------------------------------


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="the model's JSON text, verbatim")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDeltaOut(BaseModel):
    """A streamed piece of a call: the first names it (id, type, name), the next add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose keys and values came from the cache")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(0, description="OpenAI's Predicted Outputs, which this server has not: 0")
    rejected_prediction_tokens: int = Field(0, description="OpenAI's Predicted Outputs, which this server has not: 0")
    reasoning_tokens: int = Field(description="a thinking model's tokens before its answer (tags included)")


class Speculation(BaseModel):
    """An extension: the guesses of exact speculative decoding (the answer is the same bits without)."""

    drafted_tokens: int = Field(description="tokens guessed and verified")
    accepted_tokens: int = Field(description="of them, the ones the model made too")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    speculation: Speculation


FinishReason = Literal["stop", "length", "tool_calls"]


class BoxOut(BaseModel):
    """A box or point the answer names (an extension of both formats: the official client keeps it in
    `model_extra`), in the 0-1000 coordinates the model wrote and in the pixels of the client's picture."""

    label: str | None
    bbox_2d: list[float] | None = Field(None, description="x1, y1, x2, y2 as the answer wrote them (0-1000)")
    point_2d: list[float] | None = Field(None, description="x, y as the answer wrote them (0-1000)")
    pixels: list[float] = Field(
        description="the same clipped to 0-1000 (corners in order), in pixels of the picture as the client "
        "sent it (EXIF orientation applied)"
    )
    image: int = Field(description="which picture of the latest user message holding pictures (0-based)")
    clipped: bool = Field(description="true: a coordinate lay outside 0-1000")


def box_out(box: Box) -> BoxOut:
    out = BoxOut(label=box.label, pixels=list(box.pixels), image=box.image, clipped=box.clipped)
    if box.kind == "bbox":
        out.bbox_2d = list(box.written)
    else:
        out.point_2d = list(box.written)
    return out


_REASONING = "a thinking model's reasoning (only from thinking checkpoints)"


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = Field(description="always null: this server never answers with a refusal of its own")
    reasoning_content: str | None = Field(None, description=_REASONING)
    reasoning: str | None = Field(None, description="the same as reasoning_content")
    tool_calls: list[ToolCallOut] | None = None
    boxes: list[BoxOut] | None = Field(None, description="boxes and points the answer names (when it names any)")


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    """A whole answer (`stream: false`)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str = Field(description="the checkpoint, quantization and kernels that computed it")
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: None = Field(None, description="null on the first chunk, as OpenAI sends it")
    reasoning_content: str | None = Field(None, description=_REASONING)
    reasoning: str | None = Field(None, description="the same as reasoning_content")
    tool_calls: list[ToolCallDeltaOut] | None = None
    boxes: list[BoxOut] | None = Field(None, description="on the last chunk: the answer's boxes, when it names any")


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed answer (`data: {...}`; the stream ends with `data: [DONE]`).
    The last chunk, when `stream_options.include_usage`, has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str = Field(description="the checkpoint, quantization and kernels that computed it")
    choices: list[ChunkChoice]
    usage: Usage | None = None


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
) -> dict:
    """A chunk with `delta` (None: the usage chunk, no choices)."""
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
    return dump(chunk)


# -- the native endpoint ---------------------------------------------------------------------------


class NativeHead(BaseModel):
    """The first line of a stream."""

    id: str
    model: str
    conversation_id: str = Field(description="send it back with the next message to continue")
    created: int
    random_model: bool = Field(description="true: the embedded random test model, whose answers are noise")


class NativeDelta(BaseModel):
    """One piece of the answer's text, as generated (with its tokens' logprobs when asked)."""

    delta: str
    logprobs: list[LogprobEntry] | None = None


class NativeReasoning(BaseModel):
    """One piece of a thinking model's reasoning (these lines come before the answer's)."""

    reasoning: str
    logprobs: list[LogprobEntry] | None = None


class NativeUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = Field(description="a thinking model's tokens before its answer (tags included)")
    cached_tokens: int = Field(description="prompt tokens whose keys and values came from the cache")
    cached_from: Literal["memory", "disk"] | None = Field(
        description="the conversation cache's tier they came from (null: none came from it)"
    )
    drafted_tokens: int = Field(description="tokens guessed and verified (exact speculative decoding)")
    accepted_tokens: int = Field(description="of them, the ones the model made too")


class NativeTimings(BaseModel):
    """Seconds (and the decode rate), as the server measured them."""

    queue_wait: float
    paused: float = Field(description="paused for more urgent requests (the answer is the same bits)")
    image_decode: float
    video_decode: float
    cache_lookup: float
    vision_encode: float
    prefill: float
    time_to_first_token: float
    decode: float
    decode_tokens_per_s: float
    longest_token_gap: float
    total: float


class NativeDone(BaseModel):
    """The last line of a stream: how it ended, the whole text, counts and timings."""

    id: str
    conversation_id: str
    done: Literal[True] = True
    finish_reason: Literal["stop", "length", "deadline", "cancelled"]
    text: str
    reasoning: str | None = Field(None, description=_REASONING + ", whole")
    usage: NativeUsage
    vision_cache_hits: int
    images: int
    videos: int
    image_tokens: list[int] = Field(description="the visual tokens each picture in the prompt got (history included)")
    video_tokens: list[int] = Field(description="the visual tokens each clip in the prompt got")
    timings: NativeTimings
    preempted: int = Field(0, description="times it was paused for a more urgent request (`priority`)")
    boxes: list[BoxOut] = Field(description="boxes and points the answer names, in the client's pixels (grounding)")
    logprobs: list[LogprobEntry] | None = None


class NativeAnswer(NativeDone):
    """`stream: false`: the head's fields and the done line's in one object."""

    model: str
    created: int
    random_model: bool


def native_done(done: Completion, head: NativeHead, logprobs: list[LogprobEntry] | None) -> NativeDone:
    line = NativeDone(
        id=head.id,
        conversation_id=head.conversation_id,
        done=True,
        finish_reason=done.finish_reason,
        text=done.text,
        usage=NativeUsage(
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            reasoning_tokens=done.reasoning_tokens,
            cached_tokens=done.cached_tokens,
            cached_from=done.cached_from,
            drafted_tokens=done.drafted_tokens,
            accepted_tokens=done.accepted_tokens,
        ),
        vision_cache_hits=done.vision_cache_hits,
        images=done.images,
        videos=done.videos,
        image_tokens=list(done.image_tokens),
        video_tokens=list(done.video_tokens),
        timings=NativeTimings(**{k: round(v, 4) for k, v in asdict(done.timings).items()}),
        preempted=done.preempted,
        boxes=[box_out(b) for b in done.boxes],
    )
    if done.reasoning is not None:
        line.reasoning = done.reasoning
    if logprobs is not None:
        line.logprobs = logprobs
    return line


# -- /v1/models ------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "local"
    quantization: str
    random_test_model: bool
    image_max_pixels: int = Field(description="clients may downscale pictures to this before uploading")
    thinking: bool = Field(description="a thinking checkpoint: its reasoning comes as reasoning_content")
    warning: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
