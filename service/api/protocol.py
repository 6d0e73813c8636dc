"""Request schemas (OpenAI Chat Completions and the native endpoint) and response shapes."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from ..generation import (
    Completion,
    LogitBias,
    MaxTokens,
    Penalty,
    RepetitionPenalty,
    SamplingParams,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
)
from ..logprobs import TokenLogprob, TokenText
from ..tools import ToolCall, ToolCallDelta

# A conversation id (body field or X-Conversation-Id header): also a cache key and Nginx's hash key.
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"

MAX_TEXT = 1_000_000  # characters in one text field; the token limit bites long before


class _Lenient(BaseModel):
    # OpenAI clients send fields that change nothing here (metadata, store, …): ignore them, don't
    # fail. A field that would change the answer and is not supported is declared and refused.
    model_config = ConfigDict(extra="ignore")


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
JSONSchema = Annotated[dict[str, Any], Field(description="a JSON Schema (draft 2020-12)")]


class ImageURL(_Lenient):
    url: Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]
    detail: str | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: Annotated[str, StringConstraints(max_length=MAX_TEXT)]


class ImageURLPart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]


class VideoURL(_Lenient):
    url: Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]


class VideoURLPart(_Lenient):
    """An extension of the OpenAI format (as vLLM's): a clip as a `data:video/...;base64,` URL."""

    type: Literal["video_url"]
    video_url: VideoURL | Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: FunctionName
    arguments: Annotated[str, StringConstraints(max_length=MAX_TEXT)] = Field(description="JSON text")


class ToolCallIn(_Lenient):
    """An assistant message's tool call, as the client got it from this server (sent back as history)."""

    id: Annotated[str, StringConstraints(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=64, description="assistant messages")
    tool_call_id: Annotated[str, StringConstraints(max_length=256)] | None = Field(None, description="tool messages")


class JSONSchemaFormat(_Lenient):
    name: FunctionName = "response"
    description: str | None = None
    schema_: JSONSchema | None = Field(None, alias="schema", description="the answer's schema (none: any JSON object)")
    strict: bool | None = Field(None, description="always enforced here: the answer follows the schema")


class ResponseFormat(_Lenient):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object: {name, schema, strict}")
        return self


class FunctionDefinition(_Lenient):
    name: FunctionName
    description: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: FunctionName


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    """The sampling fields both endpoints take: their bounds are SamplingParams' own (service/generation.py)."""

    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = Field(None, description="token id -> bias added to its logit (-100 to 100)")
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="alternatives per token (needs logprobs: true)")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def sampling(self, max_tokens: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            repetition_penalty=self.repetition_penalty,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
        )


class ChatCompletionRequest(_Sampling):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None
    n: int | None = Field(
        None, ge=1, le=1, description="only 1 is supported: send n requests instead (they decode as one batch)"
    )
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="default true")


class NativeChatRequest(_Sampling):
    """`messages` in the OpenAI format — or `prompt` (+ `images`, `videos` as base64/data URLs) for short
    curl lines."""

    messages: list[Message] | None = Field(None, min_length=1)
    prompt: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None = None
    images: list[Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]] | None = None
    videos: list[Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]] | None = None
    conversation_id: Annotated[str, StringConstraints(pattern=CONVERSATION_ID_PATTERN)] | None = None
    stream: bool = True
    tools: list | None = Field(None, description="not supported here: tool calls are on /v1/chat/completions")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value):
        if value:  # refused before any upload is decoded
            raise ValueError("tools are supported on /v1/chat/completions, not on this endpoint")
        return value


# The NativeChatRequest fields a multipart form may carry once each (`stop` may repeat; files: image, video).
FORM_FIELDS = frozenset(
    {
        "prompt",
        "conversation_id",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "stream",
        "response_format",  # as JSON text
        "logprobs",
        "top_logprobs",
    }
)


def usage(done: Completion) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def openai_finish_reason(done: Completion, tool_calls: list[ToolCall] | None = None) -> str:
    """An answer cut short is "length" first (its last tool call may be cut too), as OpenAI says it."""
    if done.finish_reason in ("length", "deadline"):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def logprob_entries(records: list[TokenLogprob] | None, text: TokenText) -> list[dict] | None:
    """OpenAI's `logprobs.content` items (None when not asked): each token's text, bytes and
    log-probability, with its top alternatives."""
    if records is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": text.text(token_id), "logprob": logprob, "bytes": list(text.bytes(token_id))}

    return [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(i, lp) for i, lp in r.top]} for r in records]


def tool_call(call: ToolCall) -> dict:
    """A call in OpenAI's shape."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(delta: ToolCallDelta) -> dict:
    """A streamed piece of a call: the first names it, the next ones add to its arguments."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def chat_completion(
    request_id: str,
    model: str,
    done: Completion,
    content: str | None,
    tool_calls: list[ToolCall],
    logprobs: list[dict] | None,
) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [tool_call(c) for c in tool_calls]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": openai_finish_reason(done, tool_calls),
            }
        ],
        "usage": usage(done),
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict | None,
    finish_reason: str | None = None,
    usage_: dict | None = None,
    logprobs: list[dict] | None = None,
) -> dict:
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [] if delta is None else [choice],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def native_done(done: Completion) -> dict:
    return {
        "done": True,
        "finish_reason": done.finish_reason,
        "text": done.text,
        "usage": {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "cached_tokens": done.cached_tokens,
        },
        "vision_cache_hits": done.vision_cache_hits,
        "images": done.images,
        "videos": done.videos,
        "timings": {k: round(v, 4) for k, v in asdict(done.timings).items()},
    }
