"""Request schemas (OpenAI Chat Completions and the native endpoint) and response shapes."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ..generation import (
    Completion,
    MaxTokens,
    RepetitionPenalty,
    SamplingParams,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopP,
)

# A conversation id (body field or X-Conversation-Id header): also a cache key and Nginx's hash key.
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"

MAX_TEXT = 1_000_000  # characters in one text field; the token limit bites long before


class _Lenient(BaseModel):
    # OpenAI clients send fields we do not use (logprobs, metadata, …): ignore them, don't fail.
    model_config = ConfigDict(extra="ignore")


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


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | list[ContentPart] | None = None
    name: str | None = None


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
        )


class ChatCompletionRequest(_Sampling):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None
    n: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    tools: list | None = None


class NativeChatRequest(_Sampling):
    """`messages` in the OpenAI format — or `prompt` (+ `images`, `videos` as base64/data URLs) for short
    curl lines."""

    messages: list[Message] | None = Field(None, min_length=1)
    prompt: Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None = None
    images: list[Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]] | None = None
    videos: list[Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]] | None = None
    conversation_id: Annotated[str, StringConstraints(pattern=CONVERSATION_ID_PATTERN)] | None = None
    stream: bool = True


# The NativeChatRequest fields a multipart form may carry once each (`stop` may repeat; files: image, video).
FORM_FIELDS = frozenset(
    {"prompt", "conversation_id", "max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "stream"}
)


def usage(done: Completion) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def openai_finish_reason(done: Completion) -> str:
    return "length" if done.finish_reason in ("length", "deadline") else "stop"


def chat_completion(request_id: str, model: str, done: Completion) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": openai_finish_reason(done),
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
) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
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
