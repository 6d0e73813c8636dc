"""The Conversations API, typed: creating a conversation (items and metadata), updating its metadata,
adding items; the conversation object and its deletion. Items are the Responses API's input items
(responses/protocol.py) and are listed as its input items are."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, field_validator

from ..responses.protocol import InputItem, typed_items
from ..schemas import Lenient

MAX_ITEMS_AT_ONCE = 20  # OpenAI's: items a create or an add may carry
Metadata = dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]]


class ConversationCreate(Lenient):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_AT_ONCE)
    metadata: Metadata | None = Field(None, max_length=16)

    @field_validator("items", mode="before")
    @classmethod
    def _typed_items(cls, value):
        return typed_items(value)


class ConversationUpdate(Lenient):
    metadata: Metadata | None = Field(None, max_length=16)


class ItemsCreate(Lenient):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_AT_ONCE)

    @field_validator("items", mode="before")
    @classmethod
    def _typed_items(cls, value):
        return typed_items(value)


class Conversation(BaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(BaseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: Literal[True] = True
