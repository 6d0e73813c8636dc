"""Client input → engine input: OpenAI-format messages, data: URLs and multipart uploads become
ChatMessages with decoded images. The server fetches nothing: remote and file URLs are refused."""

from __future__ import annotations

import base64
import binascii
import re
import time

from ..errors import BadRequest, ImageError, TooLarge
from ..images import DecodedImage, ImageLimits, decode_image
from ..prompts import ChatMessage, ImagePart, TextPart
from .protocol import ImageURLPart, Message

_WHITESPACE = re.compile(rb"\s+")


def decode_data_url(url: str, limits: ImageLimits, param: str) -> DecodedImage:
    """`data:image/...;base64,...` → DecodedImage; anything else is refused with a reason."""
    scheme = url[:12].lower()
    if scheme.startswith(("http://", "https://")):
        raise BadRequest("remote image URLs are refused: this server fetches nothing. Send the image inline "
                         "as a data: URL (data:image/jpeg;base64,...)", param=param, code="remote_image_refused")
    if not scheme.startswith("data:"):
        raise BadRequest("unsupported image URL: only data:image/...;base64,... URLs are accepted",
                         param=param, code="unsupported_image_url")
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise BadRequest("an image data: URL must be base64-encoded (data:image/png;base64,...)", param=param)
    mime = header[5:].split(";")[0].strip().lower()
    if mime and not mime.startswith("image/"):
        raise BadRequest(f"a data: URL of type {mime!r} is not an image", param=param, code="invalid_image")
    return decode_base64_image(payload, limits, param)


def decode_base64_image(payload: str, limits: ImageLimits, param: str) -> DecodedImage:
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise TooLarge(f"image is over {limits.max_bytes} bytes", param=param, code="image_too_large")
    try:
        data = base64.b64decode(_WHITESPACE.sub(b"", payload.encode("ascii")), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ImageError("image data is not valid base64", param=param) from None
    return decode_file(data, limits, param)


def decode_file(data: bytes, limits: ImageLimits, param: str) -> DecodedImage:
    try:
        return decode_image(data, limits)
    except (ImageError, TooLarge) as exc:
        exc.param = param
        raise


def checked_text(text: str, param: str) -> str:
    """Text the tokenizer can take: lone surrogates (legal in JSON escapes) are refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("text is not valid Unicode (it holds a lone surrogate)", param=param) from None
    return text


def to_chat_messages(messages: list[Message], limits: ImageLimits) -> tuple[list[ChatMessage], float]:
    """OpenAI-format messages → ChatMessages, and the seconds spent decoding their images."""
    out: list[ChatMessage] = []
    decode_seconds = 0.0
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.content is None or isinstance(m.content, str):
            out.append(ChatMessage(role, [TextPart(checked_text(m.content or "", f"messages[{i}].content"))]))
            continue
        parts = []
        for j, part in enumerate(m.content):
            if isinstance(part, ImageURLPart):
                url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
                t0 = time.perf_counter()
                parts.append(ImagePart(decode_data_url(url, limits, f"messages[{i}].content[{j}]")))
                decode_seconds += time.perf_counter() - t0
            else:
                parts.append(TextPart(checked_text(part.text, f"messages[{i}].content[{j}]")))
        out.append(ChatMessage(role, parts))
    return out, decode_seconds


def user_message(prompt: str, images: list[DecodedImage]) -> ChatMessage:
    """The native endpoint's short form: images first, then the question (Qwen's recommended order)."""
    return ChatMessage("user", [*(ImagePart(img) for img in images), TextPart(checked_text(prompt, "prompt"))])
