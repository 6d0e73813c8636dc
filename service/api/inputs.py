"""Client input → engine input: OpenAI-format messages, data: URLs and multipart uploads become
ChatMessages with decoded images and videos. The server fetches nothing: remote and file URLs are refused."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable

from ..answer.tools import ToolCall
from ..errors import BadRequest, ImageError, TooLarge, VideoError
from ..limits import RequestLimits
from ..media.images import DecodedImage, ImageLimits, decode_image
from ..media.video import DecodedVideo, VideoLimits, decode_video
from ..model.prompts import ChatMessage, ImagePart, TextPart, VideoPart
from .schemas import ImageURLPart, Message, VideoURLPart

_WHITESPACE = re.compile(rb"\s+")


def decode_data_url(url: str, limits: ImageLimits, param: str) -> DecodedImage:
    """`data:image/...;base64,...` → DecodedImage; anything else is refused with a reason."""
    return decode_base64_image(_data_url_payload(url, "image", param), limits, param)


FrameCount = Callable[[int], None]  # told a clip's sampled frames before they are decoded (media/video.py)


def decode_video_data_url(
    url: str, limits: VideoLimits, param: str, before_frames: FrameCount | None = None
) -> DecodedVideo:
    """`data:video/...;base64,...` → DecodedVideo (sampled frames); anything else is refused."""
    return decode_base64_video(_data_url_payload(url, "video", param), limits, param, before_frames)


def _data_url_payload(url: str, kind: str, param: str) -> str:
    """The base64 payload of a `data:{kind}/...;base64,` URL; remote and other URLs are refused."""
    scheme = url[:12].lower()
    example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
    if scheme.startswith(("http://", "https://")):
        raise BadRequest(
            f"remote {kind} URLs are refused: this server fetches nothing. Send the {kind} inline "
            f"as a data: URL ({example})",
            param=param,
            code=f"remote_{kind}_refused",
        )
    if not scheme.startswith("data:"):
        raise BadRequest(
            f"unsupported {kind} URL: only data:{kind}/...;base64,... URLs are accepted",
            param=param,
            code=f"unsupported_{kind}_url",
        )
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise BadRequest(f"the {kind} data: URL must be base64-encoded ({example})", param=param)
    mime = header[5:].split(";")[0].strip().lower()
    if mime and not mime.startswith(f"{kind}/"):
        raise BadRequest(
            f"a data: URL of type {mime!r} is not {'an' if kind == 'image' else 'a'} {kind}",
            param=param,
            code=f"invalid_{kind}",
        )
    return payload


def _base64_bytes(payload: str, max_bytes: int, kind: str, param: str, error: type) -> bytes:
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise TooLarge(f"{kind} is over {max_bytes} bytes", param=param, code=f"{kind}_too_large")
    try:
        return base64.b64decode(_WHITESPACE.sub(b"", payload.encode("ascii")), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise error(f"{kind} data is not valid base64", param=param) from None


def decode_base64_image(payload: str, limits: ImageLimits, param: str) -> DecodedImage:
    return decode_file(_base64_bytes(payload, limits.max_bytes, "image", param, ImageError), limits, param)


def decode_base64_video(
    payload: str, limits: VideoLimits, param: str, before_frames: FrameCount | None = None
) -> DecodedVideo:
    data = _base64_bytes(payload, limits.max_bytes, "video", param, VideoError)
    return decode_video_file(data, limits, param, before_frames)


def decode_inline_image(text: str, limits: ImageLimits, param: str) -> DecodedImage:
    """The native endpoint's `images` items: a data: URL or bare base64."""
    if text[:5].lower() == "data:":
        return decode_data_url(text, limits, param)
    return decode_base64_image(text, limits, param)


def decode_inline_video(
    text: str, limits: VideoLimits, param: str, before_frames: FrameCount | None = None
) -> DecodedVideo:
    """The native endpoint's `videos` items: a data: URL or bare base64."""
    if text[:5].lower() == "data:":
        return decode_video_data_url(text, limits, param, before_frames)
    return decode_base64_video(text, limits, param, before_frames)


def _naming_param(decode, data: bytes, limits, param: str, *more):
    """decode(data, limits, *more), with `param` named in the client error it may raise."""
    try:
        return decode(data, limits, *more)
    except (ImageError, VideoError, TooLarge) as exc:
        exc.param = param
        raise


def decode_file(data: bytes, limits: ImageLimits, param: str) -> DecodedImage:
    return _naming_param(decode_image, data, limits, param)


def decode_video_file(
    data: bytes, limits: VideoLimits, param: str, before_frames: FrameCount | None = None
) -> DecodedVideo:
    return _naming_param(decode_video, data, limits, param, before_frames)


def checked_text(text: str, param: str) -> str:
    """Text the tokenizer can take: lone surrogates (legal in JSON escapes) are refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("text is not valid Unicode (it holds a lone surrogate)", param=param) from None
    return text


# OpenAI's image_url.detail "low": a small budget (64 visual tokens on Qwen3-VL), within the server's.
LOW_DETAIL_PIXELS = 256 * 256
# The floor a picture gets for grounding and detail "high", in visual tokens (one per factor² pixels):
# Qwen's advice for grounding is 1,024 to 2,048; llama.cpp warns below 1,024.
DETAILED_VISUAL_TOKENS = 1024


def picture_limits(
    limits: ImageLimits, max_pixels: int | None = None, min_pixels: int | None = None, grounding: bool = False
) -> ImageLimits:
    """A request's picture limits: its own budget (`max_pixels`) and floor (`min_pixels`, smaller
    pictures scaled up to it), each within what the server allows (400 naming the field if not); a
    grounding answer raises the floor to DETAILED_VISUAL_TOKENS where the ceiling (and its budget) allow."""
    out = picture_budget(limits, max_pixels, "max_pixels")
    if min_pixels is not None:
        picture_budget(limits, min_pixels, "min_pixels")  # the same range
        if max_pixels is not None and min_pixels > max_pixels:
            raise BadRequest(f"min_pixels ({min_pixels}) is above max_pixels ({max_pixels})", param="min_pixels")
        out = out.with_floor(min_pixels)
    if grounding:
        floor = min(DETAILED_VISUAL_TOKENS * limits.factor**2, limits.ceiling, max_pixels or limits.ceiling)
        out = out.with_floor(max(floor, out.min_pixels))
    return out


def clip_limits(limits: VideoLimits, fps: float | None, max_frames: int | None) -> VideoLimits:
    """A request's clip sampling: frames per second and a frame cap, the cap within the server's
    (VIDEO_MAX_FRAMES; 400 naming the field if over)."""
    if max_frames is not None and max_frames > limits.max_frames:
        raise BadRequest(
            f"max_frames is {max_frames}; this server samples at most {limits.max_frames} frames a clip "
            "(VIDEO_MAX_FRAMES)",
            param="max_frames",
        )
    return limits.with_sampling(fps, max_frames)


def picture_budget(limits: ImageLimits, pixels: int | None, param: str) -> ImageLimits:
    """The image limits with a request's own pixel budget (None: the server's default), which may not
    pass the server's ceiling (IMAGE_REQUEST_MAX_PIXELS)."""
    if pixels is None:
        return limits
    if not limits.factor**2 <= pixels <= limits.ceiling:
        raise BadRequest(
            f"{param} is {pixels}; this server resizes pictures into {limits.factor**2} to {limits.ceiling} "
            "pixels (IMAGE_REQUEST_MAX_PIXELS)",
            param=param,
        )
    return limits.with_budget(pixels)


def detail_budget(limits: ImageLimits, detail: str | None, param: str) -> ImageLimits:
    """OpenAI's image_url.detail as a pixel budget: low = LOW_DETAIL_PIXELS, high = the server's
    ceiling (small things located), auto or none = the request's budget."""
    if detail == "low":
        return limits.with_budget(min(LOW_DETAIL_PIXELS, limits.max_pixels))
    if detail == "high":  # the ceiling, and a floor that scales a small picture up
        floor = min(DETAILED_VISUAL_TOKENS * limits.factor**2, limits.ceiling)
        return limits.with_budget(limits.ceiling).with_floor(floor)
    if detail not in (None, "auto"):
        raise BadRequest(f"image_url.detail is {detail!r}: low, high or auto", param=f"{param}.image_url.detail")
    return limits


def to_chat_messages(
    messages: list[Message],
    limits: RequestLimits,
    image_limits: ImageLimits | None = None,
    video_limits: VideoLimits | None = None,
    before_frames: Callable[[str], FrameCount] | None = None,
) -> list[ChatMessage]:
    """OpenAI-format messages → ChatMessages (images and videos decoded, each with its decode time),
    pictures into `image_limits` (default: the server's) or their image_url.detail's budget, clips
    sampled by `video_limits` (default: the server's); `before_frames(param)`, if given, is told each
    clip's frames before they are decoded."""
    image_limits = image_limits or limits.image
    video_limits = video_limits or limits.video
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls and role != "assistant":
            raise BadRequest("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
        calls = tuple(
            ToolCall(c.function.name, checked_text(c.function.arguments, f"messages[{i}].tool_calls"), c.id or "")
            for c in m.tool_calls or ()
        )
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None and role != "assistant":
            raise BadRequest("only assistant messages carry reasoning", param=f"messages[{i}].reasoning_content")
        if reasoning is not None:
            reasoning = checked_text(reasoning, f"messages[{i}].reasoning_content")
        if m.content is None or isinstance(m.content, str):
            text = TextPart(checked_text(m.content or "", f"messages[{i}].content"))
            out.append(ChatMessage(role, [text], tool_calls=calls, reasoning=reasoning))
            continue
        parts = []
        for j, part in enumerate(m.content):
            if isinstance(part, ImageURLPart):
                param = f"messages[{i}].content[{j}]"
                if isinstance(part.image_url, str):
                    url, budget = part.image_url, image_limits
                else:
                    url, budget = part.image_url.url, detail_budget(image_limits, part.image_url.detail, param)
                parts.append(ImagePart(decode_data_url(url, budget, param)))
            elif isinstance(part, VideoURLPart):
                url = part.video_url if isinstance(part.video_url, str) else part.video_url.url
                where = f"messages[{i}].content[{j}]"
                counted = before_frames(where) if before_frames is not None else None
                parts.append(VideoPart(decode_video_data_url(url, video_limits, where, counted)))
            else:
                parts.append(TextPart(checked_text(part.text, f"messages[{i}].content[{j}]")))
        out.append(ChatMessage(role, parts, tool_calls=calls, reasoning=reasoning))
    return out


def user_message(prompt: str, images: list[DecodedImage], videos: list[DecodedVideo] = ()) -> ChatMessage:
    """The native endpoint's short form: images and videos first, then the question (Qwen's
    recommended order)."""
    return ChatMessage(
        "user",
        [
            *(ImagePart(img) for img in images),
            *(VideoPart(v) for v in videos),
            TextPart(checked_text(prompt, "prompt")),
        ],
    )
