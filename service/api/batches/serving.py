"""OpenAI's Batch API over the job store (service/jobs/): uploaded files checked against their limits,
a batch file's lines read (a bad line fails that line, in the error file, never the batch), batches
created within each key's limits; and the API's state (`Batches`): the job store and this instance's
runner (runner.py), which runs the lines."""

from __future__ import annotations

import json
import re
import threading
import time

from ...engine.engine import Engine
from ...errors import BadRequest, QueueFull, ServiceError, TooLarge
from ...jobs import open_store
from ...jobs.store import JobStore, Line, NewBatch, StoredFile, failed_line, new_id
from ...settings import Settings
from ..access.tenants import Tenants
from .runner import BatchRunner

ENDPOINTS = ("/v1/chat/completions",)
PURPOSES = ("batch", "user_data", "vision")  # what uploads may say; only `batch` files make batches
WINDOW = re.compile(r"^([1-9][0-9]{0,2})h$")  # OpenAI's "24h"; up to a week
MAX_WINDOW_HOURS = 168
MAX_METADATA = 16


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Batches:
    """The Batch API's state: the job store (service/jobs/), opened on first use, and this instance's
    runner, started once the model serves (unless BATCH_RUNNER is off)."""

    def __init__(self, settings: Settings, tenants: Tenants):
        self.settings, self.tenants = settings, tenants
        self._jobs: JobStore | None = None
        self._jobs_lock = threading.Lock()
        self.runner: BatchRunner | None = None

    @property
    def jobs(self) -> JobStore:
        """The job store of JOB_STORE_URL (service/jobs/)."""
        with self._jobs_lock:
            if self._jobs is None:
                s = self.settings
                self._jobs = open_store(s.job_store_url, s.cache_dir, s.batch_max_attempts)
            return self._jobs

    def start_runner(self, engine: Engine) -> None:
        """An AppState `on_serving` hook: this instance's runner, on `engine`."""
        if self.settings.batch_runner:
            self.runner = BatchRunner(engine, self.jobs, self.settings, self.tenants)
            self.runner.start()

    def wake_runner(self) -> None:
        """A batch was made here: its lines may start at once."""
        if self.runner is not None:
            self.runner.wake()


def upload(store: JobStore, settings: Settings, owner: str, filename: str, purpose: str, content: bytes) -> StoredFile:
    """Keep an uploaded file; a batch file over its limits is refused here, naming the limit."""
    if purpose not in PURPOSES:
        raise BadRequest(f"purpose must be one of {', '.join(PURPOSES)}", param="purpose")
    if len(content) > settings.batch_max_file_bytes:
        raise TooLarge(
            f"the file is {len(content)} bytes; BATCH_MAX_FILE_BYTES is {settings.batch_max_file_bytes}", param="file"
        )
    if purpose == "batch":
        lines = sum(1 for line in content.splitlines() if line.strip())
        if lines == 0:
            raise BadRequest("the batch file holds no lines (JSONL: one request object per line)", param="file")
        if lines > settings.batch_max_lines:
            raise BadRequest(
                f"the batch file has {lines} lines; BATCH_MAX_LINES is {settings.batch_max_lines}",
                param="file",
                code="too_many_lines",
            )
    stored = StoredFile(
        new_id("file-"), filename[:256] or "upload.jsonl", purpose, len(content), int(time.time()), owner
    )
    store.add_file(stored, content)
    return stored


def read_lines(content: bytes, endpoint: str) -> list[Line]:
    """The batch file's request lines: each a JSON object with a unique `custom_id`, `method`
    POST, `url` the batch's endpoint and an object `body`; a line that is not fails alone."""
    lines, seen = [], set()
    for number, raw in enumerate(r for r in content.splitlines() if r.strip()):
        custom_id = f"line-{number + 1}"
        try:
            item = json.loads(raw)
        except (ValueError, RecursionError):
            lines.append(Line(number, custom_id, "", failed_line(custom_id, "invalid_json_line", "not a JSON object")))
            continue
        problem = None
        if not isinstance(item, dict):
            problem = "the line is not a JSON object"
        else:
            given = item.get("custom_id")
            if isinstance(given, str) and 0 < len(given) <= 512:
                custom_id = given
            if not isinstance(given, str) or not 0 < len(given) <= 512:
                problem = "custom_id must be a string of 1 to 512 characters"
            elif given in seen:
                problem = f"custom_id {given!r} is used by an earlier line"
            elif item.get("method", "POST") != "POST":
                problem = "method must be POST"
            elif item.get("url") != endpoint:
                problem = f"url must be the batch's endpoint, {endpoint}"
            elif not isinstance(item.get("body"), dict):
                problem = "body must be a JSON object (the request)"
        if problem:
            lines.append(Line(number, custom_id, "", failed_line(custom_id, "invalid_request_line", problem)))
            continue
        seen.add(custom_id)
        lines.append(Line(number, custom_id, json.dumps(item["body"], ensure_ascii=False)))
    return lines


def create(store: JobStore, settings: Settings, owner: str, body: dict) -> dict:
    """A batch from an uploaded `batch` file: its lines queued for the instances that run them."""
    input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    window, metadata = body.get("completion_window", "24h"), body.get("metadata")
    if not isinstance(input_file_id, str):
        raise BadRequest("input_file_id is required", param="input_file_id")
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    hours = WINDOW.match(window) if isinstance(window, str) else None
    if hours is None or int(hours[1]) > MAX_WINDOW_HOURS:
        raise BadRequest(
            f'completion_window must be e.g. "24h" (at most {MAX_WINDOW_HOURS}h)', param="completion_window"
        )
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()
        )
    ):
        raise BadRequest("metadata: at most 16 string keys (64 chars) and values (512 chars)", param="metadata")
    file = store.file(input_file_id, owner)
    if file is None:
        raise NotFound(f"no file {input_file_id}", param="input_file_id")
    if file.purpose != "batch":
        raise BadRequest(
            f"{input_file_id} was uploaded with purpose {file.purpose!r}, not 'batch'", param="input_file_id"
        )
    if store.active_batches(owner) >= settings.batch_max_active:
        raise QueueFull(
            f"{settings.batch_max_active} batches are in progress already (BATCH_MAX_ACTIVE); retry when one ends",
            headers={"Retry-After": "60"},
        )
    lines = read_lines(store.file_content(input_file_id, owner) or b"", endpoint)
    new = NewBatch(new_id("batch_"), owner, endpoint, input_file_id, window, int(hours[1]) * 3600, metadata, lines)
    return store.create_batch(new)


def listing(items: list[dict], has_more: bool) -> dict:
    """OpenAI's list object."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
