"""OpenAI Chat Completions, typed: the request (`POST /v1/chat/completions`), the `chat.completion` it
answers and the `chat.completion.chunk`s of its stream. The routes build their bodies from these models
and /openapi.json publishes their schemas, so the two cannot drift apart: fields that OpenAI always
sends, null or not, are always present; the others (tool calls, usage on a chunk) only when there is
something to say (schemas.dump). chat/serving.py translates them to and from the engine's request and
events."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, ValidationInfo, field_validator

from ...generation import MaxTokens
from ..schemas import REASONING_NOTE, BoxOut, ChatSampling, Lenient, LogprobEntry, Message, NamedToolChoice, Tool


class StreamOptions(Lenient):
    include_usage: bool = False


class ChatCompletionRequest(ChatSampling):
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
    # Fields that would change the answer and are not supported: refused, never ignored.
    functions: list | None = Field(None, description="the deprecated form of tools: refused, send tools")
    function_call: str | dict | None = Field(None, description="the deprecated form of tool_choice: refused")
    modalities: list[str] | None = Field(None, description='only ["text"]: this model answers in text')
    audio: dict | None = Field(None, description="refused: this model answers in text")

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value, info: ValidationInfo):
        if value is not None:
            raise ValueError(f"{info.field_name} is the deprecated form of tools: send tools and tool_choice")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value):
        if value is not None and set(value) - {"text"}:
            raise ValueError('this model answers in text only: modalities may be ["text"]')
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value):
        if value is not None:
            raise ValueError("audio output is not supported: this model answers in text")
        return value


# -- what it answers -------------------------------------------------------------------------------


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry]
    refusal: None = None


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = Field(description="always null: this server never answers with a refusal of its own")
    reasoning_content: str | None = Field(None, description=REASONING_NOTE)
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
    answer_digest: str | None = Field(
        None,
        description="an extension: a digest of the answer's token ids and logprob floats and the checkpoint's "
        "identity — any instance, on any CPU, replaying the request gives the same (on the last chunks when streamed)",
    )


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: None = Field(None, description="null on the first chunk, as OpenAI sends it")
    reasoning_content: str | None = Field(None, description=REASONING_NOTE)
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
    answer_digest: str | None = Field(
        None,
        description="an extension: a digest of the answer's token ids and logprob floats and the checkpoint's "
        "identity — any instance, on any CPU, replaying the request gives the same (on the last chunks when streamed)",
    )
