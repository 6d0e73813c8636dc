"""OpenAI's Conversations API: POST /v1/conversations (items, metadata), GET, POST (its metadata) and
DELETE /v1/conversations/{id}, and its items — listed (paged as a response's input items), added,
retrieved, deleted. `/v1/responses` with `conversation` continues one (responses/routes.py)."""

from __future__ import annotations

from dataclasses import replace

from flask import Blueprint, jsonify, request

from ..http_io import json_body, request_context
from ..responses.serving import input_item_page, input_items_query, item_messages
from ..state import state
from . import serving
from .protocol import ConversationCreate, ConversationDeleted, ConversationUpdate, ItemsCreate

conversations_api = Blueprint("conversations", __name__)
ENDPOINT = "/v1/conversations"


def _get(conversation_id: str):
    found = state().conversations.get(conversation_id, request_context().owner)
    if found is None:
        raise serving.not_found(conversation_id)
    return found


@conversations_api.post(ENDPOINT)
def create():
    app_state, context = state(), request_context()
    body = ConversationCreate.model_validate(json_body())
    limits = app_state.require_engine().limits
    conversation_id = app_state.conversations.new_id(context.affinity_key)
    conversation = serving.new_conversation(body, limits, conversation_id, context.owner)
    app_state.conversations.save(conversation)
    return jsonify(serving.conversation_object(conversation))


@conversations_api.get(ENDPOINT + "/<conversation_id>")
def retrieve(conversation_id: str):
    return jsonify(serving.conversation_object(_get(conversation_id)))


def _update(conversation_id: str, change):
    """The conversation changed in one step (concurrent changes all kept: store.py), or a 404."""
    changed = state().conversations.update(conversation_id, request_context().owner, change)
    if changed is None:
        raise serving.not_found(conversation_id)
    return changed


@conversations_api.post(ENDPOINT + "/<conversation_id>")
def update(conversation_id: str):
    body = ConversationUpdate.model_validate(json_body())
    metadata = dict(body.metadata or {})
    conversation = _update(conversation_id, lambda c: replace(c, metadata=metadata))
    return jsonify(serving.conversation_object(conversation))


@conversations_api.delete(ENDPOINT + "/<conversation_id>")
def delete(conversation_id: str):
    if not state().conversations.delete(conversation_id, request_context().owner):
        raise serving.not_found(conversation_id)
    return jsonify(ConversationDeleted(id=conversation_id).model_dump(mode="json"))


@conversations_api.get(ENDPOINT + "/<conversation_id>/items")
def list_items(conversation_id: str):
    query = input_items_query(request.args)
    page = input_item_page(_get(conversation_id).items, query)
    return jsonify(page.model_dump(mode="json", by_alias=True))


@conversations_api.post(ENDPOINT + "/<conversation_id>/items")
def add_items(conversation_id: str):
    body = ItemsCreate.model_validate(json_body())
    query = input_items_query(request.args)
    messages = item_messages(body.items, state().require_engine().limits, "items")  # decoded once, outside
    conversation = _update(conversation_id, lambda c: serving.with_items(c, body.items, messages))
    added = conversation.segments[-1].items
    page = input_item_page(added, query.model_copy(update={"order": "asc", "limit": len(added), "after": None}))
    return jsonify(page.model_dump(mode="json", by_alias=True))


@conversations_api.get(ENDPOINT + "/<conversation_id>/items/<item_id>")
def retrieve_item(conversation_id: str, item_id: str):
    item = serving.find_item(_get(conversation_id), item_id)
    page = input_item_page([item], input_items_query(request.args).model_copy(update={"after": None, "limit": 1}))
    return jsonify(page.data[0].model_dump(mode="json", by_alias=True))


@conversations_api.delete(ENDPOINT + "/<conversation_id>/items/<item_id>")
def delete_item(conversation_id: str, item_id: str):
    limits = state().require_engine().limits
    conversation = _update(conversation_id, lambda c: serving.without_item(c, item_id, limits))
    return jsonify(serving.conversation_object(conversation))
