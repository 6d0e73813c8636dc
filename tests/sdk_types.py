"""The official SDKs' own types as the judge of what the server sends. The `openai` and `anthropic`
clients build their objects without validating them, so a field the server leaves out (or sends as the
wrong type) only shows once a user's code reads it, or a stricter client release refuses it. Here every
body and event is validated strictly against the type the SDK parses it into: each required field
present, none of the wrong type (extra fields are allowed, as the SDKs keep them in `model_extra`)."""

from __future__ import annotations

import typing

from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from openai.types import Batch, FileDeleted, FileObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.conversations import (
    Conversation,
    ConversationDeletedResource,
    ConversationItem,
    ConversationItemList,
)
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import BaseModel, ValidationError

__all__ = [
    "Batch", "ChatCompletion", "ChatCompletionChunk", "Conversation", "ConversationDeletedResource",
    "ConversationItem", "ConversationItemList", "FileDeleted", "FileObject", "Message", "MessageTokensCount",
    "Model", "RawMessageStreamEvent", "Response", "ResponseItemList", "ResponseStreamEvent", "conforms",
    "sdk_conforms",
]  # fmt: skip


def _members(union) -> dict[str, type[BaseModel]]:
    """A union of SDK models (annotated with its discriminator or not) by each member's `type` values."""
    if typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    members = typing.get_args(union)
    return {value: m for m in members for value in typing.get_args(m.model_fields["type"].annotation)}


def conforms(kind, data: dict) -> None:
    """`data` (a JSON body or event as sent) validates strictly against `kind`: an SDK model, or a union
    of them, told apart by `type` as the SDKs tell them apart. An AssertionError says what is wrong."""
    model = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else _members(kind).get(data.get("type"))
    assert model is not None, f"{data.get('type')!r} is no member of {kind}"
    try:
        model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise AssertionError(f"not a valid {model.__name__}: {exc}\n{data}") from None


def sdk_conforms(*objects) -> None:
    """Each object an SDK call returned (a reply, a stream's events) as it came over the wire
    (`to_dict()`: the fields sent, by their names) validates strictly against its own type."""
    for obj in objects:
        conforms(type(obj), obj.to_dict())
