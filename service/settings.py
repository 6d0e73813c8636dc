"""The one settings object: environment variables (upper-case field names), overridden by CLI flags."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The embedded random test model's directory under CACHE_DIR (service/random_checkpoints/embedded.py
# builds it; deploy sizes it).
EMBEDDED_MODEL_DIRNAME = "embedded-tiny-qwen3-vl-3"  # -3: the chat template renders tools

# MAX_NEW_TOKENS unset: the cap of an answer, and of a thinking checkpoint's reasoning and answer — its
# reasoning alone often runs past 1,024 tokens, and Anthropic's smallest thinking budget is 1,024 (with
# max_tokens above it).
DEFAULT_MAX_NEW_TOKENS, THINKING_MAX_NEW_TOKENS = 1024, 4096


def _available_cores() -> int:
    return len(os.sched_getaffinity(0))


class Settings(BaseSettings):
    """Every tunable of the service, with its default. Env var = the field name in upper case."""

    model_config = SettingsConfigDict(env_prefix="", case_sensitive=False, extra="ignore")

    # Model
    model_path: Path | None = Field(
        None, description="Qwen3-VL checkpoint directory; unset = embedded random test model"
    )
    model_task: Literal["auto", "chat", "embedding", "rerank"] = Field(
        "auto",
        description="what the checkpoint serves: chat (Qwen3-VL, Qwen3.5), embedding (Qwen3-VL-Embedding: "
        "/v1/embeddings) or rerank (Qwen3-VL-Reranker: /v1/rerank, /v1/score); auto = told from the checkpoint "
        "(an untied one without an lm_head is an embedding model) and its directory's name (…Embedding…, "
        "…Reranker…: a reranker's files are a chat model's, so a renamed one needs this setting)",
    )
    quantization: Literal["int8", "fp32"] = Field(
        "int8",
        description="int8 = INT8 Linear layers, activations quantized per token (a 4-bit checkpoint written by "
        "`quantize --bits 4`, or a GPTQ/AWQ one, is served as it is under int8)",
    )
    int8_kernel: Literal["auto", "fbgemm", "onednn", "native"] = Field(
        "auto",
        description="INT8 kernels: auto = the fastest measured on this machine and checkpoint at the first "
        "start (kept under CACHE_DIR); fbgemm, onednn (torch's) or native (the service's own, built for "
        "this CPU) force one. The same answers bit for bit: only speed differs",
    )
    threads: int = Field(default_factory=_available_cores, ge=1, le=512, description="torch threads")
    cache_dir: Path = Field(Path(os.path.expanduser("~/.cache/qwen3vl-service")), description="embedded model, exports")
    vision_backend: Literal["torch", "onnxruntime"] = Field(
        "torch",
        description="vision encoder: torch, or onnxruntime (the `export-onnx` export; torch while "
        "there is none). ORT INT8 encodes faster (README, bench_vision) but costs memory and stalls batched streams",
    )
    vision_onnx_dir: Path | None = Field(
        None, description="ONNX export to use; unset = CACHE_DIR/onnx-vision/<checkpoint>"
    )
    kv_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16",
        description="keys and values as cached: bfloat16 (written so when computed, so a reused prefix "
        "equals a recomputed one) holds half the bytes of float32 for a decode a few per cent slower at "
        "most (bench_decode); float32 for the reference numerics; see the README",
    )
    preload: bool = Field(
        True,
        description="Gunicorn's master loads the model before forking its worker: weights "
        "shared copy-on-write, a worker that dies is replaced in about a second (not with "
        "VISION_BACKEND=onnxruntime, whose sessions do not survive a fork)",
    )
    max_memory_mb: int | None = Field(
        None,
        ge=1,
        description="memory budget in MiB (RSS minus file-backed pages); "
        "unset = the machine's (or cgroup's) memory less 10 % (at least 256 MiB), "
        "split between the deployment's instances. Near it caches are evicted, "
        "over it requests get 503",
    )

    # Images
    image_max_pixels: int = Field(
        448 * 448, ge=32 * 32, le=16_777_216, description="pixel budget an image is resized into"
    )
    image_request_max_pixels: int = Field(
        1024 * 1024,
        ge=32 * 32,
        le=16_777_216,
        description="the largest pixel budget a request may ask for its pictures (OpenAI image_url.detail=high, "
        "the native max_pixels): locating small things needs more pixels than describing a scene; "
        "IMAGE_MAX_PIXELS stays the default",
    )
    image_max_bytes: int = Field(20 * 1024 * 1024, ge=1024, description="largest encoded image accepted")
    image_max_decoded_pixels: int = Field(64_000_000, ge=1024, description="largest width*height decoded (bomb guard)")

    # Video (frames sampled with OpenCV; each frame at most IMAGE_MAX_PIXELS)
    video_fps: float = Field(2.0, gt=0, le=30, description="frames sampled per second of video")
    video_max_frames: int = Field(32, ge=2, le=768, description="frames sampled from one video, at most")
    video_max_visual_tokens: int = Field(
        1024, ge=16, description="prompt tokens one video may take; frames are shrunk to fit"
    )
    video_max_bytes: int = Field(20 * 1024 * 1024, ge=1024, description="largest video file accepted")
    video_max_seconds: float = Field(120.0, gt=0, description="longest video accepted (from its metadata)")
    video_max_source_pixels: int = Field(3840 * 2160, ge=1024, description="largest width*height of a video's frames")
    video_max_source_frames: int = Field(3600, ge=1, description="most frames a video may hold (all are decoded)")
    max_videos_per_request: int = Field(2, ge=0, description="videos in one request, history included")

    # Generation
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description=f"cap on tokens generated per request; unset = {DEFAULT_MAX_NEW_TOKENS}, or "
        f"{THINKING_MAX_NEW_TOKENS} for a thinking checkpoint (its reasoning and answer; below CONTEXT_LIMIT)",
    )
    default_max_tokens: int = Field(256, ge=1, description="tokens generated when a request names no limit")
    context_limit: int = Field(8192, ge=64, description="prompt + new tokens, at most")
    max_batch_size: int = Field(
        4, ge=1, le=64, description="sequences decoded together (continuous batching); more wait in the queue"
    )
    search_max_items: int = Field(
        256,
        ge=1,
        le=65536,
        description="inputs one /v1/embeddings request may hold, documents one /v1/rerank or /v1/score request may "
        "score (more: 400 naming the field)",
    )
    search_max_pictures: int = Field(
        32,
        ge=1,
        le=4096,
        description="pictures and clip frames one /v1/embeddings, /v1/rerank or /v1/score request may carry, counted "
        "together: the pictures before any is decoded, a clip's frames before they are (more: 400 naming the field)",
    )
    search_batch_tokens: int = Field(
        512,
        ge=16,
        le=8192,
        description="prompt tokens of many embedding or rerank inputs computed in one forward (each weight read "
        "once for all of them); a longer input is computed in pieces of this size — the same bits either way",
    )
    prefill_chunk_tokens: int = Field(
        128,
        ge=1,
        description="prompt tokens prefilled per step between the "
        "batch's decode steps (each step reads every weight once: larger pieces "
        "prefill faster, smaller ones pause running streams less)",
    )
    state_snapshot_tokens: int = Field(
        1024,
        ge=0,
        description="a hybrid model's (Qwen3.5) recurrent state is kept every this many prompt tokens, as well "
        "as where each turn starts and where the prompt ends, so that a later request sharing the prefix "
        "resumes there instead of recomputing it (each copy holds the state's bytes: 19.3 MiB on Qwen3.5-2B); "
        "0: turn starts and prompt ends only",
    )
    speculative: Literal["on", "off"] = Field(
        "on",
        description="exact speculative decoding: guessed tokens (a grammar's forced ones, a checkpoint's "
        "multi-token prediction head or prompt lookup) "
        "verified in the decode step's one pass; greedy answers are the same bits with it on or off. "
        "INT8 weights only (fp32 GEMMs compute a few rows one at a time: no gain). A request's "
        "`speculative: false` turns it off for that request",
    )
    speculative_tokens: int = Field(
        4, ge=0, le=8, description="guessed tokens a sequence may verify per decode step, at most"
    )
    mtp_drafting: Literal["on", "off"] = Field(
        "on",
        description="a checkpoint's multi-token prediction head (Qwen3.5's `mtp.*` tensors) guesses the tokens "
        "exact speculative decoding verifies, instead of prompt lookup; off: the head is not loaded",
    )

    # Caches (per process): conversation KV cache and vision-feature cache
    cache_enabled: bool = Field(True, description="False turns both caches off (every prompt computed in full)")
    conversation_cache_max_bytes: int | None = Field(
        None,
        ge=0,
        description="KV bytes kept across turns; 0 = off; unset = 60 % of what the memory budget leaves after loading",
    )
    conversation_cache_max_entries: int = Field(64, ge=0, description="KV caches kept (one per conversation)")
    vision_cache_max_bytes: int | None = Field(
        None,
        ge=0,
        description="vision-encoder output bytes kept; 0 = off; "
        "unset = 10 % of what the memory budget leaves after loading",
    )
    vision_cache_max_entries: int = Field(512, ge=0, description="images whose features are kept")
    cache_ttl_seconds: float = Field(1800.0, gt=0, description="idle seconds before a cache entry is dropped")
    kv_disk_mb: int | None = Field(
        None,
        ge=0,
        description="the conversation cache's disk tier (keys and values of every kept conversation, shared "
        "by the instances of the machine, kept across restarts), in MiB; 0 = off; unset = a quarter of "
        "the disk's free space (what the store holds counted free), at most 64 GiB",
    )
    kv_disk_dir: Path | None = Field(None, description="the disk tier's folder; unset = CACHE_DIR/kv")
    kv_disk_read_timeout_share: float = Field(
        0.5,
        gt=0,
        description="a disk-tier read may take this share of what recomputing its tokens would cost (at this "
        "instance's measured prefill speed; at least 1 s), then it counts as a miss and the request recomputes",
    )

    # HTTP and admission
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    bind: str | None = Field(None, description="Gunicorn's bind address (host:port); unset = HOST:PORT")
    graceful_timeout: int = Field(30, ge=1, description="seconds in-flight requests get on SIGTERM")
    access_log: bool = Field(False, description="Gunicorn's access log on stdout (the app logs each request anyway)")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="log level of Gunicorn and the service"
    )
    max_body_bytes: int = Field(25 * 1024 * 1024, ge=1024, description="largest request body")
    queue_size: int = Field(8, ge=0, description="requests waiting for the model beyond the running batch")
    queue_timeout: float = Field(120.0, gt=0, description="seconds a request may wait for the model")
    priority_aging_seconds: float = Field(
        30.0,
        gt=0,
        description="seconds in the server that make a request one `priority` more urgent (nothing waits forever)",
    )
    # Batch jobs (OpenAI's Batch API): a durable store; every instance runs lines when it has room
    job_store_url: str | None = Field(
        None,
        description="redis://host:port/db for every machine's instances, or sqlite:///path; "
        "default: CACHE_DIR/jobs.sqlite3, shared by one machine's instances",
    )
    batch_runner: bool = Field(True, description="this instance runs batch lines when its batch has room")
    batch_priority: int = Field(10, ge=-1000, le=1000, description="the `priority` batch lines run at")
    batch_concurrency: int | None = Field(
        None, ge=1, description="batch lines this instance runs at once (default MAX_BATCH_SIZE)"
    )
    batch_max_file_bytes: int = Field(100 * 1024**2, ge=1024, description="largest file POST /v1/files takes")
    batch_max_lines: int = Field(50_000, ge=1, description="lines a batch file may hold")
    batch_max_active: int = Field(16, ge=1, description="batches an API key may have in progress at once")
    batch_lease_seconds: float = Field(
        60.0, gt=0, description="an instance's hold on a running line; a dead instance's lines run again after it"
    )
    batch_max_attempts: int = Field(3, ge=1, description="starts of a line whose instance keeps dying, then it fails")
    batch_file_ttl: int = Field(
        30 * 86400,
        ge=1,
        description="seconds an uploaded file, or a batch's output and error files, are kept when the request "
        "sets no expires_after (OpenAI's default for batch files: 30 days)",
    )
    batch_max_stored_bytes: int = Field(
        4 * 1024**3,
        ge=1024,
        description="bytes one tenant's files and running batches' requests may hold in the job store",
    )
    shared_state: bool = Field(
        True,
        description="where JOB_STORE_URL names Redis, native histories, stored responses and conversations live "
        "there too (per tenant, within the bounds below), so any instance on any machine continues any "
        "conversation; false, or without Redis: each instance keeps its own (and CACHE_DIR's disk copies)",
    )
    instance_name: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=128,
        description="this instance's name in the shared store, by which an affinity miss (a conversation whose "
        "last turn ran on another instance) is counted; default the host name (a Kubernetes pod's name; "
        "`python -m service.deploy` appends each instance's index)",
    )
    conversation_history_max: int = Field(1024, ge=1, description="native-endpoint conversations remembered")
    conversation_history_ttl: float = Field(1800.0, gt=0, description="seconds an idle conversation is remembered")
    conversation_history_max_bytes: int = Field(512 * 1024**2, ge=0, description="bytes of remembered histories")
    responses_max: int = Field(1024, ge=1, description="Responses API: stored responses kept (store: true)")
    responses_ttl: float = Field(3600.0, gt=0, description="seconds an unused stored response is kept")
    responses_max_bytes: int = Field(
        256 * 1024**2, ge=0, description="bytes of stored responses and their conversations (pictures decoded)"
    )
    conversations_max: int = Field(
        1024, ge=1, description="OpenAI Conversations (/v1/conversations) kept, least recently used dropped first"
    )
    conversations_ttl: float = Field(
        30 * 86400.0, gt=0, description="seconds an unused conversation is kept (30 days, as OpenAI keeps batch files)"
    )
    conversations_max_bytes: int = Field(
        256 * 1024**2, ge=0, description="bytes of conversations: their items and messages (pictures count)"
    )

    # Deployment (python -m service.deploy): Nginx in front of instances on HOST:PORT, PORT+1, ...
    instances: int = Field(
        0,
        ge=0,
        description="Gunicorn instances, each pinned to its own cores; 0 = one per "
        "CORES_PER_INSTANCE cores of each NUMA node, as many as the memory holds",
    )
    cores_per_instance: int = Field(
        16,
        ge=1,
        description="cores one planned instance gets (INSTANCES=0): decoding "
        "is batched inside an instance, so more instances mostly buy copies of the "
        "weights; see the README's instance plan",
    )
    nginx_listen: str = Field("127.0.0.1:8080", description="the address Nginx listens on")
    proxy_read_timeout: float = Field(900.0, gt=0, description="seconds Nginx waits for an instance's next byte")
    start_timeout: float = Field(
        900.0, gt=0, description="seconds the deploy waits for every instance to load its model before it gives up"
    )

    # Security and per-request limits
    api_keys: SecretStr = Field(
        SecretStr(""),
        description="comma-separated keys, each optionally named `name:key` (a name is a tenant: "
        "service/api/access/tenants.py); empty = no authentication",
    )
    api_keys_file: Path | None = Field(
        None,
        description="a file of `name key [slots=N] [queue=N] [rpm=N] [tpm=N]` lines, beside API_KEYS; "
        "re-read on SIGHUP without a restart",
    )
    tenant_max_slots: int | None = Field(
        None,
        ge=1,
        description="batch places one tenant's requests may hold while another tenant's wait; "
        "unset = half of MAX_BATCH_SIZE (at least 1)",
    )
    tenant_max_queue: int | None = Field(
        None,
        ge=1,
        description="queue places one tenant's requests may take when there are several tenants; "
        "unset = half of QUEUE_SIZE (at least 1)",
    )
    cors_origins: str = Field(
        "",
        description="comma-separated origins (https://app.example.com) whose pages may call the API from a "
        "browser, or * for any; empty = none (CORS off)",
    )
    max_images_per_request: int = Field(8, ge=0, description="images in one request, history included")
    max_messages: int = Field(64, ge=1, description="messages in one request, history included")
    max_prompt_tokens: int = Field(6144, ge=1, description="prompt tokens (clipped to CONTEXT_LIMIT - 1)")
    max_stop_strings: int = Field(4, ge=0, description="stop strings in one request")
    request_deadline: float = Field(600.0, gt=0, description="seconds a generation may run before it is ended")

    def new_tokens_cap(self, thinking: bool) -> int:
        """The most tokens a request may generate: MAX_NEW_TOKENS, else the default for the checkpoint
        (`thinking`: a thinking one, model/thinking.py)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return min(THINKING_MAX_NEW_TOKENS, self.context_limit - 1) if thinking else DEFAULT_MAX_NEW_TOKENS

    @property
    def preload_in_master(self) -> bool:
        """Whether Gunicorn loads the model in its master, before the fork (gunicorn.conf.py, wsgi.py)."""
        return self.preload and self.vision_backend == "torch"

    @property
    def batch_upload_bytes(self) -> int:
        """The largest POST /v1/files body: a batch file and the multipart form around it."""
        return self.batch_max_file_bytes + 64 * 1024

    @property
    def keys_required(self) -> bool:
        """Whether requests need an API key (API_KEYS or API_KEYS_FILE set)."""
        return bool(self.api_keys.get_secret_value().strip(" ,")) or self.api_keys_file is not None

    @property
    def cors_origin_list(self) -> list[str]:
        return [o.strip().rstrip("/") for o in self.cors_origins.split(",") if o.strip()]

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

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case(cls, value):
        return value.lower() if isinstance(value, str) else value

    @field_validator("vision_onnx_dir", "kv_disk_dir", "job_store_url", "api_keys_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        return None if value == "" else value

    @field_validator("job_store_url")
    @classmethod
    def _a_store_we_open(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://", "sqlite:///")):
            raise ValueError(f"JOB_STORE_URL must be redis://host:port/db or sqlite:///path, not {url!r}")
        return url

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        self.max_prompt_tokens = min(self.max_prompt_tokens, self.context_limit - 1)
        cap = self.new_tokens_cap(thinking=False)
        if cap >= self.context_limit:
            raise ValueError(f"MAX_NEW_TOKENS ({cap}) must be below CONTEXT_LIMIT ({self.context_limit})")
        if self.video_max_visual_tokens < 4 * -(-self.video_max_frames // 2):
            raise ValueError(
                f"VIDEO_MAX_VISUAL_TOKENS ({self.video_max_visual_tokens}) must give each pair of the "
                f"VIDEO_MAX_FRAMES ({self.video_max_frames}) frames at least 4 tokens"
            )
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
