"""The native endpoint, typed: its request (`POST /v1/chat`, JSON or the fields a multipart form may
carry) and the JSON lines it answers — or, `stream: false`, the one object. native/serving.py
translates them to and from the engine's request and events."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, field_validator

from ...generation import SHARED_SAMPLING
from ..schemas import (
    CONVERSATION_ID_PATTERN,
    MAX_TEXT,
    REASONING_NOTE,
    BoxOut,
    ChatSampling,
    ClipFps,
    ClipFrames,
    LogprobEntry,
    Message,
)


class NativeChatRequest(ChatSampling):
    """`messages` in the OpenAI format — or `prompt` (+ `images`, `videos` as base64/data URLs) for short
    curl lines."""

    messages: list[Message] | None = Field(None, min_length=1)
    prompt: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None = None
    images: list[Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]] | None = None
    videos: list[Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]] | None = None
    conversation_id: Annotated[str, StringConstraints(pattern=CONVERSATION_ID_PATTERN)] | None = None
    stream: bool = True
    max_pixels: int | None = Field(
        None,
        description="the pixel budget this request's pictures are resized into (default IMAGE_MAX_PIXELS, at "
        "most IMAGE_REQUEST_MAX_PIXELS): more pixels locate smaller things, at more visual tokens",
    )
    min_pixels: int | None = Field(
        None,
        description="a floor: smaller pictures are scaled up to it (within IMAGE_REQUEST_MAX_PIXELS; grounding "
        "raises it to 1,024 visual tokens)",
    )
    fps: ClipFps | None = None
    max_frames: ClipFrames | None = None
    tools: list | None = Field(None, description="not supported here: tool calls are on /v1/chat/completions")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value):
        if value:  # refused before any upload is decoded
            raise ValueError("tools are supported on /v1/chat/completions, not on this endpoint")
        return value


# The NativeChatRequest fields a multipart form may carry once each (`stop` may repeat; files: image,
# video): the scalar sampling fields, response_format as JSON text, and the native ones.
FORM_FIELDS = frozenset(
    {name for name in SHARED_SAMPLING if name != "logit_bias"}
    | {"prompt", "conversation_id", "stream", "response_format", "logprobs", "top_logprobs", "speculative", "priority"}
    | {"cache_salt"}
    | {"max_pixels", "min_pixels", "fps", "max_frames", "enable_thinking", "max_thinking_tokens", "reasoning_effort"}
)


# -- what it answers -------------------------------------------------------------------------------


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
    reasoning: str | None = Field(None, description=REASONING_NOTE + ", whole")
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
    answer_digest: str = Field(
        description="a digest of the answer's token ids and logprob floats and the checkpoint's identity: any "
        "instance, on any CPU, replaying the request gives the same"
    )


class NativeAnswer(NativeDone):
    """`stream: false`: the head's fields and the done line's in one object."""

    model: str
    created: int
    random_model: bool
