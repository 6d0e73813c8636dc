"""POST /v1/chat — the curl-first endpoint: JSON or multipart in, JSON lines out.

Stateful by `conversation_id`: a client sends only its new message; the server keeps the history
(and the KV cache of it). Lines: a first one with ids, one per text delta, a last one with
`"done": true`, usage and timings.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

from flask import Blueprint, Response, g, jsonify, request

from ..errors import BadRequest, ServiceError, UnsupportedMediaType
from ..generation import Completion, TextDelta
from ..limits import RequestLimits
from ..media.images import ImageLimits
from ..media.video import VideoLimits
from ..model.prompts import ChatMessage, TextPart
from . import protocol, responses
from .answer_shapes import answer_shape
from .engine_requests import checked_max_tokens, conversation_header, generation_request, json_body, tenant_fields
from .inputs import (
    clip_limits,
    decode_file,
    decode_inline_image,
    decode_inline_video,
    decode_video_file,
    picture_limits,
    to_chat_messages,
    user_message,
)
from .serving import EventStream, collect
from .state import state

native = Blueprint("native", __name__)
ENDPOINT = "/v1/chat"


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _done_line(done: Completion, head: responses.NativeHead) -> responses.NativeDone:
    return responses.native_done(done, head, responses.logprob_entries(done.logprobs))


class NativeLines:
    """The native stream's JSON lines (serving.StreamEncoder): the head with the ids, one line per
    text delta, the done line (usage, timings; the answer remembered first), or an error line that
    ends the stream."""

    def __init__(self, head: responses.NativeHead, logprobs: bool, remember: Callable[[Completion], None]):
        self._head = head
        self._logprobs = logprobs
        self._remember = remember

    def head(self) -> Iterator[bytes]:
        yield _line(responses.dump(self._head))

    def delta(self, event: TextDelta) -> Iterator[bytes]:
        line = (
            responses.NativeReasoning(reasoning=event.text)
            if event.reasoning
            else responses.NativeDelta(delta=event.text)
        )
        if self._logprobs:
            line.logprobs = responses.logprob_entries(event.logprobs)
        yield _line(responses.dump(line))

    def done(self, event: Completion) -> Iterator[bytes]:
        self._remember(event)
        yield _line(responses.dump(_done_line(event, self._head)))

    def error(self, exc: ServiceError) -> Iterator[bytes]:
        yield _line({**exc.to_dict(), "done": True})


def _from_form(limits: RequestLimits) -> tuple[protocol.NativeChatRequest, list[ChatMessage]]:
    form, files = request.form, request.files
    if None in form or None in files or "" in form or "" in files:
        raise BadRequest('a form part has no name: each needs Content-Disposition: form-data; name="..."')
    unknown = set(form) - protocol.FORM_FIELDS - {"stop"}
    if unknown:
        raise BadRequest(f"unknown form field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    for name in protocol.FORM_FIELDS:
        if len(form.getlist(name)) > 1:
            raise BadRequest(f"form field {name!r} was sent more than once", param=name)
    unknown_files = set(files) - {"image", "video"}
    if unknown_files:
        raise BadRequest(
            f"unknown file field(s): {', '.join(sorted(unknown_files))}; send images as -F image=@file "
            "and videos as -F video=@file",
            param=sorted(unknown_files)[0],
        )
    fields = {k: form[k] for k in protocol.FORM_FIELDS if k in form}
    if "response_format" in fields:
        try:
            fields["response_format"] = json.loads(fields["response_format"])
        except ValueError:
            raise BadRequest("response_format must be JSON text in a form", param="response_format") from None
    if form.getlist("stop"):
        fields["stop"] = form.getlist("stop")
    body = protocol.NativeChatRequest.model_validate(fields)
    if body.prompt is None:
        raise BadRequest("the form needs a prompt field: -F prompt='your question'", param="prompt")
    budget, clip = _media_limits(body, limits)
    images = [decode_file(f.read(), budget, f"image[{i}]") for i, f in enumerate(files.getlist("image"))]
    videos = [decode_video_file(f.read(), clip, f"video[{i}]") for i, f in enumerate(files.getlist("video"))]
    return body, [user_message(body.prompt, images, videos)]


def _from_json(limits: RequestLimits) -> tuple[protocol.NativeChatRequest, list[ChatMessage]]:
    body = protocol.NativeChatRequest.model_validate(json_body())
    budget, clip = _media_limits(body, limits)
    if (body.messages is None) == (body.prompt is None):
        raise BadRequest(
            "send either messages (OpenAI format) or prompt (+ images, videos), not both or neither", param="messages"
        )
    if body.messages is not None:
        for name in ("images", "videos"):
            if getattr(body, name):
                raise BadRequest(f"{name} go inside messages when messages are sent", param=name)
        return body, to_chat_messages(body.messages, limits, budget, clip)
    images = [decode_inline_image(s, budget, f"images[{i}]") for i, s in enumerate(body.images or [])]
    videos = [decode_inline_video(s, clip, f"videos[{i}]") for i, s in enumerate(body.videos or [])]
    return body, [user_message(body.prompt, images, videos)]


def _media_limits(body: protocol.NativeChatRequest, limits: RequestLimits) -> tuple[ImageLimits, VideoLimits]:
    """This request's picture limits (max_pixels, min_pixels, grounding's floor) and clip sampling."""
    pictures = picture_limits(limits.image, body.max_pixels, body.min_pixels, grounding=body.grounding)
    return pictures, clip_limits(limits.video, *body.clip_sampling())


def _conversation_id(body: protocol.NativeChatRequest) -> str | None:
    """The body's conversation_id, else the X-Conversation-Id header: the key Nginx routes a
    conversation by, so a client behind Nginx can send the id once, as that header."""
    header = conversation_header()
    if header is None:
        return body.conversation_id
    if body.conversation_id is not None and body.conversation_id != header:
        raise BadRequest("conversation_id and the X-Conversation-Id header differ", param="conversation_id")
    return header


@native.post(ENDPOINT)
def chat():
    app_state = state()
    engine = app_state.require_engine()
    tenant = g.tenant
    spend = app_state.rates.admit(tenant)
    if request.mimetype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        body, new_messages = _from_form(engine.limits)
    elif request.is_json:
        body, new_messages = _from_json(engine.limits)
    else:
        raise UnsupportedMediaType(
            "send application/json or multipart/form-data (curl -F prompt=... -F image=@file -F video=@file)"
        )
    shape = answer_shape(body.response_format)
    given_id = _conversation_id(body)
    conversation_id = given_id or app_state.histories.new_id()
    history = app_state.histories.history(conversation_id, tenant.owner) if given_id else []
    if history and new_messages[0].role == "system":
        raise BadRequest("a system message can only open a conversation", param="messages")
    messages = history + new_messages
    params = body.sampling(checked_max_tokens(body.max_tokens, engine.limits, "max_tokens"))
    gen_request = generation_request(
        messages,
        params,
        conversation_id,
        remembered=len(history),
        shape=shape,
        speculative=body.speculative,
        priority=body.priority,
        **tenant_fields(body.cache_salt),
        **body.thinking(),
    )
    generation = engine.submit(gen_request)
    head = responses.NativeHead(
        id=g.request_id,
        model=engine.info.name,
        conversation_id=conversation_id,
        created=int(time.time()),
        random_model=engine.info.is_random,
    )

    def remember(done: Completion) -> None:
        answer = ChatMessage(
            "assistant", [TextPart(done.text)], token_ids=done.answer_token_ids, reasoning=done.reasoning
        )
        app_state.histories.save(conversation_id, messages + [answer], tenant.owner)

    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT, spend)
        remember(done)
        answer = responses.NativeAnswer(**{**responses.dump(head), **responses.dump(_done_line(done, head))})
        return jsonify(responses.dump(answer))

    lines = NativeLines(head, params.logprobs is not None, remember)
    stream = EventStream(generation, gen_request, request.environ, ENDPOINT, lines, spend)
    return Response(
        stream, mimetype="application/x-ndjson", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
