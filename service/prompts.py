"""Chat messages (text and decoded images) → the token ids and pixel patches Qwen3-VL takes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import BadRequest, PromptTooLong
from .images import DecodedImage

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    image: DecodedImage


@dataclass
class ChatMessage:
    role: str
    parts: list[TextPart | ImagePart]

    @property
    def images(self) -> list[DecodedImage]:
        return [p.image for p in self.parts if isinstance(p, ImagePart)]


@dataclass(frozen=True)
class PromptLimits:
    """Per-request bounds (settings): refused with a 4xx before the request waits for the model."""

    context_limit: int
    max_prompt_tokens: int
    max_messages: int = 64
    max_images: int = 8

    @classmethod
    def from_settings(cls, settings) -> "PromptLimits":
        return cls(settings.context_limit, settings.max_prompt_tokens, settings.max_messages,
                   settings.max_images_per_request)


@dataclass
class PreparedPrompt:
    """Everything `generate` needs, plus per-image data the caches key on."""

    input_ids: torch.Tensor  # 1 × L
    mm_token_type_ids: torch.Tensor  # 1 × L (1 on image pads)
    image_grid_thw: torch.Tensor | None  # n_images × 3
    pixel_values: list[torch.Tensor]  # one patch tensor per image
    image_digests: list[str]
    image_spans: list[tuple[int, int]]  # [start, end) token range of each image, <|vision_start|> … <|vision_end|>
    images_decode_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _template_messages(messages: list[ChatMessage]) -> list[dict]:
    rendered = []
    for m in messages:
        if m.role not in ROLES:
            raise BadRequest(f"unsupported role {m.role!r}: use one of {', '.join(ROLES)}", param="messages")
        content = [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                   for p in m.parts]
        if m.role != "user" and any(isinstance(p, ImagePart) for p in m.parts):
            raise BadRequest(f"images are accepted in user messages only, not {m.role}", param="messages")
        rendered.append({"role": m.role, "content": content})
    return rendered


def validate_conversation(messages: list[ChatMessage], limits: PromptLimits) -> None:
    if not messages:
        raise BadRequest("messages must not be empty", param="messages")
    if len(messages) > limits.max_messages:
        raise BadRequest(f"{len(messages)} messages (history included); the limit is {limits.max_messages}",
                         param="messages", code="too_many_messages")
    images = sum(len(m.images) for m in messages)
    if images > limits.max_images:
        raise BadRequest(f"{images} images (history included); the limit is {limits.max_images} per request",
                         param="messages", code="too_many_images")
    if messages[-1].role not in ("user", "system"):
        raise BadRequest("the last message must be from the user", param="messages")
    for i, m in enumerate(messages):
        if m.role == "system" and i != 0:
            raise BadRequest("a system message is accepted only first", param=f"messages[{i}]")


def prepare_prompt(processor, messages: list[ChatMessage], limits: PromptLimits) -> PreparedPrompt:
    """Render the chat template, tokenize, expand image pads and patchify the (pre-sized) images."""
    validate_conversation(messages, limits)
    text = processor.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True)
    images = [img for m in messages for img in m.images]
    kwargs = {"images": [img.pixels for img in images]} if images else {}
    batch = processor(text=[text], return_tensors="pt", **kwargs)
    input_ids = batch["input_ids"]
    if input_ids.shape[1] > limits.max_prompt_tokens:
        raise PromptTooLong(f"the prompt is {input_ids.shape[1]} tokens; the limit is {limits.max_prompt_tokens} "
                            f"(and {limits.context_limit} for prompt and answer together)", param="messages")
    grid = batch.get("image_grid_thw")
    pixel_values: list[torch.Tensor] = []
    if images:
        pixel_values = list(torch.split(batch["pixel_values"], grid.prod(-1).tolist()))
    mm = batch.get("mm_token_type_ids")
    if mm is None:
        mm = torch.zeros_like(input_ids)
    return PreparedPrompt(
        input_ids=input_ids, mm_token_type_ids=mm, image_grid_thw=grid, pixel_values=pixel_values,
        image_digests=[img.digest for img in images], image_spans=_image_spans(processor, input_ids[0]),
    )


def _image_spans(processor, ids: torch.Tensor) -> list[tuple[int, int]]:
    starts = (ids == processor.vision_start_token_id).nonzero().flatten().tolist()
    ends = (ids == processor.vision_end_token_id).nonzero().flatten().tolist()
    return list(zip(starts, [e + 1 for e in ends]))
