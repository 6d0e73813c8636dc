"""POST /v1/chat — the curl-first endpoint: JSON or multipart in, JSON lines out.

Stateful by `conversation_id`: a client sends only its new message; the server keeps the history
(and the KV cache of it). Lines: a first one with ids, one per text delta, a last one with
`"done": true`, usage and timings.
"""

from __future__ import annotations

import json
from functools import partial

from flask import Blueprint, jsonify, request

from ...errors import BadRequest, UnsupportedMediaType
from ...limits import RequestLimits
from ...model.prompts import ChatMessage
from ..http_io import conversation_header, json_body, request_context, stream_response
from ..state import state
from ..streaming import collect
from .protocol import FORM_FIELDS, NativeChatRequest
from .serving import NativeLines, form_messages, json_messages, native_answer, native_head, native_request, remember

native_api = Blueprint("native", __name__)
ENDPOINT = "/v1/chat"


def _from_form(limits: RequestLimits) -> tuple[NativeChatRequest, list[ChatMessage]]:
    form, files = request.form, request.files
    if None in form or None in files or "" in form or "" in files:
        raise BadRequest('a form part has no name: each needs Content-Disposition: form-data; name="..."')
    unknown = set(form) - FORM_FIELDS - {"stop"}
    if unknown:
        raise BadRequest(f"unknown form field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    for name in FORM_FIELDS:
        if len(form.getlist(name)) > 1:
            raise BadRequest(f"form field {name!r} was sent more than once", param=name)
    unknown_files = set(files) - {"image", "video"}
    if unknown_files:
        raise BadRequest(
            f"unknown file field(s): {', '.join(sorted(unknown_files))}; send images as -F image=@file "
            "and videos as -F video=@file",
            param=sorted(unknown_files)[0],
        )
    fields = {k: form[k] for k in FORM_FIELDS if k in form}
    if "response_format" in fields:
        try:
            fields["response_format"] = json.loads(fields["response_format"])
        except ValueError:
            raise BadRequest("response_format must be JSON text in a form", param="response_format") from None
    if form.getlist("stop"):
        fields["stop"] = form.getlist("stop")
    body = NativeChatRequest.model_validate(fields)
    return body, form_messages(body, files.getlist("image"), files.getlist("video"), limits)


def _from_json(limits: RequestLimits) -> tuple[NativeChatRequest, list[ChatMessage]]:
    body = NativeChatRequest.model_validate(json_body())
    return body, json_messages(body, limits)


@native_api.post(ENDPOINT)
def chat():
    app_state, context = state(), request_context()
    engine = app_state.require_engine()
    spend = app_state.rates.admit(context.tenant)
    if request.mimetype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        body, new_messages = _from_form(engine.limits)
    elif request.is_json:
        body, new_messages = _from_json(engine.limits)
    else:
        raise UnsupportedMediaType(
            "send application/json or multipart/form-data (curl -F prompt=... -F image=@file -F video=@file)"
        )
    app_state.note_affinity(context, "native")
    histories = app_state.histories
    gen_request = native_request(body, new_messages, conversation_header(), histories, engine.limits, context)
    generation = engine.submit(gen_request)
    head = native_head(context.request_id, engine.info, gen_request.conversation_id)
    keep = partial(remember, histories, gen_request, context.owner)

    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT, spend)
        keep(done)
        return jsonify(native_answer(head, done))

    lines = NativeLines(head, gen_request.params.logprobs is not None, keep)
    return stream_response(generation, gen_request, ENDPOINT, lines, spend, "application/x-ndjson")
