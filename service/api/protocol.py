"""Request schemas: OpenAI Chat Completions and the native endpoint (what they answer: responses.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from ..generation import SHARED_SAMPLING, MaxTokens, Priority, SamplingParams, StopString, TopLogprobs

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
    detail: str | None = Field(
        None, description="the picture's pixel budget: low (256x256), high (IMAGE_REQUEST_MAX_PIXELS), auto (default)"
    )


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
CONTENT_PART_TYPES = ("text", "image_url", "video_url")


def known_part_types(parts, kinds: tuple[str, ...], what: str = "content part"):
    """A list of content parts (or items) unchanged, or a ValueError naming the first one's type not in
    `kinds` (pydantic's own message for a union names every member it tried instead)."""
    if isinstance(parts, list):
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise ValueError(f"{what} type {kind[:64]!r} is not supported here: {', '.join(kinds)}")
    return parts


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
    reasoning_content: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None = Field(
        None, description="an assistant's reasoning, as this server gave it (thinking models; `reasoning` too)"
    )
    reasoning: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value):
        return known_part_types(value, CONTENT_PART_TYPES)


class JSONSchemaFormat(_Lenient):
    name: FunctionName = "response"
    description: str | None = None
    schema_: JSONSchema | None = Field(None, alias="schema", description="the answer's schema (none: any JSON object)")
    strict: bool | None = Field(
        None,
        description="the answer always follows the schema here; strict also closes every object that does not "
        "say otherwise (no keys beyond its properties), as OpenAI's strict mode does",
    )


class ResponseFormat(_Lenient):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema; and this
    service's `grounding` preset: a list of labelled boxes (answer/grounding.py's GROUNDING_SCHEMA)."""

    type: Literal["text", "json_object", "json_schema", "grounding"]
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
    strict: bool | None = Field(
        None, description="as json_schema's strict: objects allow no keys beyond their properties"
    )


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


# OpenAI's reasoning_effort as thinking budgets (max_thinking_tokens), for thinking checkpoints:
# `none` switches thinking off, `minimal` closes the reasoning at once, `high` leaves it max_tokens.
REASONING_EFFORT = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": None}


ClipFps = Annotated[float, Field(gt=0, le=30, description="frames sampled per second of a clip")]
ClipFrames = Annotated[int, Field(ge=2, description="frames sampled from a clip, at most (within VIDEO_MAX_FRAMES)")]


class VideoIOKwargs(_Lenient):
    fps: ClipFps | None = None
    num_frames: ClipFrames | None = None


class MediaIOKwargs(_Lenient):
    """vLLM's per-request media options: {"video": {"fps": 1, "num_frames": 16}}."""

    video: VideoIOKwargs | None = None


class ChatTemplateKwargs(BaseModel):
    """The chat template variables a request may set (the Qwen3 convention); no other."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: bool | None = None


# The sampling fields both endpoints take exactly as the engine does (SamplingParams' own, bounds
# included); `stop`, `logprobs` and `top_logprobs` take OpenAI's forms and are mapped below.
_SamplingFields = create_model(
    "_SamplingFields",
    __base__=_Lenient,
    **{
        name: (field.annotation, field)
        for name, field in SamplingParams.model_fields.items()
        if name in SHARED_SAMPLING
    },
)


class _Sampling(_SamplingFields):
    """The sampling fields both endpoints take (service/generation.py defines them once)."""

    stop: StopString | list[StopString] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="alternatives per token (needs logprobs: true)")
    speculative: bool | None = Field(
        None,
        description="an extension: false turns exact speculative decoding off for this request (the answer "
        "is the same either way; only speed differs)",
    )
    enable_thinking: bool | None = Field(
        None, description="thinking checkpoints: false for an answer without reasoning (default true)"
    )
    chat_template_kwargs: ChatTemplateKwargs | None = Field(None, description="{enable_thinking: false}, as Qwen3's")
    max_thinking_tokens: int | None = Field(
        None,
        ge=0,
        description="thinking checkpoints: reasoning tokens before the server closes the reasoning itself "
        "(max_tokens counts reasoning and answer together)",
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="thinking checkpoints: a thinking budget (docs/api.md); max_thinking_tokens wins"
    )
    media_io_kwargs: MediaIOKwargs | None = Field(None, description="clips' sampling, as vLLM spells it")
    priority: Priority = 0
    cache_salt: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = Field(
        None,
        description="vLLM's: only requests with the same salt (and key) reuse each other's cached prompts, so "
        "nobody without it learns from cached_tokens or timings what was sent; make it long and random",
    )

    def clip_sampling(self) -> tuple[float | None, int | None]:
        """(fps, max_frames) for this request's clips: the native fields, else media_io_kwargs.video's."""
        video = (self.media_io_kwargs.video if self.media_io_kwargs else None) or VideoIOKwargs()
        fps, frames = getattr(self, "fps", None), getattr(self, "max_frames", None)
        return (fps if fps is not None else video.fps), (frames if frames is not None else video.num_frames)

    @property
    def grounding(self) -> bool:
        """The grounding preset: its pictures get more visual tokens."""
        return self.response_format is not None and self.response_format.type == "grounding"

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def thinking(self) -> dict:
        """enable_thinking and max_thinking_tokens, as the engine takes them (GenerationRequest)."""
        kwargs = self.chat_template_kwargs
        off = self.enable_thinking is False or (kwargs is not None and kwargs.enable_thinking is False)
        budget = self.max_thinking_tokens
        if budget is None and self.reasoning_effort is not None:
            off = off or self.reasoning_effort == "none"
            budget = REASONING_EFFORT[self.reasoning_effort]
        return {"enable_thinking": not off, "max_thinking_tokens": budget}

    def sampling(self, max_tokens: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        shared = {name: getattr(self, name) for name in SHARED_SAMPLING}
        if max_tokens:
            shared["max_tokens"] = max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**shared, stop=stop, logprobs=logprobs)


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


class NativeChatRequest(_Sampling):
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
