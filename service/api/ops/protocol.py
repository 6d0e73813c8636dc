"""What /v1/models answers, typed: the loaded model's card, and OpenAI's list of them (/openapi.json
publishes their schemas)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "local"
    quantization: str
    random_test_model: bool
    image_max_pixels: int = Field(description="clients may downscale pictures to this before uploading")
    thinking: bool = Field(description="a thinking checkpoint: its reasoning comes as reasoning_content")
    warning: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
