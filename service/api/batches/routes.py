"""OpenAI's Files and Batches endpoints (the logic: serving.py): `POST /v1/files`,
`GET /v1/files[/{id}[/content]]`, `DELETE /v1/files/{id}`, `POST /v1/batches`, `GET /v1/batches[/{id}]`,
`POST /v1/batches/{id}/cancel`. A tenant (the keys of one name: service/api/access/tenants.py) sees only
the files and batches it made; its uploads and batches count against its rates. A file's content goes
out in chunks, named by RFC 6266."""

from __future__ import annotations

import re
import unicodedata
from email.utils import encode_rfc2231

from flask import Blueprint, Response, jsonify, request

from ...errors import BadRequest, ServiceError, TooLarge
from ...jobs import GuardedStore
from ...jobs.store import batch_object
from ..http_io import json_body, request_context
from ..state import state
from . import serving
from .serving import NotFound

batch_api = Blueprint("batches", __name__)
DRAIN_BYTES = 16 * 2**20  # a refused upload up to this size is read first (_drain)


def _owner() -> str:
    return request_context().owner


def _jobs() -> GuardedStore:
    return state().batches.jobs


def _page_args() -> tuple[int, str | None]:
    try:
        limit = int(request.args.get("limit", 20))
    except ValueError:
        raise BadRequest("limit must be an integer from 1 to 100", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be an integer from 1 to 100", param="limit")
    return limit, request.args.get("after")


@batch_api.post("/v1/files")
def upload_file():
    app_state, context = state(), request_context()
    settings = app_state.settings
    limit = settings.batch_max_file_bytes
    try:
        app_state.rates.admit(context.tenant)  # a request like any other (it spends no tokens)
        _jobs().check()
        if request.content_length is not None and request.content_length > settings.batch_upload_bytes:
            raise TooLarge(
                f"the upload is {request.content_length} bytes; BATCH_MAX_FILE_BYTES is {limit}", param="file"
            )
    except ServiceError:
        _drain(request.content_length)
        raise
    request.max_content_length = settings.batch_upload_bytes
    if request.mimetype != "multipart/form-data":
        raise BadRequest("send multipart/form-data with a `file` and its `purpose`", param="file")
    upload = request.files.get("file")  # the form parser spools it to a temporary file
    if upload is None:
        raise BadRequest("the form has no `file`", param="file")
    fields = {
        key: request.form[f"expires_after[{key}]"]
        for key in ("anchor", "seconds")
        if f"expires_after[{key}]" in request.form
    }
    stored = serving.upload(
        _jobs(),
        settings,
        context.owner,
        upload.filename or "",
        request.form.get("purpose", ""),
        fields or None,
        upload.stream,
    )
    return jsonify(stored.public())


def _drain(length: int | None) -> None:
    """Read a refused body of up to DRAIN_BYTES before answering: a client still sending it would
    otherwise meet a closed connection instead of the error that names the limit."""
    if length is not None and length <= DRAIN_BYTES:
        while request.stream.read(64 * 1024):
            pass


@batch_api.get("/v1/files")
def list_files():
    limit, after = _page_args()
    found = _jobs().files(_owner(), request.args.get("purpose"), limit + 1, after)
    return jsonify(serving.listing([f.public() for f in found[:limit]], len(found) > limit))


def _file(file_id: str):
    found = _jobs().file(file_id, _owner())
    if found is None:
        raise NotFound(f"no file {file_id}", param="file_id")
    return found


@batch_api.get("/v1/files/<file_id>")
def get_file(file_id: str):
    return jsonify(_file(file_id).public())


@batch_api.get("/v1/files/<file_id>/content")
def file_content(file_id: str):
    found = _file(file_id)
    content = _jobs().file_chunks(file_id, _owner())
    if content is None:
        raise NotFound(f"no file {file_id}", param="file_id")
    mimetype = "application/jsonl" if found.filename.endswith(".jsonl") else "application/octet-stream"
    headers = {"Content-Disposition": attachment(found.filename), "Content-Length": str(found.bytes)}
    return Response(content, mimetype=mimetype, headers=headers)


def attachment(filename: str) -> str:
    """A Content-Disposition for `filename` by RFC 6266: `filename` in ASCII (accents dropped; quotes,
    backslashes and control characters made `_`) and, unless that is the name itself, RFC 5987's
    `filename*`: the name in UTF-8, percent-encoded (the standard library's RFC 2231 encoder)."""
    ascii_name = unicodedata.normalize("NFKD", filename).encode("ascii", "ignore").decode()
    ascii_name = re.sub(r'[\x00-\x1f\x7f"\\]', "_", ascii_name) or "download"
    value = f'attachment; filename="{ascii_name}"'
    return value if ascii_name == filename else f"{value}; filename*={encode_rfc2231(filename, 'utf-8')}"


@batch_api.delete("/v1/files/<file_id>")
def delete_file(file_id: str):
    if not _jobs().delete_file(file_id, _owner()):
        raise NotFound(f"no file {file_id}", param="file_id")
    return jsonify({"id": file_id, "object": "file", "deleted": True})


@batch_api.post("/v1/batches")
def create_batch():
    app_state, context = state(), request_context()
    app_state.rates.admit(context.tenant)
    created = serving.create(app_state.batches.jobs, app_state.settings, context.owner, json_body())
    app_state.batches.wake_runner()
    return jsonify(batch_object(created))


@batch_api.get("/v1/batches")
def list_batches():
    limit, after = _page_args()
    found = _jobs().batches(_owner(), limit + 1, after)
    return jsonify(serving.listing([batch_object(b) for b in found[:limit]], len(found) > limit))


@batch_api.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str):
    found = _jobs().batch(batch_id, _owner())
    if found is None:
        raise NotFound(f"no batch {batch_id}", param="batch_id")
    return jsonify(batch_object(found))


@batch_api.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    found = _jobs().cancel(batch_id, _owner())
    if found is None:
        raise NotFound(f"no batch {batch_id}", param="batch_id")
    return jsonify(batch_object(found))
