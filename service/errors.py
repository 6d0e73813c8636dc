"""The service's one error type. Each failure a client can cause carries its HTTP status here;
the HTTP layer maps it to OpenAI-shaped JSON in one handler."""

from __future__ import annotations


class ServiceError(Exception):
    """A failure with a status, an OpenAI error `type`, a machine-readable `code` and the bad `param`."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ServiceError):
    status, code = 400, "invalid_request"


class ImageError(ServiceError):
    """Bytes that are not a decodable image of a supported format."""

    status, code = 400, "invalid_image"


class VideoError(ServiceError):
    """Bytes that are not a readable clip of a supported container, or a clip with no usable frames."""

    status, code = 400, "invalid_video"


class TooLarge(ServiceError):
    status, code = 413, "too_large"


class UnsupportedMediaType(ServiceError):
    status, code = 415, "unsupported_media_type"


class PromptTooLong(ServiceError):
    status, code = 422, "context_length_exceeded"


class QueueFull(ServiceError):
    status, type, code = 429, "rate_limit_error", "queue_full"


class RateLimited(ServiceError):
    """A tenant over its requests or tokens a minute (service/api/access/rates.py)."""

    status, type, code = 429, "rate_limit_error", "rate_limited"


class StorageFull(ServiceError):
    """A tenant whose files and batches fill its share of the job store (BATCH_MAX_STORED_BYTES)."""

    status, type, code = 429, "rate_limit_error", "storage_quota_exceeded"


class Unavailable(ServiceError):
    status, type, code = 503, "service_unavailable", "unavailable"


class StoreUnavailable(Unavailable):
    """The job store cannot be used (service/jobs/guard.py): the Batch API is off, the rest serves."""

    code = "job_store_unavailable"


class SharedStateUnavailable(Unavailable):
    """The shared store (service/shared/) cannot be used now, for what must not be done on one instance
    alone (a delete, which the store would undo when it is back)."""

    code = "shared_state_unavailable"


class InternalError(ServiceError):
    """A bug: the client sees this (and the request id), the server log has the traceback."""

    status, type, code = 500, "server_error", "internal_error"

    def __init__(self, request_id: str | None):
        super().__init__(f"internal error; see the server log for request {request_id}")
