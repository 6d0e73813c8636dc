"""Chat messages (text, decoded images and videos) → the token ids and pixel patches Qwen3-VL takes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..answer.tool_forms import ToolForm
from ..answer.tools import ToolCall
from ..errors import BadRequest, PromptTooLong
from ..media.images import DecodedImage
from ..media.video import DecodedVideo, video_patches, video_prompt_text

ROLES = ("system", "user", "assistant", "tool")
# Qwen's vision placeholders: typed into text they would desynchronise tokens and pixels.
VISION_MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    image: DecodedImage


@dataclass(frozen=True)
class VideoPart:
    video: DecodedVideo


@dataclass
class ChatMessage:
    role: str
    parts: list[TextPart | ImagePart | VideoPart]
    # An answer this server generated: the exact ids behind its text. Prompts use them in place of
    # the text's re-tokenization (byte-level BPE does not always give the generated ids back), so
    # the next turn's prompt extends the KV cache of this one, the answer included.
    token_ids: tuple[int, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls (role "tool" messages answer them)
    reasoning: str | None = None  # an assistant's reasoning (thinking models: templates drop it but in a tool turn)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def images(self) -> list[DecodedImage]:
        return [p.image for p in self.parts if isinstance(p, ImagePart)]

    @property
    def videos(self) -> list[DecodedVideo]:
        return [p.video for p in self.parts if isinstance(p, VideoPart)]


def pictures_of(messages: list[ChatMessage]) -> list[tuple[int, int]]:
    """The (width, height) of each picture, as the client sent it, of the latest user message that
    holds pictures: what an answer's boxes refer to."""
    for message in reversed(messages):
        if message.role == "user":
            sizes = [part.image.sent_size for part in message.parts if isinstance(part, ImagePart)]
            if sizes:
                return sizes
    return []


@dataclass(frozen=True)
class PromptLimits:
    """Per-request bounds (settings): refused with a 4xx before the request waits for the model."""

    context_limit: int
    max_prompt_tokens: int
    max_messages: int = 64
    max_images: int = 8
    max_videos: int = 2

    @classmethod
    def from_settings(cls, settings) -> PromptLimits:
        return cls(
            settings.context_limit,
            settings.max_prompt_tokens,
            settings.max_messages,
            settings.max_images_per_request,
            settings.max_videos_per_request,
        )


@dataclass(frozen=True)
class VisionSpan:
    """An image or a video inside a token sequence: [start, end) from its first <|vision_start|> to
    its last <|vision_end|>, and an identity of its pixels and grid (the same tokens with another
    picture behind them differ here)."""

    start: int
    end: int
    key: str


@dataclass
class PreparedPrompt:
    """Everything the engine's prefill needs, plus per-image data the caches key on."""

    input_ids: torch.Tensor  # 1 × L
    mm_token_type_ids: torch.Tensor  # 1 × L (1 on image pads)
    image_grid_thw: torch.Tensor | None  # n_images × 3
    pixel_values: list[torch.Tensor]  # one patch tensor per image
    image_digests: list[str]
    image_spans: list[tuple[int, int]]  # [start, end) token range of each image, <|vision_start|> … <|vision_end|>
    video_grid_thw: torch.Tensor | None = None  # n_videos × 3
    pixel_values_videos: list[torch.Tensor] = field(default_factory=list)  # one patch tensor per video
    video_digests: list[str] = field(default_factory=list)
    video_spans: list[tuple[int, int]] = field(
        default_factory=list
    )  # first frame's <|vision_start|> … last <|vision_end|>
    text: str = ""  # the rendered chat template (before the vision pads are expanded)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def visual_tokens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The visual tokens (pads) each picture and each clip takes in the prompt."""
        types = self.mm_token_type_ids[0]

        def pads(spans: list[tuple[int, int]]) -> tuple[int, ...]:
            return tuple(int((types[start:end] != 0).sum()) for start, end in spans)

        return pads(self.image_spans), pads(self.video_spans)

    @cached_property
    def spans(self) -> dict[str, list[VisionSpan]]:
        """Each image's and video's token span, named by its pixels and grid (what the caches match)."""
        images = self.image_grid_thw if self.image_grid_thw is not None else []
        videos = self.video_grid_thw if self.video_grid_thw is not None else []
        return {
            "image": [
                VisionSpan(start, end, "{}:{}x{}x{}".format(digest, *grid.tolist()))
                for (start, end), digest, grid in zip(self.image_spans, self.image_digests, images)
            ],
            "video": [
                VisionSpan(start, end, "video:{}:{}x{}x{}".format(digest, *grid.tolist()))
                for (start, end), digest, grid in zip(self.video_spans, self.video_digests, videos)
            ],
        }


_PART_TYPES = {ImagePart: "image", VideoPart: "video"}


def _arguments(text: str, xml: bool):
    """A call's arguments as the template takes them: the JSON text as the client sent it (Qwen3-VL's
    template writes it back as it is), or, for a template of the XML form (Qwen3.5's), the mapping it
    spells (the template writes a parameter per key)."""
    if not xml:
        return text
    try:
        arguments = json.loads(text or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise BadRequest("a tool call's arguments must be a JSON object", param="messages", code="invalid_tool_call")
    return arguments


def _template_messages(messages: list[ChatMessage], xml_calls: bool = False) -> list[dict]:
    rendered = []
    for m in messages:
        if m.role not in ROLES:
            raise BadRequest(f"unsupported role {m.role!r}: use one of {', '.join(ROLES)}", param="messages")
        content = [
            {"type": _PART_TYPES[type(p)]} if type(p) in _PART_TYPES else {"type": "text", "text": p.text}
            for p in m.parts
        ]
        if m.role != "user" and any(type(p) in _PART_TYPES for p in m.parts):
            raise BadRequest(f"images and videos are accepted in user messages only, not {m.role}", param="messages")
        if m.role == "assistant":  # text only; the template writes the calls after it (empty is falsy)
            calls = [
                {"type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments, xml_calls)}}
                for c in m.tool_calls
            ]
            rendered.append({"role": m.role, "content": m.text, "tool_calls": calls, "reasoning_content": m.reasoning})
        else:
            rendered.append({"role": m.role, "content": content})
    return rendered


def rendered_chat(processor, messages: list[ChatMessage]) -> str:
    """The chat template's text for `messages`, the assistant's turn opened (pictures and clips as their
    unexpanded placeholders): what `prepare_prompt` tokenizes."""
    return processor.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True)


def messages_bytes(messages: list[ChatMessage]) -> int:
    """What remembering `messages` costs: decoded pictures and clips, texts, reasoning, token ids."""
    return (
        sum(img.nbytes for m in messages for img in m.images)
        + sum(video.nbytes for m in messages for video in m.videos)
        + sum(len(getattr(p, "text", "")) for m in messages for p in m.parts)
        + sum(len(m.reasoning or "") for m in messages)
        + sum(8 * len(m.token_ids or ()) for m in messages)
    )


def validate_conversation(messages: list[ChatMessage], limits: PromptLimits) -> None:
    if not messages:
        raise BadRequest("messages must not be empty", param="messages")
    if len(messages) > limits.max_messages:
        raise BadRequest(
            f"{len(messages)} messages (history included); the limit is {limits.max_messages}",
            param="messages",
            code="too_many_messages",
        )
    images = sum(len(m.images) for m in messages)
    if images > limits.max_images:
        raise BadRequest(
            f"{images} images (history included); the limit is {limits.max_images} per request",
            param="messages",
            code="too_many_images",
        )
    videos = sum(len(m.videos) for m in messages)
    if videos > limits.max_videos:
        raise BadRequest(
            f"{videos} videos (history included); the limit is {limits.max_videos} per request",
            param="messages",
            code="too_many_videos",
        )
    for i, m in enumerate(messages):
        for part in m.parts:
            if isinstance(part, TextPart) and any(marker in part.text for marker in VISION_MARKERS):
                raise BadRequest(
                    f"text may not hold the model's image/video placeholder tokens ({', '.join(VISION_MARKERS)})",
                    param=f"messages[{i}]",
                )
    if messages[-1].role not in ("user", "system", "tool"):
        raise BadRequest("the last message must be from the user (or a tool's result)", param="messages")
    for i, m in enumerate(messages):
        if m.role == "system" and i != 0:
            raise BadRequest("a system message is accepted only first", param=f"messages[{i}]")


def tool_call_form(processor) -> ToolForm:
    """How the checkpoint's model writes a tool call, as its chat template writes one back — Qwen3.5's
    `<function=NAME>` / `<parameter=ARG>` blocks or Qwen3-VL's JSON object — and whether its tokenizer
    has the `<tool_call>` tags as tokens of their own."""
    tags = processor.tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    tag_tokens = all(isinstance(t, int) and t != processor.tokenizer.unk_token_id and t >= 0 for t in tags)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}],
        },
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    try:
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that takes no tool calls: they are never rendered back
        text = ""
    return ToolForm(xml="<function=probe>" in text, tag_tokens=tag_tokens)


def renders_tools(processor) -> bool:
    """Whether the checkpoint's chat template shows the model a `tools` list (Qwen3-VL's does)."""
    probe = [{"type": "function", "function": {"name": "probe_function_7f3a", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, tools=probe, tokenize=False, add_generation_prompt=True)
    return "probe_function_7f3a" in text


def prepare_prompt(
    processor,
    messages: list[ChatMessage],
    limits: PromptLimits,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    xml_calls: bool = False,
) -> PreparedPrompt:
    """Render the chat template (with `tools`, OpenAI tool objects, if given, `template_kwargs`:
    variables such as enable_thinking, and earlier tool calls' arguments as mappings where the
    template writes calls in the XML form: `xml_calls`), tokenize, expand image and video pads and
    patchify the (pre-sized) images and frames."""
    validate_conversation(messages, limits)
    text = processor.apply_chat_template(
        _template_messages(messages, xml_calls),
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=True,
        **(template_kwargs or {}),
    )
    rendered = text
    images = [img for m in messages for img in m.images]
    videos = [v for m in messages for v in m.videos]
    if videos:
        batch = _tokenize_with_videos(processor, text, images, videos)
    else:
        kwargs = {"images": [img.pixels for img in images]} if images else {}
        batch = processor(text=[text], return_tensors="pt", **kwargs)
    mm = batch.get("mm_token_type_ids")
    if mm is None:
        mm = torch.zeros_like(batch["input_ids"])
    input_ids, mm = _with_generated_ids(processor.tokenizer, messages, batch["input_ids"], mm)
    if input_ids.shape[1] > limits.max_prompt_tokens:
        raise PromptTooLong(
            f"the prompt is {input_ids.shape[1]} tokens; the limit is {limits.max_prompt_tokens} "
            f"(and {limits.context_limit} for prompt and answer together)",
            param="messages",
        )
    grid = batch.get("image_grid_thw")
    pixel_values: list[torch.Tensor] = []
    if images:
        pixel_values = list(torch.split(batch["pixel_values"], grid.prod(-1).tolist()))
    video_grid = batch.get("video_grid_thw")
    image_spans, video_spans = _vision_spans(mm[0], video_grid)
    return PreparedPrompt(
        input_ids=input_ids,
        mm_token_type_ids=mm,
        image_grid_thw=grid,
        pixel_values=pixel_values,
        image_digests=[img.digest for img in images],
        image_spans=image_spans,
        video_grid_thw=video_grid,
        pixel_values_videos=batch.get("pixel_values_videos", []),
        video_digests=[v.digest for v in videos],
        video_spans=video_spans,
        text=rendered,
    )


def _with_generated_ids(
    tokenizer, messages: list[ChatMessage], input_ids: torch.Tensor, mm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt with each kept answer (`ChatMessage.token_ids`) as its generated ids: the answer's
    re-tokenized text is found right after its assistant header and replaced. Where the template
    rendered it otherwise, the text's own tokens stay (a correct prompt, only less of it cached)."""
    kept = [m for m in messages if m.role == "assistant"]
    if not any(m.token_ids for m in kept):
        return input_ids, mm
    opening = tokenizer("<|im_start|>assistant", add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    ids, types = input_ids[0].tolist(), mm[0].tolist()
    starts = [i + len(opening) for i in range(len(ids) - len(opening)) if ids[i : i + len(opening)] == opening]
    out_ids, out_types, done = [], [], 0
    for message, start in zip(kept, starts):  # the k-th assistant turn opens the k-th answer
        if not message.token_ids:
            continue
        rendered = tokenizer("\n" + message.text, add_special_tokens=False)["input_ids"]
        if ids[start : start + len(rendered)] != rendered or rendered[: len(newline)] != newline:
            continue
        start += len(newline)
        out_ids += ids[done:start] + list(message.token_ids)
        out_types += types[done:start] + [0] * len(message.token_ids)
        done = start + len(rendered) - len(newline)
    out_ids, out_types = out_ids + ids[done:], out_types + types[done:]
    return torch.tensor([out_ids], dtype=input_ids.dtype), torch.tensor([out_types], dtype=mm.dtype)


def _tokenize_with_videos(processor, text: str, images: list[DecodedImage], videos: list[DecodedVideo]) -> dict:
    """What `processor(text, images, videos)` returns, with the videos prepared by service/media/video.py
    (transformers' video processor needs torchvision). The image part is the processor's own."""
    # Qwen's processor replaces the template's whole <|vision_start|><|video_pad|><|vision_end|> by
    # the per-frame layout (each frame brings its own start/end); transformers 5.24 would replace only
    # the pad, so it is handed the bare pad, as Qwen's processor accepts too.
    text = text.replace(
        processor.vision_start_token + processor.video_token + processor.vision_end_token, processor.video_token
    )
    image_inputs = (
        processor.image_processor(images=[img.pixels for img in images], return_tensors="pt") if images else {}
    )
    temporal = processor.image_processor.temporal_patch_size
    patches = [video_patches(v, processor.image_processor) for v in videos]
    video_text = [
        video_prompt_text(processor, grid[0], v.timestamps(temporal)) for v, (_, grid) in zip(videos, patches)
    ]
    image_text = [processor.replace_image_token(image_inputs, image_idx=i) for i in range(len(images))]
    (text,), _ = processor.get_text_with_replacements([text], image_text, video_text)
    input_ids = processor.tokenizer([text], return_tensors="pt", return_token_type_ids=False)["input_ids"]
    return {
        **image_inputs,
        "input_ids": input_ids,
        "mm_token_type_ids": torch.tensor(processor.create_mm_token_type_ids(input_ids)),
        "pixel_values_videos": [p for p, _ in patches],
        "video_grid_thw": torch.cat([g for _, g in patches]),
    }


def _vision_spans(
    mm_token_type_ids: torch.Tensor, video_grid_thw: torch.Tensor | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """[start, end) of each image and each video, <|vision_start|> to <|vision_end|> included.

    Runs of pads are found as the model finds them (by token type: 1 image, 2 video); a video is
    as many consecutive runs as its temporal patches, timestamps between them inside its span."""
    types = mm_token_type_ids.tolist()
    runs, i = [], 0
    while i < len(types):
        j = i
        while j < len(types) and types[j] == types[i]:
            j += 1
        if types[i]:
            runs.append((types[i], i - 1, j + 1))
        i = j
    images = [(start, end) for kind, start, end in runs if kind == 1]
    frames = [(start, end) for kind, start, end in runs if kind == 2]
    videos, k = [], 0
    for t in video_grid_thw[:, 0].tolist() if video_grid_thw is not None else []:
        videos.append((frames[k][0], frames[k + t - 1][1]))
        k += t
    return images, videos
