"""Conversations onto the engine's messages: a new conversation, items added and deleted (each
segment's messages rebuilt from its items, responses/serving.item_messages), and a response's turn
added — its input and output items, its input messages and its answer with the generated ids. No
Flask: the routes (routes.py) and the Responses API's route call these."""

from __future__ import annotations

import time
from dataclasses import replace

from ...errors import ServiceError
from ...limits import RequestLimits
from ..responses import protocol as rp
from ..responses.serving import item_messages, listed_items
from .protocol import Conversation, ConversationCreate
from .store import Segment, StoredConversation


def not_found(conversation_id: str, param: str | None = None) -> ServiceError:
    return ServiceError(
        f"conversation {conversation_id!r} is not found here (never made, expired, evicted or deleted)",
        param=param,
        code="conversation_not_found",
        status=404,
    )


def item_not_found(item_id: str) -> ServiceError:
    return ServiceError(f"the conversation has no item {item_id!r}", code="item_not_found", status=404)


def new_conversation(
    body: ConversationCreate, limits: RequestLimits, conversation_id: str, owner: str
) -> StoredConversation:
    """A conversation of `body`'s items (checked as a request's input is: a 400 names `items[i]`)."""
    segments, messages = [], []
    if body.items:
        messages = item_messages(body.items, limits, "items")
        segments = [Segment(listed_items([], body.items), len(messages))]
    return StoredConversation(conversation_id, int(time.time()), owner, dict(body.metadata or {}), segments, messages)


def with_items(conversation: StoredConversation, items: list, messages: list) -> StoredConversation:
    """The conversation with `items` added after its own as one segment (listed: each with an id, a new
    one where the id sent is taken), `messages` what they are (item_messages)."""
    listed = listed_items(conversation.items, items)[len(conversation.items) :]
    return replace(
        conversation,
        segments=[*conversation.segments, Segment(listed, len(messages))],
        messages=conversation.messages + messages,
    )


def without_item(conversation: StoredConversation, item_id: str, limits: RequestLimits) -> StoredConversation:
    """The conversation without the item `item_id`: its segment's messages made again from the rest of its
    items (an answer's generated ids are then lost: the next turn recomputes from there)."""
    segments, messages, at = [], [], 0
    found = False
    for segment in conversation.segments:
        own = conversation.messages[at : at + segment.messages]
        at += segment.messages
        if any(item["id"] == item_id for item in segment.items):
            found = True
            rest = [item for item in segment.items if item["id"] != item_id]
            own = item_messages([_as_input(item) for item in rest], limits, "items") if rest else []
            segment = Segment(rest, len(own))
            if not rest:
                continue
        segments.append(segment)
        messages += own
    if not found:
        raise item_not_found(item_id)
    return replace(conversation, segments=segments, messages=messages)


def _as_input(item: dict):
    """A listed item as the input item it stands for (an output message as an assistant's message)."""
    if item["type"] == "message":
        role = item.get("role", "assistant")
        parts = [
            {"type": "input_image", "image_url": p["image_url"], "detail": p.get("detail")}
            if p["type"] == "input_image"
            else {"type": "output_text" if role == "assistant" else "input_text", "text": p["text"]}
            for p in item["content"]
        ]
        return rp.InputMessageItem(role=role, content=parts)
    if item["type"] == "function_call":
        return rp.FunctionCallItem.model_validate(item)
    if item["type"] == "function_call_output":
        return rp.FunctionCallOutputItem.model_validate(item)
    return rp.ReasoningItem.model_validate(item)


def conversation_object(conversation: StoredConversation) -> dict:
    body = Conversation(id=conversation.id, created_at=conversation.created_at, metadata=conversation.metadata)
    return body.model_dump(mode="json")


def find_item(conversation: StoredConversation, item_id: str) -> dict:
    for item in conversation.items:
        if item["id"] == item_id:
            return item
    raise item_not_found(item_id)
