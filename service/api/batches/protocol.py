"""The Files and Batches API, typed for /openapi.json: OpenAI's File and Batch objects and their lists as
the routes send them (service/jobs/store.py writes them: `StoredFile.public`, `batch_object`), and the
body of POST /v1/batches as serving.create checks it (each refusal a 400 naming its field). An upload is
a multipart form (its schema: openapi.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from ..schemas import Lenient

ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")
PURPOSES = ("batch", "user_data", "vision")  # what uploads may say; only `batch` files make batches
MAX_METADATA = 16
MIN_EXPIRY, MAX_EXPIRY = 3600, 30 * 86400  # OpenAI's bounds on expires_after.seconds

Metadata = dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]]


class ExpiresAfter(Lenient):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY, le=MAX_EXPIRY)


class BatchCreate(Lenient):
    """POST /v1/batches: a batch of an uploaded `batch` file's lines, all to one endpoint."""

    input_file_id: str
    endpoint: Literal[ENDPOINTS]
    completion_window: str = Field("24h", pattern=r"^[1-9][0-9]{0,2}h$", description="hours, at most 168h")
    metadata: Metadata | None = Field(None, max_length=MAX_METADATA)
    output_expires_after: ExpiresAfter | None = Field(None, description="the output and error files' expiry")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal[PURPOSES]
    status: Literal["processed"] = "processed"
    status_details: None = None
    expires_at: int | None = Field(description="when it is deleted (null: kept until deleted)")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: Literal[ENDPOINTS]
    input_file_id: str
    completion_window: str
    status: Literal["in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    errors: dict | None
    metadata: dict[str, str] | None
    request_counts: RequestCounts
    model: str | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
