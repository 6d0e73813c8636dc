"""The service's own Qwen3-VL processor: transformers' `Qwen3VLProcessor` with its PIL image processor
(`Qwen2VLImageProcessorPil`), for what serving uses of them, with the same output bit for bit
(tests/test_processor.py checks it against transformers' own).

Why: `transformers.processing_utils` and `transformers.image_processing_utils` import
`transformers.modeling_utils` (and torch._dynamo), seconds of every start. This module imports from
transformers only the tokenizer, `transformers.utils.chat_template_utils` (the chat template is rendered
by the machinery transformers uses) and `transformers.image_utils`.

Not mirrored: videos (service/media/video.py prepares them), `tokenize=True` chat templates, control
token sanitizing, per-call image processor overrides. Images are HxWxC uint8 arrays (what
service/media/images.py decodes and resizes, with the resize here: transformers' own, smart_resize
then Pillow); the service's processor is told not to resize them again (fit_processor).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer
from transformers.image_utils import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ChannelDimension,
    SizeDict,
    infer_channel_dimension_format,
)
from transformers.utils.chat_template_utils import (
    _CONTROL_TOKEN_START,
    _normalize_chat_messages,
    render_jinja_template,
)

from ..media.images import BICUBIC, resize_to, smart_resize

_UNMARKED = f"(?<!{_CONTROL_TOKEN_START})"  # processing_utils: a placeholder not marked as user text
# TextKwargs the processor copies from the tokenizer's init kwargs into its tokenizer call
# (ProcessorMixin._merge_kwargs, step 5): the tokenizer's own values, so the call means the same.
_TEXT_KWARGS = (
    "add_special_tokens",
    "padding",
    "truncation",
    "max_length",
    "stride",
    "is_split_into_words",
    "pad_to_multiple_of",
    "return_token_type_ids",
    "return_attention_mask",
    "return_overflowing_tokens",
    "return_special_tokens_mask",
    "return_offsets_mapping",
    "return_length",
    "verbose",
    "padding_side",
)


class ImageProcessor:
    """`Qwen2VLImageProcessorPil` for uint8 pictures: resize, rescale, normalize, patchify.

    Rescale then normalize is a function of each (channel, byte) alone, done by transformers in
    float64 (rescale, rounded to float32) then float32 (normalize): a 256-entry table per channel,
    computed with those very operations, gives the same bits in one pass."""

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        self.do_resize = bool(config.get("do_resize", True))
        self.resample = config.get("resample", BICUBIC)
        self.do_rescale = bool(config.get("do_rescale", True))
        self.rescale_factor = config.get("rescale_factor", 1 / 255)
        self.do_normalize = bool(config.get("do_normalize", True))
        self.image_mean = _channels(config.get("image_mean", OPENAI_CLIP_MEAN))
        self.image_std = _channels(config.get("image_std", OPENAI_CLIP_STD))
        self.do_convert_rgb = bool(config.get("do_convert_rgb", True))
        self.patch_size = int(config.get("patch_size", 14))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        size = config.get("size")
        size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280} if size is None else dict(size)
        if config.get("min_pixels") is not None:  # backward compatibility, as transformers reads them
            size["shortest_edge"] = config["min_pixels"]
            size.pop("min_pixels", None)
        if config.get("max_pixels") is not None:
            size["longest_edge"] = config["max_pixels"]
            size.pop("max_pixels", None)
        self.size = SizeDict(**size)
        self._tables: dict[tuple, np.ndarray] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        file = Path(path) / "preprocessor_config.json"
        if not file.exists():
            raise ValueError(f"{path} has no preprocessor_config.json")
        return cls(json.loads(file.read_text()))

    def __call__(self, images, return_tensors: str | None = "pt", **kwargs) -> dict:
        if kwargs:
            raise TypeError(f"unsupported image processor arguments: {', '.join(sorted(kwargs))}")
        all_patches, all_grids = [], []
        for image in _flat_images(images):
            image = self._channels_first(image)
            if self.do_resize:
                image = self.resize(image)
            patches, grid_h, grid_w = self._patchify(self._scaled(image))
            all_patches.append(patches)
            all_grids.append([1, grid_h, grid_w])
        pixel_values = np.concatenate(all_patches, axis=0)
        image_grid_thw = np.array(all_grids, dtype=np.int64)
        if return_tensors == "pt":
            return {"pixel_values": torch.from_numpy(pixel_values), "image_grid_thw": torch.from_numpy(image_grid_thw)}
        if return_tensors in (None, "np"):
            return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
        raise ValueError(f"return_tensors={return_tensors!r}: only 'pt', 'np' or None")

    def _channels_first(self, image) -> np.ndarray:
        """PilBackend.process_image for an array: RGB (as convert_to_rgb), channels first."""
        image = np.asarray(image)
        if image.dtype != np.uint8:
            raise ValueError(f"images must be uint8 arrays (got {image.dtype})")
        if image.ndim != 3:
            raise ValueError(f"images must be H x W x C arrays (got shape {image.shape})")
        channels_first = infer_channel_dimension_format(image, num_channels=(1, 3, 4)) == ChannelDimension.FIRST
        if self.do_convert_rgb:
            image = np.moveaxis(image, 0, -1) if channels_first else image
            if image.shape[-1] == 1:
                image = np.repeat(image, 3, axis=-1)
            elif image.shape[-1] == 4:  # alpha composited onto white, as transformers' convert_to_rgb
                alpha = image[..., 3:4] / 255
                image = np.round(alpha * image[..., :3] + (1 - alpha) * 255).astype(np.uint8)
            return np.moveaxis(image, -1, 0)
        return image if channels_first else np.moveaxis(image, -1, 0)

    def resize(self, image: np.ndarray) -> np.ndarray:
        """smart_resize to multiples of patch_size * merge_size within size's pixel bounds, by Pillow
        (transformers' PIL backend); an image already at that size is left as it is (Pillow copies it)."""
        size = self.size
        if not size.shortest_edge or not size.longest_edge:
            raise ValueError(f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {size}.")
        height, width = image.shape[-2:]
        factor = self.patch_size * self.merge_size
        target = smart_resize(height, width, factor, size.shortest_edge, size.longest_edge)
        if target == (height, width):
            return image
        last = np.ascontiguousarray(np.moveaxis(image, 0, -1))
        last = last[..., 0] if last.shape[-1] == 1 else last
        resized = resize_to(last, (target[1], target[0]), self.resample)
        resized = resized[..., None] if resized.ndim == 2 else resized
        return np.moveaxis(resized, -1, 0)

    def _table(self, channels: int) -> np.ndarray:
        """(channels, 256) float32: what rescale then normalize make of each byte in each channel,
        computed with transformers' own operations (image_transforms.rescale, .normalize)."""
        key = (channels, self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean, self.image_std)
        table = self._tables.get(key)
        if table is None:
            values = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 256))
            if self.do_rescale:
                values = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
            if self.do_normalize:
                values = values if np.issubdtype(values.dtype, np.floating) else values.astype(np.float32)
                mean = np.array(_per_channel(self.image_mean, channels), dtype=values.dtype)
                std = np.array(_per_channel(self.image_std, channels), dtype=values.dtype)
                values = ((values.T - mean) / std).T
            table = np.ascontiguousarray(values, dtype=np.float32)
            self._tables = {key: table}
        return table

    def _scaled(self, image: np.ndarray) -> np.ndarray:
        table = self._table(image.shape[0])
        return table[np.arange(image.shape[0])[:, None, None], image]

    def _patchify(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        """Qwen2VLImageProcessorPil.patchify: rows (merge blocks, then merge rows/cols), each row
        C x temporal x patch x patch with the picture repeated along time."""
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, height, width = image.shape
        grid_h, grid_w = height // patch, width // patch
        patches = image.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        patches = np.transpose(patches, (1, 4, 2, 5, 0, 3, 6))
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], temporal, *patches.shape[5:]))
        return patches.reshape(grid_h * grid_w, channels * temporal * patch * patch), grid_h, grid_w


def chat_template_of(tokenizer, path: Path) -> str:
    """The checkpoint's chat template: the tokenizer's, else the file chat_template.jinja."""
    chat_template = tokenizer.chat_template
    template_file = Path(path) / "chat_template.jinja"
    if chat_template is None and template_file.exists():
        chat_template = template_file.read_text()
    if chat_template is None:
        raise ValueError(f"{path} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return chat_template


class Processor:
    """`Qwen3VLProcessor` (without a video processor) for what the service uses of it."""

    video_processor = None

    def __init__(self, tokenizer, image_processor: ImageProcessor, chat_template: str | dict | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.vision_start_token = getattr(tokenizer, "vision_start_token", "<|vision_start|>")
        self.vision_end_token = getattr(tokenizer, "vision_end_token", "<|vision_end|>")
        self.image_token_id = self._token_id("image_token_id", self.image_token)
        self.video_token_id = self._token_id("video_token_id", self.video_token)
        self.vision_start_token_id = self._token_id("vision_start_token_id", self.vision_start_token)
        self.vision_end_token_id = self._token_id("vision_end_token_id", self.vision_end_token)

    def _token_id(self, attribute: str, token: str):
        return getattr(self.tokenizer, attribute, None) or self.tokenizer.convert_tokens_to_ids(token)

    @classmethod
    def load(cls, path: str | Path) -> Processor:
        """The checkpoint's tokenizer, image processor and chat template (the tokenizer's, else
        chat_template.jinja), as service/model/loading.py used to build transformers' processor."""
        path = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(tokenizer, ImageProcessor.from_pretrained(path), chat_template_of(tokenizer, path))

    @property
    def image_token_ids(self) -> list[int | None]:
        return [self.image_token_id]

    @property
    def video_token_ids(self) -> list[int | None]:
        return [self.video_token_id]

    @property
    def all_special_multimodal_tokens(self) -> list[str]:
        return [t for t in (self.image_token, self.video_token) if t is not None]

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    # -- chat template ------------------------------------------------------------------------------

    def _resolve_chat_template(self, chat_template: str | None) -> str:
        templates = self.chat_template
        if chat_template is None:
            if isinstance(templates, dict) and "default" in templates:
                return templates["default"]
            if isinstance(templates, dict):
                raise ValueError(
                    'The processor has multiple chat templates but none of them are named "default": pass '
                    f"`chat_template`, one of {', '.join(templates)}"
                )
            if templates is not None:
                return templates
            raise ValueError("Cannot use apply_chat_template because this processor does not have a chat template.")
        if isinstance(templates, dict) and chat_template in templates:
            return templates[chat_template]
        return chat_template

    def apply_chat_template(
        self,
        conversation,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict[str, str]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = False,
        **kwargs,
    ):
        """ProcessorMixin.apply_chat_template with tokenize=False: the rendered prompt (a list of them
        for a batch of conversations); `kwargs` are template variables (enable_thinking, ...)."""
        if tokenize:
            raise ValueError("apply_chat_template renders text only (tokenize=False): call the processor on it")
        for unsupported in ("return_assistant_tokens_mask", "sanitize_control_tokens", "return_dict"):
            if kwargs.pop(unsupported, False):
                raise ValueError(f"apply_chat_template: {unsupported} is not supported")
        for ignored in ("processor_kwargs", "return_tensors", "load_audio_from_video"):
            kwargs.pop(ignored, None)  # only for tokenize=True in transformers
        chat_template = self._resolve_chat_template(chat_template)
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when "
                "you want the model to continue the final message, and add_generation_prompt when you want to add a "
                "header that will prompt it to start a new assistant message instead."
            )
        conversations, is_batched = _normalize_conversations(conversation)
        prompt, _ = render_jinja_template(
            conversations=conversations,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            return_assistant_tokens_mask=False,
            continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt,
            **{**self.tokenizer.special_tokens_map, **kwargs},
        )
        return prompt if is_batched else prompt[0]

    # -- text and pictures ----------------------------------------------------------------------------

    def __call__(self, images=None, text=None, videos=None, return_tensors: str | None = None, **kwargs) -> dict:
        """input_ids (and what else the tokenizer returns), mm_token_type_ids and, with images,
        pixel_values and image_grid_thw: what Qwen3VLProcessor returns for them."""
        if videos is not None:
            raise ValueError("this processor has no video processor: service/media/video.py prepares videos")
        if kwargs:
            raise TypeError(f"unsupported processor arguments: {', '.join(sorted(kwargs))}")
        if images is None and text is None:
            raise ValueError("You need to provide at least one input to call Processor")
        if text is not None:
            text = [text] if isinstance(text, str) else list(text)
            if not all(isinstance(sample, str) for sample in text):
                raise ValueError("`text` must be a string or list of strings.")
            self._check_placeholders(text, images)
        processed_images, replacements = {}, []
        if images is not None:
            processed_images = self.image_processor(images, return_tensors=return_tensors)
            count = len(processed_images["image_grid_thw"])
            replacements = [self.replace_image_token(processed_images, image_idx=i) for i in range(count)]
        text_inputs = {}
        if text is not None:
            text, _ = self.get_text_with_replacements(text, replacements)
            init = self.tokenizer.init_kwargs
            defaults = {key: getattr(self.tokenizer, key, init[key]) for key in _TEXT_KWARGS if key in init}
            text_kwargs = {"return_token_type_ids": False, **defaults, "return_tensors": return_tensors}
            text_inputs = dict(self.tokenizer(text, **text_kwargs))
            self._check_token_counts(text, text_inputs["input_ids"])
            mm = self.create_mm_token_type_ids(text_inputs["input_ids"])
            text_inputs["mm_token_type_ids"] = _as_tensor(mm, return_tensors)
        return {**text_inputs, **processed_images}

    def _check_placeholders(self, text: list[str], images) -> None:
        """ProcessorMixin.validate_inputs: as many image pads as pictures, no video pads."""
        n_images = sum(sample.count(self.image_token) for sample in text)
        if images is not None:
            given = len(_flat_images(images))
            if n_images != given:
                raise ValueError(
                    f"The total number of {self.image_token} tokens in the prompts should be the same as the number "
                    f"of images passed. Found total {n_images} {self.image_token} tokens and {given} images."
                )
        elif n_images:
            raise ValueError(f"Found {n_images} {self.image_token} tokens in the text but no images were passed.")
        n_videos = sum(sample.count(self.video_token) for sample in text)
        if n_videos:
            raise ValueError(f"Found {n_videos} {self.video_token} tokens in the text but no videos were passed.")

    def _check_token_counts(self, text: list[str], input_ids) -> None:
        """ProcessorMixin._check_special_mm_tokens: truncation must not have cut placeholders."""
        rows = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
        for modality, token, token_id in (
            ("image", self.image_token, self.image_token_id),
            ("video", self.video_token, self.video_token_id),
        ):
            if token is None or token_id is None:
                continue
            ids_count = [list(ids).count(token_id) for ids in rows]
            text_count = [len(re.findall(_UNMARKED + re.escape(token), sample)) for sample in text]
            if ids_count != text_count:
                raise ValueError(
                    f"Mismatch in `{modality}` token count between text and `input_ids`. Got ids={ids_count} and "
                    f"text={text_count}. Likely due to `truncation='max_length'`. Please disable truncation or "
                    "increase `max_length`."
                )

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        """The pads that stand for picture `image_idx`: one per merged patch."""
        merge_length = self.image_processor.merge_size**2
        num_image_tokens = image_inputs["image_grid_thw"][image_idx].prod() // merge_length
        return self.image_token * num_image_tokens

    def get_text_with_replacements(
        self,
        text: list[str],
        images_replacements: list[str] = (),
        videos_replacements: list[str] = (),
        audio_replacements: list[str] = (),
    ) -> tuple[list[str], list[list[dict]]]:
        """ProcessorMixin.get_text_with_replacements: the i-th image (video) placeholder across the
        batch becomes images_replacements[i] (videos_replacements[i]); `text` is changed in place and
        returned with the replacements' offsets."""
        if not self.all_special_multimodal_tokens:
            return text, []
        groups = []
        if len(images_replacements) > 0 and self.image_token is not None:
            groups.append(f"(?P<image>{_UNMARKED}{re.escape(self.image_token)})")
        if len(videos_replacements) > 0 and self.video_token is not None:
            groups.append(f"(?P<video>{_UNMARKED}{re.escape(self.video_token)})")
        pattern = "|".join(groups) or r"(?!)"
        replacements = {"image": iter(images_replacements), "video": iter(videos_replacements)}
        batch_offsets = []
        for i, sample in enumerate(text):
            last = offset = 0
            offsets, pieces = [], []
            for m in re.finditer(pattern, sample):
                start, end = m.span()
                pieces.append(sample[last:start])
                replacement = next(replacements[m.lastgroup])
                offsets.append(
                    {
                        "type": m.lastgroup,
                        "span": (start, end),
                        "new_span": (start + offset, start + offset + len(replacement)),
                        "text": m.group(),
                        "replacement": replacement,
                    }
                )
                pieces.append(replacement)
                offset += len(replacement) - (end - start)
                last = end
            pieces.append(sample[last:])
            text[i] = "".join(pieces)
            batch_offsets.append(offsets)
        return text, batch_offsets

    def create_mm_token_type_ids(self, input_ids) -> list[list[int]]:
        """Per token: 0 text, 1 image pad, 2 video pad (ProcessorMixin.create_mm_token_type_ids)."""
        out = []
        for row in input_ids:
            row = np.array(row if isinstance(row, list) else row.tolist())
            types = np.zeros_like(row)
            types[np.isin(row, [t for t in self.image_token_ids if t is not None])] = 1
            types[np.isin(row, [t for t in self.video_token_ids if t is not None])] = 2
            out.append(types.tolist())
        return out


def _channels(values) -> float | tuple[float, ...]:
    return tuple(values) if isinstance(values, (list, tuple)) else values


def _per_channel(values, channels: int) -> list[float]:
    if isinstance(values, Iterable):
        values = list(values)
        if len(values) != channels:
            raise ValueError(f"mean and std must have {channels} elements, got {len(values)}")
        return values
    return [values] * channels


def _flat_images(images) -> list:
    """transformers' make_flat_list_of_images for arrays: one picture, a list, or a list of lists."""
    if isinstance(images, (list, tuple)):
        flat = []
        for item in images:
            flat.extend(item if isinstance(item, (list, tuple)) else [item])
        return flat
    images = np.asarray(images)
    return list(images) if images.ndim == 4 else [images]


def _normalize_conversations(conversation) -> tuple[list, bool]:
    """ProcessorMixin._normalize_conversations: a batch or one conversation, messages as dicts without
    None values, OpenAI image_url blocks as image blocks."""
    is_batched = isinstance(conversation, (list, tuple)) and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
    )
    conversations = [_normalize_chat_messages(c) for c in (conversation if is_batched else [conversation])]
    for messages in conversations:
        for message in messages:
            if not isinstance(message.get("content"), list):
                continue
            content = []
            for block in message["content"]:
                if isinstance(block, dict) and block.get("type") == "image_url" and "image_url" in block:
                    info = block["image_url"]
                    content.append({"type": "image", "url": info.get("url", "") if isinstance(info, dict) else info})
                else:
                    content.append(block)
            message["content"] = content
    return conversations, is_batched


def _as_tensor(rows: list[list[int]], return_tensors: str | None):
    if return_tensors == "pt":
        return torch.tensor(rows)
    if return_tensors == "np":
        return np.array(rows)
    return rows
