"""OpenAI's Batch API over the job store (service/jobs/): uploaded files checked against their limits
as they stream in, with their expiry, a batch file's lines read in chunks (a bad line fails that line,
in the error file, never the batch), batches created within each key's limits; and the API's state
(`Batches`): the job store and this instance's runner (runner.py), which runs the lines."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from ...engine.engine import Engine
from ...errors import BadRequest, QueueFull, ServiceError, TooLarge
from ...jobs import open_store
from ...jobs.store import JobStore, Line, NewBatch, StoredFile, failed_line, new_id
from ...settings import Settings
from ..access.tenants import Tenants
from .protocol import ENDPOINTS, MAX_EXPIRY, MAX_METADATA, MIN_EXPIRY, PURPOSES
from .runner import BatchRunner

WINDOW = re.compile(r"^([1-9][0-9]{0,2})h$")  # OpenAI's "24h"; up to a week
MAX_WINDOW_HOURS = 168
CHUNK = 2**20  # an upload is read this many bytes at a time
LINE = re.compile(rb"^[ \t\f\v]*+\S[^\n]*", re.MULTILINE)  # a line holding more than whitespace (linear)
TEXT = re.compile(rb"\S")


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Batches:
    """The Batch API's state: the job store (service/jobs/: opened on first use, set aside while it
    cannot be used), and this instance's runner, started once the model serves (unless BATCH_RUNNER
    is off)."""

    def __init__(self, settings: Settings, tenants: Tenants):
        self.settings, self.tenants = settings, tenants
        self.jobs = open_store(settings.job_store_url, settings.cache_dir, settings.batch_max_attempts)
        self.runner: BatchRunner | None = None

    def start_runner(self, engine: Engine) -> None:
        """An AppState `on_serving` hook: this instance's runner, on `engine`."""
        if self.settings.batch_runner:
            self.runner = BatchRunner(engine, self.jobs, self.settings, self.tenants)
            self.runner.start()

    def wake_runner(self) -> None:
        """A batch was made here: its lines may start at once."""
        if self.runner is not None:
            self.runner.wake()


def expiry(given: object, param: str, default: int) -> int:
    """Seconds a file is kept: OpenAI's `expires_after` ({"anchor": "created_at", "seconds": N}, N
    from an hour to 30 days; from a form, both as text), or `default` (BATCH_FILE_TTL) without one."""
    if given is None:
        return default
    if not isinstance(given, dict) or given.get("anchor") != "created_at":
        raise BadRequest(f'{param}: anchor must be "created_at"', param=f"{param}.anchor")
    seconds = given.get("seconds")
    seconds = int(seconds) if isinstance(seconds, str) and seconds.isdigit() else seconds
    if type(seconds) is not int or not MIN_EXPIRY <= seconds <= MAX_EXPIRY:
        raise BadRequest(
            f"{param}: seconds must be an integer from {MIN_EXPIRY} to {MAX_EXPIRY}", param=f"{param}.seconds"
        )
    return seconds


def upload(
    store: JobStore,
    settings: Settings,
    owner: str,
    filename: str,
    purpose: str,
    expires_after: dict | None,
    stream: BinaryIO,
) -> StoredFile:
    """Keep an uploaded file (`stream`: the body's file part, spooled to disk by the form parser), read
    in chunks: a batch file over its limits is refused here, naming the limit, once a line too many
    is counted; memory holds a chunk and a line whatever the file holds."""
    if purpose not in PURPOSES:
        raise BadRequest(f"purpose must be one of {', '.join(PURPOSES)}", param="purpose")
    ttl = expiry(expires_after, "expires_after", settings.batch_file_ttl)
    size = stream.seek(0, os.SEEK_END)
    if size > settings.batch_max_file_bytes:
        raise TooLarge(
            f"the file is {size} bytes; BATCH_MAX_FILE_BYTES is {settings.batch_max_file_bytes}", param="file"
        )
    if purpose == "batch":
        stream.seek(0)
        found = batch_lines(_chunks(stream), settings.max_body_bytes)
        lines = sum(1 for _ in itertools.islice(found, settings.batch_max_lines + 1))
        if lines == 0:
            raise BadRequest("the batch file holds no lines (JSONL: one request object per line)", param="file")
        if lines > settings.batch_max_lines:
            raise BadRequest(
                f"the batch file has more than {settings.batch_max_lines} lines, BATCH_MAX_LINES",
                param="file",
                code="too_many_lines",
            )
    now = int(time.time())
    stored = StoredFile(new_id("file-"), filename[:256] or "upload.jsonl", purpose, size, now, owner, now + ttl)
    stream.seek(0)
    store.add_file(stored, _chunks(stream), settings.batch_max_stored_bytes)
    return stored


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    return iter(functools.partial(stream.read, CHUNK), b"")


def batch_lines(chunks: Iterable[bytes], max_bytes: int) -> Iterator[bytes | None]:
    r"""The lines of a JSONL file read in `chunks`, blank ones left out ("\n", "\r\n" and "\r" end a
    line, as bytes.splitlines splits): each line's bytes, or None for a line over `max_bytes`, which
    is skipped, not kept — memory holds a chunk and one line, however many lines the file has."""
    carry = b""  # the start of a line that goes on in the next chunk (at most max_bytes)
    skipping = False  # inside a line over max_bytes ...
    skipped_text = False  # ... which holds more than whitespace
    for chunk in chunks:
        chunk = chunk.replace(b"\r", b"\n")  # every line end one byte (a "\r\n" leaves a blank line)
        cut = chunk.rfind(b"\n") + 1  # after the chunk's last line end
        ended, rest = chunk[:cut], chunk[cut:]
        if cut and skipping:
            first_end = ended.index(b"\n")
            if skipped_text or TEXT.search(ended, 0, first_end):
                yield None
            ended, skipping, skipped_text = ended[first_end:], False, False
        elif cut:
            ended, carry = carry + ended, b""
        for match in LINE.finditer(ended):
            yield match[0] if len(match[0]) <= max_bytes else None
        if skipping:
            skipped_text = skipped_text or TEXT.search(rest) is not None
            continue
        carry += rest
        if len(carry) > max_bytes:
            skipping, skipped_text, carry = True, TEXT.search(carry) is not None, b""
    if skipping and skipped_text:
        yield None
    elif carry.strip():
        yield carry


class SpooledLines:
    """A batch's lines as `read_lines` reads them, kept in a temporary file (on disk past a chunk) rather
    than in memory: iterated as often as the store needs, one pass at a time."""

    def __init__(self):
        self._file = tempfile.SpooledTemporaryFile(max_size=CHUNK)

    def append(self, line: Line) -> None:
        self._file.write(json.dumps([line.index, line.custom_id, line.body, line.failed]).encode() + b"\n")

    def __iter__(self) -> Iterator[Line]:
        self._file.seek(0)
        for raw in self._file:
            yield Line(*json.loads(raw))


def read_lines(raw_lines: Iterable[bytes | None], endpoint: str, max_bytes: int) -> SpooledLines:
    """The batch file's request lines (from `batch_lines`): each a JSON object of at most `max_bytes`
    (MAX_BODY_BYTES, as a request sent directly) with a unique `custom_id`, `method` POST, `url` the
    batch's endpoint and an object `body`; a line that is not fails alone."""
    lines, seen = SpooledLines(), set()
    for number, raw in enumerate(raw_lines):
        custom_id = f"line-{number + 1}"
        if raw is None:
            message = f"the line is over {max_bytes} bytes, MAX_BODY_BYTES"
            lines.append(Line(number, custom_id, "", failed_line(custom_id, "invalid_request_line", message)))
            continue
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
    output_ttl = expiry(body.get("output_expires_after"), "output_expires_after", settings.batch_file_ttl)
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
    content = store.file_chunks(input_file_id, owner) or iter(())
    lines = read_lines(batch_lines(content, settings.max_body_bytes), endpoint, settings.max_body_bytes)
    batch_id, window_seconds = new_id("batch_"), int(hours[1]) * 3600
    new = NewBatch(batch_id, owner, endpoint, input_file_id, window, window_seconds, metadata, lines, output_ttl)
    created = store.create_batch(new, settings.batch_max_stored_bytes)
    if created is None:
        raise NotFound(f"no file {input_file_id} (deleted meanwhile)", param="input_file_id")
    return created


def listing(items: list[dict], has_more: bool) -> dict:
    """OpenAI's list object."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
