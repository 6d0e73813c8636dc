"""Anthropic's Messages API, typed: the request (`POST /v1/messages`, `/v1/messages/count_tokens`),
the message it answers and the events of its stream. anthropic/serving.py translates them to and
from the engine's request and events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, field_validator

from ...generation import MaxTokens, StopString, TopK, TopP
from ..schemas import MAX_TEXT, FunctionName, JSONSchema, Lenient, known_part_types

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
_DATA = Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]
_ID = Annotated[str, StringConstraints(max_length=256)]


class TextBlock(Lenient):
    type: Literal["text"]
    text: Text


class Base64Source(Lenient):
    type: Literal["base64"]
    media_type: Annotated[str, StringConstraints(max_length=64)] = Field(description="image/jpeg, image/png, ...")
    data: _DATA


class URLSource(Lenient):
    """Refused with a reason: this server fetches nothing."""

    type: Literal["url"]
    url: _DATA


class ImageBlock(Lenient):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class ToolUseBlock(Lenient):
    """An assistant's tool call, sent back as history."""

    type: Literal["tool_use"]
    id: _ID
    name: FunctionName
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: _ID
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value):
        return known_part_types(value, ("text",))


class ThinkingBlock(Lenient):
    """An assistant's reasoning, sent back as history (thinking models)."""

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking")
ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class MessageParam(Lenient):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value):
        return known_part_types(value, tuple(dict.fromkeys(USER_BLOCKS + ASSISTANT_BLOCKS)))


class ToolParam(Lenient):
    name: FunctionName
    description: Text | None = None
    input_schema: JSONSchema
    type: Literal["custom"] | None = Field(None, description="client tools only: server tools are not run here")


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = Field(None, description="type tool: the tool to call")
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(Lenient):
    """Thinking checkpoints: a reasoning budget, within Anthropic's bounds (at least 1,024 tokens, fewer
    than max_tokens); other models ignore it."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)


class ThinkingOther(Lenient):
    """Thinking checkpoints: no reasoning (disabled), or as much as the model goes (adaptive)."""

    type: Literal["disabled", "adaptive"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingOther, Field(discriminator="type")]


class JSONOutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: JSONSchema = Field(alias="schema")


class OutputConfig(Lenient):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="thinking checkpoints: a thinking budget (low 256, medium 1024, higher: no limit)"
    )
    format: JSONOutputFormat | None = Field(None, description="structured outputs: the answer follows the schema")


class CountTokensRequest(Lenient):
    """What makes a prompt: `POST /v1/messages/count_tokens` counts its tokens."""

    model: Annotated[str, StringConstraints(max_length=256)] | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = Field(
        None, description="the structured-outputs beta's form of output_config.format (as LiteLLM sends it)"
    )


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: list[StopString] | None = None
    temperature: float | None = Field(None, ge=0, le=1, description="0 = greedy")
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False


# -- what it answers ------------------------------------------------------------------------------


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = Field(description="empty: this server signs nothing")


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens computed (not read from the cache)")
    output_tokens: int
    cache_creation_input_tokens: int = Field(0, description="0: the cache keeps every prompt by itself")
    cache_read_input_tokens: int = Field(description="prompt tokens whose keys and values came from the cache")


class MessageOut(BaseModel):
    """A whole answer (`stream: false`), or the message of `message_start` (no content yet)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut | ThinkingOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage
    answer_digest: str | None = Field(
        None,
        description="an extension, once the answer is done: a digest of its token ids and logprob floats and the "
        "checkpoint's identity — any instance, on any CPU, replaying the request gives the same",
    )


class CountTokensOut(BaseModel):
    input_tokens: int


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageOut


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: TextOut | ToolUseOut | ThinkingOut


class TextDeltaOut(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDeltaOut(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDeltaOut | InputJSONDelta | ThinkingDeltaOut


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(BaseModel):
    """The stream's last word on the message: why it ended and the whole usage (cache reads included)."""

    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessagesUsage
    answer_digest: str | None = Field(
        None,
        description="an extension, once the answer is done: a digest of its token ids and logprob floats and the "
        "checkpoint's identity — any instance, on any CPU, replaying the request gives the same",
    )


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


STREAM_EVENTS = (MessageStart, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta, MessageStop, Ping)
