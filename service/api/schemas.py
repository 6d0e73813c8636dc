"""The schema parts several APIs share: requests' messages, content parts, tools, response formats and
the sampling fields of both chat endpoints (Chat Completions, native), and answers' logprobs and boxes.
Each API's own request and answer: its package's `protocol` module."""

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

from ..answer.grounding import Box
from ..answer.logprobs import TokenLogprob
from ..generation import SHARED_SAMPLING, Priority, SamplingParams, StopString, TopLogprobs

# A conversation id (body field or X-Conversation-Id header): also a cache key and Nginx's hash key.
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"

MAX_TEXT = 1_000_000  # characters in one text field; the token limit bites long before


class Lenient(BaseModel):
    """Every API's request schemas: clients send fields that change nothing here (OpenAI's metadata and
    store, Anthropic's cache_control, …): ignored, not failed. A field that would change the answer and
    is not supported is declared and refused."""

    model_config = ConfigDict(extra="ignore")


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
JSONSchema = Annotated[dict[str, Any], Field(description="a JSON Schema (draft 2020-12)")]


class ImageURL(Lenient):
    url: Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]
    detail: str | None = Field(
        None, description="the picture's pixel budget: low (256x256), high (IMAGE_REQUEST_MAX_PIXELS), auto (default)"
    )


class TextPart(Lenient):
    type: Literal["text"]
    text: Annotated[str, StringConstraints(max_length=MAX_TEXT)]


class ImageURLPart(Lenient):
    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]


class VideoURL(Lenient):
    url: Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]


class VideoURLPart(Lenient):
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


class FunctionCall(Lenient):
    name: FunctionName
    arguments: Annotated[str, StringConstraints(max_length=MAX_TEXT)] = Field(description="JSON text")


class ToolCallIn(Lenient):
    """An assistant message's tool call, as the client got it from this server (sent back as history)."""

    id: Annotated[str, StringConstraints(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Lenient):
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


class JSONSchemaFormat(Lenient):
    name: FunctionName = "response"
    description: str | None = None
    schema_: JSONSchema | None = Field(None, alias="schema", description="the answer's schema (none: any JSON object)")
    strict: bool | None = Field(
        None,
        description="the answer always follows the schema here; strict also closes every object that does not "
        "say otherwise (no keys beyond its properties), as OpenAI's strict mode does",
    )


class ResponseFormat(Lenient):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema; and this
    service's `grounding` preset: a list of labelled boxes (answer/grounding.py's GROUNDING_SCHEMA)."""

    type: Literal["text", "json_object", "json_schema", "grounding"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object: {name, schema, strict}")
        return self


class FunctionDefinition(Lenient):
    name: FunctionName
    description: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = Field(
        None, description="as json_schema's strict: objects allow no keys beyond their properties"
    )


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: FunctionName


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


# OpenAI's reasoning_effort as thinking budgets (max_thinking_tokens), for thinking checkpoints:
# `none` switches thinking off, `minimal` closes the reasoning at once, `high` leaves it max_tokens.
REASONING_EFFORT = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": None}


ClipFps = Annotated[float, Field(gt=0, le=30, description="frames sampled per second of a clip")]
ClipFrames = Annotated[int, Field(ge=2, description="frames sampled from a clip, at most (within VIDEO_MAX_FRAMES)")]


class VideoIOKwargs(Lenient):
    fps: ClipFps | None = None
    num_frames: ClipFrames | None = None


class MediaIOKwargs(Lenient):
    """vLLM's per-request media options: {"video": {"fps": 1, "num_frames": 16}}."""

    video: VideoIOKwargs | None = None


class ChatTemplateKwargs(BaseModel):
    """The chat template variables a request may set (the Qwen3 convention); no other."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: bool | None = None


# The sampling fields both endpoints take exactly as the engine does (SamplingParams' own, bounds
# included); `stop`, `logprobs` and `top_logprobs` take OpenAI's forms and are mapped below.
_EngineSampling = create_model(
    "_EngineSampling",
    __base__=Lenient,
    **{
        name: (field.annotation, field)
        for name, field in SamplingParams.model_fields.items()
        if name in SHARED_SAMPLING
    },
)


class ChatSampling(_EngineSampling):
    """The sampling fields both chat endpoints take (service/generation.py defines them once)."""

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


# -- answers ---------------------------------------------------------------------------------------


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


# The description of an answer's reasoning fields.
REASONING_NOTE = "a thinking model's reasoning (only from thinking checkpoints)"
