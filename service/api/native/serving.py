"""The native endpoint onto the one engine path: its new message (JSON, or a form's prompt and uploads)
and the conversation's remembered history as the engine's GenerationRequest; the engine's events as
its JSON lines (streaming.StreamEncoder) or its one answer object; the answer remembered."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import BinaryIO

from ...engine.engine import ModelInfo
from ...errors import BadRequest, ServiceError
from ...generation import Completion, GenerationRequest, TextDelta
from ...limits import RequestLimits
from ...media.images import ImageLimits
from ...media.video import VideoLimits
from ...model.prompts import ChatMessage, TextPart
from ..answer_shapes import answer_shape
from ..context import RequestContext
from ..engine_requests import generation_request
from ..inputs import (
    clip_limits,
    decode_file,
    decode_inline_image,
    decode_inline_video,
    decode_video_file,
    picture_limits,
    to_chat_messages,
    user_message,
)
from ..schemas import box_out, dump, logprob_entries
from ..streaming import json_line
from .histories import HistoryStore
from .protocol import (
    NativeAnswer,
    NativeChatRequest,
    NativeDelta,
    NativeDone,
    NativeHead,
    NativeReasoning,
    NativeTimings,
    NativeUsage,
)


def _media_limits(body: NativeChatRequest, limits: RequestLimits) -> tuple[ImageLimits, VideoLimits]:
    """This request's picture limits (max_pixels, min_pixels, grounding's floor) and clip sampling."""
    pictures = picture_limits(limits.image, body.max_pixels, body.min_pixels, grounding=body.grounding)
    return pictures, clip_limits(limits.video, *body.clip_sampling())


def form_messages(
    body: NativeChatRequest, images: list[BinaryIO], videos: list[BinaryIO], limits: RequestLimits
) -> list[ChatMessage]:
    """A form's new message: its prompt and its uploaded pictures and clips (files, read here)."""
    if body.prompt is None:
        raise BadRequest("the form needs a prompt field: -F prompt='your question'", param="prompt")
    budget, clip = _media_limits(body, limits)
    pictures = [decode_file(f.read(), budget, f"image[{i}]") for i, f in enumerate(images)]
    clips = [decode_video_file(f.read(), clip, f"video[{i}]") for i, f in enumerate(videos)]
    return [user_message(body.prompt, pictures, clips)]


def json_messages(body: NativeChatRequest, limits: RequestLimits) -> list[ChatMessage]:
    """A JSON body's new messages: `messages` (OpenAI's format), or `prompt` with `images` and `videos`."""
    budget, clip = _media_limits(body, limits)
    if (body.messages is None) == (body.prompt is None):
        raise BadRequest(
            "send either messages (OpenAI format) or prompt (+ images, videos), not both or neither", param="messages"
        )
    if body.messages is not None:
        for name in ("images", "videos"):
            if getattr(body, name):
                raise BadRequest(f"{name} go inside messages when messages are sent", param=name)
        return to_chat_messages(body.messages, limits, budget, clip)
    images = [decode_inline_image(s, budget, f"images[{i}]") for i, s in enumerate(body.images or [])]
    videos = [decode_inline_video(s, clip, f"videos[{i}]") for i, s in enumerate(body.videos or [])]
    return [user_message(body.prompt, images, videos)]


def _conversation_id(body: NativeChatRequest, header: str | None) -> str | None:
    """The body's conversation_id, else the X-Conversation-Id header: the key Nginx routes a
    conversation by, so a client behind Nginx can send the id once, as that header."""
    if header is None:
        return body.conversation_id
    if body.conversation_id is not None and body.conversation_id != header:
        raise BadRequest("conversation_id and the X-Conversation-Id header differ", param="conversation_id")
    return header


def native_request(
    body: NativeChatRequest,
    new_messages: list[ChatMessage],
    header: str | None,
    histories: HistoryStore,
    limits: RequestLimits,
    context: RequestContext,
) -> GenerationRequest:
    """The engine's request: the new messages after the conversation's remembered history (none for a
    new conversation, which gets its id here), `header` the X-Conversation-Id header."""
    shape = answer_shape(body.response_format)
    given_id = _conversation_id(body, header)
    conversation_id = given_id or histories.new_id(context.affinity_key)
    history = histories.history(conversation_id, context.owner) if given_id else []
    if history and new_messages[0].role == "system":
        raise BadRequest("a system message can only open a conversation", param="messages")
    return generation_request(
        context,
        history + new_messages,
        body.sampling(),
        limits,
        shape=shape,
        conversation_id=conversation_id,
        remembered=len(history),
        cache_salt=body.cache_salt,
        speculative=body.speculative,
        priority=body.priority,
        **body.thinking(),
    )


def remember(histories: HistoryStore, request: GenerationRequest, owner: str, done: Completion) -> None:
    """Keep the conversation, its answer with the generated ids (the next turn extends its KV cache)."""
    answer = ChatMessage("assistant", [TextPart(done.text)], token_ids=done.answer_token_ids, reasoning=done.reasoning)
    histories.save(request.conversation_id, request.messages + [answer], owner)


def native_head(request_id: str, info: ModelInfo, conversation_id: str) -> NativeHead:
    """The first line: the ids (the conversation's to send back), the model."""
    return NativeHead(
        id=request_id,
        model=info.name,
        conversation_id=conversation_id,
        created=int(time.time()),
        random_model=info.is_random,
    )


def native_done(done: Completion, head: NativeHead) -> NativeDone:
    """The last line: how it ended, the whole text, counts and timings."""
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
        answer_digest=done.answer_digest,
    )
    if done.reasoning is not None:
        line.reasoning = done.reasoning
    logprobs = logprob_entries(done.logprobs)
    if logprobs is not None:
        line.logprobs = logprobs
    return line


def native_answer(head: NativeHead, done: Completion) -> dict:
    """`stream: false`: the head's fields and the done line's in one object."""
    return dump(NativeAnswer(**{**dump(head), **dump(native_done(done, head))}))


class NativeLines:
    """The native stream's JSON lines (streaming.StreamEncoder): the head with the ids, one line per
    text delta, the done line (usage, timings; the answer remembered first), or an error line that
    ends the stream."""

    def __init__(self, head: NativeHead, logprobs: bool, remember: Callable[[Completion], None]):
        self._head = head
        self._logprobs = logprobs
        self._remember = remember

    def head(self) -> Iterator[bytes]:
        yield json_line(dump(self._head))

    def delta(self, event: TextDelta) -> Iterator[bytes]:
        line = NativeReasoning(reasoning=event.text) if event.reasoning else NativeDelta(delta=event.text)
        if self._logprobs:
            line.logprobs = logprob_entries(event.logprobs)
        yield json_line(dump(line))

    def done(self, event: Completion) -> Iterator[bytes]:
        self._remember(event)
        yield json_line(dump(native_done(event, self._head)))

    def error(self, exc: ServiceError) -> Iterator[bytes]:
        yield json_line({**exc.to_dict(), "done": True})
