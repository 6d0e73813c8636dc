"""Every per-request bound, in one object built from Settings (and the processor's own image rules):
the engine enforces it, the routes decode uploads by it, /openapi.json publishes it."""

from __future__ import annotations

from dataclasses import dataclass

from .answer.tool_forms import JSON_FORM, ToolForm
from .media.images import ImageLimits, image_limits
from .media.video import VideoLimits
from .model.prompts import PromptLimits, tool_call_form
from .settings import Settings


@dataclass(frozen=True)
class RequestLimits:
    prompt: PromptLimits
    image: ImageLimits
    video: VideoLimits
    max_stop_strings: int
    default_max_tokens: int
    max_new_tokens: int  # the most a request's max_tokens may ask (HTTP: a 400 beyond); clipped to the context's room
    tool_form: ToolForm = JSON_FORM  # how the checkpoint's model writes a tool call (Qwen3-VL's JSON, Qwen3.5's XML)
    max_search_items: int = 256  # inputs of an embeddings request, documents of a rerank or score (SEARCH_MAX_ITEMS)
    max_search_pictures: int = 32  # pictures and clip frames one search request decodes (SEARCH_MAX_PICTURES)

    @classmethod
    def build(cls, settings: Settings, processor, thinking: bool = False) -> RequestLimits:
        """The bounds of requests to a checkpoint (`thinking`: a thinking one, whose default cap leaves
        room for its reasoning)."""
        image = image_limits(processor, settings)
        cap = settings.new_tokens_cap(thinking)
        return cls(
            prompt=PromptLimits.from_settings(settings),
            image=image,
            video=VideoLimits.from_settings(settings, image, processor.image_processor.temporal_patch_size),
            max_stop_strings=settings.max_stop_strings,
            default_max_tokens=min(settings.default_max_tokens, cap),
            max_new_tokens=cap,
            tool_form=tool_call_form(processor),
            max_search_items=settings.search_max_items,
            max_search_pictures=settings.search_max_pictures,
        )

    def published(self) -> dict:
        """What /openapi.json tells clients (`x-limits`)."""
        return {
            "context_limit": self.prompt.context_limit,
            "max_prompt_tokens": self.prompt.max_prompt_tokens,
            "max_messages": self.prompt.max_messages,
            "max_images_per_request": self.prompt.max_images,
            "max_videos_per_request": self.prompt.max_videos,
            "max_stop_strings": self.max_stop_strings,
            "max_new_tokens": self.max_new_tokens,
            "default_max_tokens": self.default_max_tokens,
            "image_max_bytes": self.image.max_bytes,
            "image_max_pixels": self.image.max_pixels,
            "video_max_bytes": self.video.max_bytes,
            "video_max_seconds": self.video.max_seconds,
            "max_search_items": self.max_search_items,
            "max_search_pictures": self.max_search_pictures,
        }
