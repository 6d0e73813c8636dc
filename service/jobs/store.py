"""The job store's contract: what the Batch API keeps, and the rules every backend follows.

- **Files** (`POST /v1/files`): bytes with a name and a purpose, owned by the key that uploaded them,
  kept until their `expires_at` (or deleted). A file's content is written and read in chunks.
- **Batches**: OpenAI's Batch object (status, timestamps, `request_counts`, output and error file
  ids) and its lines, each `pending` → `leased` (an instance runs it) → `done` (its result line
  written) — or `skipped` (cancelled or expired) before it ran.
- **Leases.** An instance claims a pending line for `lease` seconds and renews the lease while the
  line runs; a line whose lease expired (its instance died) is claimed again by any instance, at most
  `max_attempts` times in all, then failed. Execution is at least once; the result is written once:
  `finish` writes only while the caller still holds the lease, so a second run of the same line
  (its first instance was only slow) changes nothing.
- **Fair claims.** The owners with pending lines take turns, one line each (a line whose lease ran
  out first); within an owner, its oldest batch first, in input order. A claim is a few index seeks.
- When a batch's last line is done the instance that finished it writes the output file (the
  successful lines, in input order) and the error file (the failed ones), and the batch is
  `completed` (or `cancelled` after a cancel: what had finished is kept). Its lines (request bodies
  and results) are then deleted; the batch object is kept as long as its output files.
- **Retention.** A file expires at its `expires_at`; deleting (or the expiry of) a batch's input file
  cancels the batch if it still runs, and its request bodies go. Each owner's files and running
  batches' request bodies fit in a quota of bytes.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

# Batch statuses (OpenAI's): validating and failed happen at creation, in the HTTP layer.
IN_PROGRESS, FINALIZING, COMPLETED, EXPIRED = "in_progress", "finalizing", "completed", "expired"
CANCELLING, CANCELLED = "cancelling", "cancelled"
ENDED = (COMPLETED, EXPIRED, CANCELLED, "failed")
# Line states
PENDING, LEASED, DONE, SKIPPED = "pending", "leased", "done", "skipped"  # skipped: cancelled or expired first


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def owner_of(api_key: str) -> str:
    """Who owns files and batches: a hash of the API key that made them ("" without keys)."""
    return hashlib.blake2b(api_key.encode(), digest_size=12, person=b"qwen3vl-owner").hexdigest() if api_key else ""


@dataclass(frozen=True)
class StoredFile:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    owner: str = ""
    expires_at: int | None = None  # None: kept until deleted (files made before files expired)

    def public(self) -> dict:
        """OpenAI's File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": self.expires_at,
        }


@dataclass(frozen=True)
class Line:
    """One input line as the batch holds it: its index, custom_id and request body (JSON text), or
    the error line it already failed with (a line that could not be read: it never runs)."""

    index: int
    custom_id: str
    body: str
    failed: str | None = None


@dataclass(frozen=True)
class Claim:
    """A line an instance leased: run `body`, then `finish` it while the lease holds."""

    batch_id: str
    index: int
    custom_id: str
    body: str
    worker: str
    attempt: int
    endpoint: str = "/v1/chat/completions"
    owner: str = ""  # the batch's: its tenant's fair share and caches (service/api/access/tenants.py)


@dataclass
class NewBatch:
    """What the HTTP layer checked and hands the store: `lines` may be iterated more than once (one at a
    time); `output_ttl`: the seconds its output and error files are kept once written (and the batch
    object with them)."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    window_seconds: int
    metadata: dict | None
    lines: Iterable[Line]
    output_ttl: int
    created_at: int = field(default_factory=lambda: int(time.time()))


def result_line(custom_id: str, status: int, body: dict) -> str:
    """A line of an output or error file, in OpenAI's format."""
    record = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": new_id("req-"), "body": body},
        "error": None,
    }
    return json.dumps(record, ensure_ascii=False)


def failed_line(custom_id: str, code: str, message: str) -> str:
    """An error-file line for a request that never got a response (unreadable, expired, lost)."""
    record = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return json.dumps(record, ensure_ascii=False)


def batch_object(row: dict) -> dict:
    """OpenAI's Batch object from a backend's record (which holds `owner` and the counts)."""
    fields = (
        "id", "endpoint", "input_file_id", "completion_window", "status", "output_file_id", "error_file_id",
        "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
        "cancelling_at", "cancelled_at",
    )  # fmt: skip
    out = {"object": "batch", **{k: row.get(k) for k in fields}}
    out["errors"] = row.get("errors")
    out["metadata"] = row.get("metadata")
    out["request_counts"] = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    out["model"] = row.get("model")
    return out


def page(items: list, limit: int, after: str | None) -> list:
    """OpenAI's cursor pagination: the `limit` items after the one whose id is `after`."""
    ids = [item.id if isinstance(item, StoredFile) else item["id"] for item in items]
    start = ids.index(after) + 1 if after in ids else 0
    return items[start : start + limit]


class JobStore(Protocol):
    """Files, batches and leased lines; every method is safe from any thread and any process."""

    name: str  # "sqlite" or "redis", for logs and /metrics

    def add_file(self, file: StoredFile, chunks: Iterable[bytes], quota: int) -> None:
        """Keep `file.bytes` bytes read from `chunks`, unless its owner's stored bytes would pass
        `quota` (service/errors.StorageFull)."""

    def file(self, file_id: str, owner: str) -> StoredFile | None: ...

    def file_chunks(self, file_id: str, owner: str) -> Iterator[bytes] | None: ...

    def delete_file(self, file_id: str, owner: str) -> bool: ...

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None) -> list[StoredFile]: ...

    def create_batch(self, batch: NewBatch, quota: int) -> dict: ...

    def batch(self, batch_id: str, owner: str) -> dict | None: ...

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict]: ...

    def active_batches(self, owner: str) -> int: ...

    def cancel(self, batch_id: str, owner: str) -> dict | None: ...

    def claim(self, worker: str, lease: float) -> Claim | None: ...

    def renew(self, claim: Claim, lease: float) -> bool: ...

    def release(self, claim: Claim) -> None: ...

    def finish(self, claim: Claim, ok: bool, line: str) -> bool: ...

    def sweep(self) -> None:
        """Expire what is due: batches past their window, files past their `expires_at`, ended
        batches past their output files'."""

    def line_counts(self) -> dict[str, int]: ...

    def problem(self) -> str | None:
        """Why the store can no longer be used though its calls may still succeed (SQLite: its file
        replaced or removed underneath), else None; cheap enough to ask before every call."""

    def close(self) -> None: ...
