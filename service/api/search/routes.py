"""POST /v1/embeddings, /v1/rerank (and /v2/rerank), /v1/score: a JSON body, or a multipart form for curl
(`-F input=... -F image=@page.png`; rerank: `-F query=... -F documents=... -F document_image=@a.jpg`).
The request waits for its whole answer (no stream)."""

from __future__ import annotations

import base64

from flask import Blueprint, jsonify, request

from ...errors import BadRequest, UnsupportedMediaType
from ..http_io import json_body, request_context
from ..state import state
from .protocol import EmbeddingsRequest, RerankRequest, ScoreRequest
from .serving import embedding_list, embeddings_request, rerank_request, rerank_response, score

search_api = Blueprint("search", __name__)
FORM = ("multipart/form-data", "application/x-www-form-urlencoded")


def _file_items(name: str) -> list[dict]:
    """Uploaded pictures (form files `name`) as official input objects, each its own item."""
    items = []
    for upload in request.files.getlist(name):
        items.append({"image": base64.b64encode(upload.read()).decode("ascii")})
    return items


def _form(fields: dict[str, str]) -> dict:
    """A form's fields as the JSON body's: repeatable ones (`input`, `documents`) as lists, plus files."""
    form = request.form
    body: dict = {}
    for name, kind in fields.items():
        values = form.getlist(name)
        if not values:
            continue
        if kind == "list":
            body[name] = values
        elif len(values) > 1:
            raise BadRequest(f"form field {name!r} was sent {len(values)} times", param=name)
        elif kind == "int":
            try:
                body[name] = int(values[0])
            except ValueError:
                raise BadRequest(f"{name} must be an integer", param=name) from None
        elif kind == "bool":
            body[name] = values[0].lower() in ("1", "true", "yes", "on")
        else:
            body[name] = values[0]
    return body


def _body(fields: dict[str, str], files) -> dict:
    if request.mimetype in FORM:
        body = _form(fields)
        files(body)
        return body
    if request.is_json:
        return json_body()
    raise UnsupportedMediaType("send application/json or multipart/form-data")


_COMMON = {"model": "str", "instruction": "str", "priority": "int", "cache_salt": "str"}


def _embedding_files(body: dict) -> None:
    pictures = _file_items("image")
    if pictures:
        body["input"] = [*body.get("input", []), *pictures]


def _rerank_files(body: dict) -> None:
    query = _file_items("query_image")
    if query:
        body["query"] = {"text": body.get("query"), "image": query[0]["image"]}
    documents = _file_items("document_image")
    if documents:
        body["documents"] = [*body.get("documents", []), *documents]


def _search(protocol, fields: dict[str, str], files, to_request, to_answer):
    """A search endpoint: the body (JSON or a form) checked, run on the engine, its prompt tokens spent
    from the tenant's rate, the answer as `to_answer` writes it."""
    app_state, context = state(), request_context()
    spend = app_state.rates.admit(context.tenant)
    body = protocol.model_validate(_body({**_COMMON, **fields}, files))
    engine = app_state.require_engine()
    result = engine.run_search(to_request(body, engine.limits, context))
    if spend is not None:
        spend(result.prompt_tokens)
    return jsonify(to_answer(body, engine.info.name, result))


@search_api.post("/v1/embeddings")
def embeddings():
    fields = {"input": "list", "dimensions": "int", "encoding_format": "str"}
    return _search(EmbeddingsRequest, fields, _embedding_files, embeddings_request, embedding_list)


@search_api.post("/v1/rerank")
@search_api.post("/v2/rerank")
def rerank():
    fields = {"query": "str", "documents": "list", "top_n": "int", "return_documents": "bool"}
    return _search(RerankRequest, fields, _rerank_files, rerank_request, rerank_response)


@search_api.post("/v1/score")
def scores():
    app_state, context = state(), request_context()
    spend = app_state.rates.admit(context.tenant)
    body = ScoreRequest.model_validate(json_body())
    engine = app_state.require_engine()
    answer, tokens = score(engine, body, context)
    if spend is not None:
        spend(tokens)
    return jsonify(answer)
