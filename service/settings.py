"""The one settings object: environment variables (upper-case field names), overridden by CLI flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _available_cores() -> int:
    return len(os.sched_getaffinity(0))


class Settings(BaseSettings):
    """Every tunable of the service, with its default. Env var = the field name in upper case."""

    model_config = SettingsConfigDict(env_prefix="", case_sensitive=False, extra="ignore")

    # Model
    model_path: Path | None = Field(None, description="Qwen3-VL checkpoint directory; unset = embedded random test model")
    quantization: Literal["int8", "fp32"] = Field("int8", description="int8 = dynamic INT8 Linear layers")
    threads: int = Field(default_factory=_available_cores, ge=1, le=512, description="torch threads")
    cache_dir: Path = Field(Path(os.path.expanduser("~/.cache/qwen3vl-service")), description="embedded model, exports")

    # Images
    image_max_pixels: int = Field(448 * 448, ge=32 * 32, le=16_777_216, description="pixel budget an image is resized into")
    image_max_bytes: int = Field(20 * 1024 * 1024, ge=1024, description="largest encoded image accepted")
    image_max_decoded_pixels: int = Field(64_000_000, ge=1024, description="largest width*height decoded (bomb guard)")

    # Generation
    max_new_tokens: int = Field(1024, ge=1, description="cap on tokens generated per request")
    default_max_tokens: int = Field(256, ge=1, description="tokens generated when a request names no limit")
    context_limit: int = Field(8192, ge=64, description="prompt + new tokens, at most")

    # HTTP and admission
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_body_bytes: int = Field(25 * 1024 * 1024, ge=1024, description="largest request body")
    queue_size: int = Field(8, ge=0, description="requests waiting for the model beyond the one running")
    queue_timeout: float = Field(120.0, gt=0, description="seconds a request may wait for the model")
    conversation_history_max: int = Field(1024, ge=1, description="native-endpoint conversations remembered")
    conversation_history_ttl: float = Field(1800.0, gt=0, description="seconds an idle conversation is remembered")

    @field_validator("model_path")
    @classmethod
    def _model_dir_exists(cls, path: Path | None) -> Path | None:
        if path is None or str(path) == "":
            return None
        path = path.expanduser()
        if not path.is_dir():
            raise ValueError(f"MODEL_PATH {str(path)!r} is not a directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"MODEL_PATH {str(path)!r} has no config.json: is it a Hugging Face checkpoint?")
        return path

    @model_validator(mode="after")
    def _consistent(self) -> "Settings":
        if self.default_max_tokens > self.max_new_tokens:
            self.default_max_tokens = self.max_new_tokens
        if self.max_new_tokens >= self.context_limit:
            raise ValueError(f"MAX_NEW_TOKENS ({self.max_new_tokens}) must be below CONTEXT_LIMIT ({self.context_limit})")
        return self


class SettingsError(SystemExit):
    """Raised at start-up with a message a user can act on."""


def load_settings(**overrides) -> Settings:
    """Settings from the environment, `overrides` (CLI flags, tests) winning; readable errors."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"]).upper() or "settings"
            lines.append(f"  {name}: {err['msg']}")
        raise SettingsError("invalid settings:\n" + "\n".join(lines)) from None
