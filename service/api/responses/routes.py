"""OpenAI's Responses API: POST /v1/responses (its typed SSE events when streamed), and a stored
response by id — GET, DELETE, and GET its input items. Stateful when `store` is on (the default):
`previous_response_id` continues the stored conversation, and its KV cache (keyed by the chain's first
response id)."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from ...answer.tools import ToolCall
from ...errors import BadRequest, ServiceError
from ...generation import Completion
from ..conversations import serving as conversations
from ..error_shapes import params_renamed
from ..http_io import json_body, request_context, stream_response
from ..state import state
from ..streaming import collect
from . import protocol as rp
from .serving import (
    ResponseHead,
    ResponsesEvents,
    answer_message,
    input_item_page,
    input_items,
    input_items_query,
    responses_field,
    responses_request,
    whole_response,
)
from .store import StoredResponse

responses_api = Blueprint("responses", __name__)
ENDPOINT = "/v1/responses"


def _not_stored(response_id: str, param: str | None = None) -> ServiceError:
    return ServiceError(
        f"response {response_id!r} is not stored here (store: false, expired, evicted or deleted)",
        param=param,
        code="response_not_found",
        status=404,
    )


def _json(response: rp.Response | rp.DeletedResponse) -> dict:
    return response.model_dump(mode="json", by_alias=True)


@responses_api.post(ENDPOINT)
def create():
    app_state, context = state(), request_context()
    spend = app_state.rates.admit(context.tenant)
    body = rp.ResponsesRequest.model_validate(json_body())
    engine = app_state.require_engine()
    store, owner = app_state.stored_responses, context.owner
    response_id = store.new_id(context.affinity_key)
    history, chain, earlier = [], response_id, []
    if body.previous_response_id is not None and body.conversation is not None:
        raise BadRequest("send previous_response_id or conversation, not both", param="conversation")
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id, owner)
        if previous is None:
            raise _not_stored(body.previous_response_id, "previous_response_id")
        history, chain = previous.messages, previous.conversation_id
        earlier = previous.input_items + previous.body["output"]
    elif body.conversation is not None:
        ongoing = app_state.conversations.get(body.conversation_id, owner)
        if ongoing is None:
            raise conversations.not_found(body.conversation_id, "conversation")
        history, chain, earlier = ongoing.messages, ongoing.id, ongoing.items
    app_state.note_affinity(context, "responses")
    with params_renamed(responses_field):
        gen_request, shape, conversation = responses_request(body, engine.limits, history, chain, context)
        generation = engine.submit(gen_request)
    head = ResponseHead(response_id, engine.info.name, body)

    def remember(response: rp.Response, done: Completion, calls: list[ToolCall]) -> None:
        if not body.store and body.conversation is None:
            return  # nothing keeps it
        answer = answer_message(done, calls, response.output)
        items = input_items(earlier, body)
        if body.store:
            store.save(StoredResponse(_json(response), conversation + [answer], chain, owner, items))
        if body.conversation is not None:
            turn = conversation[len(history) :] + [answer]
            outputs = [item.model_dump(mode="json") for item in response.output]
            app_state.conversations.add_turn(body.conversation_id, owner, items[len(earlier) :], outputs, turn)

    if not body.stream:
        done = collect(generation, gen_request, ENDPOINT, spend)
        response, calls = whole_response(head, done, shape)
        remember(response, done, calls)
        return jsonify(_json(response))
    events = ResponsesEvents(head, shape.tool_call_parser(), remember)
    return stream_response(generation, gen_request, ENDPOINT, events, spend, "text/event-stream")


@responses_api.get(ENDPOINT + "/<response_id>")
def retrieve(response_id: str):
    stored = state().stored_responses.get(response_id, request_context().owner)
    if stored is None:
        raise _not_stored(response_id)
    return jsonify(stored.body)


@responses_api.get(ENDPOINT + "/<response_id>/input_items")
def list_input_items(response_id: str):
    query = input_items_query(request.args)
    stored = state().stored_responses.get(response_id, request_context().owner)
    if stored is None:
        raise _not_stored(response_id)
    return jsonify(input_item_page(stored.input_items, query).model_dump(mode="json", by_alias=True))


@responses_api.delete(ENDPOINT + "/<response_id>")
def delete(response_id: str):
    if not state().stored_responses.delete(response_id, request_context().owner):
        raise _not_stored(response_id)
    return jsonify(_json(rp.DeletedResponse(id=response_id)))
