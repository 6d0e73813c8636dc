"""OpenAI's Conversations API (/v1/conversations) and `conversation` on /v1/responses, through the
official `openai` client on one real Gunicorn without Redis (each instance's own store): a conversation
made with items, continued by responses whose items are added to it, its KV cache found turn after turn;
items listed, added, read and deleted; metadata updated; errors named; another tenant's conversation a
404; Responses logprobs (`include`) on the whole response and on the stream's deltas, adding up."""

from __future__ import annotations

import openai
import pytest

from conftest import KEY
from servers import openai_client

pytestmark = pytest.mark.server

LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def client(shared_server):
    return openai_client(shared_server)


def test_a_conversation_is_continued_by_responses_and_keeps_their_items(client):
    made = client.conversations.create(
        items=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello."}],
        metadata={"topic": "greetings"},
    )
    assert made.id.startswith("conv_") and made.metadata == {"topic": "greetings"}
    first = client.responses.create(model="m", input="Who are you?", conversation=made.id, max_output_tokens=6)
    second = client.responses.create(model="m", input="And then?", conversation={"id": made.id}, max_output_tokens=6)
    assert first.conversation.id == made.id == second.conversation.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the KV cache, whole
    items = client.conversations.items.list(made.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [
        ("message", "system"), ("message", "user"), ("message", "user"), ("message", "assistant"),
        ("message", "user"), ("message", "assistant"),
    ]  # fmt: skip
    assert items[3].content[0].text == first.output_text and items[5].content[0].text == second.output_text
    newest = client.conversations.items.list(made.id, limit=2)
    assert [i.id for i in newest.data] == [items[5].id, items[4].id] and newest.has_more


def test_items_are_added_read_and_deleted_and_metadata_updated(client):
    made = client.conversations.create()
    one = {"role": "user", "content": [{"type": "input_text", "text": "One."}]}
    added = client.conversations.items.create(made.id, items=[one, {"role": "user", "content": "Two."}])
    assert [i.content[0].text for i in added.data] == ["One.", "Two."]
    first = added.data[0]
    assert client.conversations.items.retrieve(first.id, conversation_id=made.id).content[0].text == "One."
    client.conversations.items.delete(first.id, conversation_id=made.id)
    assert [i.content[0].text for i in client.conversations.items.list(made.id, order="asc").data] == ["Two."]
    answer = client.responses.create(model="m", input="Three.", conversation=made.id, max_output_tokens=4)
    assert answer.usage.input_tokens > 0
    assert client.conversations.update(made.id, metadata={"k": "v"}).metadata == {"k": "v"}
    assert client.conversations.retrieve(made.id).metadata == {"k": "v"}
    assert client.conversations.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError) as gone:
        client.conversations.retrieve(made.id)
    assert gone.value.body["code"] == "conversation_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="Hi.", conversation=made.id, max_output_tokens=4)


def test_bad_requests_are_refused_naming_the_field(client):
    made = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.create(items=[{"type": "input_audio", "audio": "x"}])
    assert "items" in bad.value.body["param"]
    with pytest.raises(openai.BadRequestError) as both:
        first = client.responses.create(model="m", input="Hi.", max_output_tokens=2)
        client.responses.create(
            model="m", input="Hi.", conversation=made.id, previous_response_id=first.id, max_output_tokens=2
        )
    assert both.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve("msg_nope", conversation_id=made.id)


def test_another_tenants_conversation_is_not_found(keyed_server):
    base, _ = keyed_server
    mine = openai_client(base, api_key=KEY)
    made = mine.conversations.create(items=[{"role": "user", "content": "mine"}])
    theirs = openai_client(base, api_key="other-key")
    with pytest.raises(openai.NotFoundError):
        theirs.conversations.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        theirs.conversations.items.list(made.id)
    assert mine.conversations.retrieve(made.id).id == made.id


def test_responses_logprobs_come_with_the_answer_and_its_stream_deltas(client):
    ask = {"model": "m", "input": "Name a colour.", "max_output_tokens": 8, "include": LOGPROBS, "top_logprobs": 3}
    whole = client.responses.create(**ask, temperature=0)
    entries = whole.output[0].content[0].logprobs
    assert entries and all(len(e.top_logprobs) == 3 for e in entries)
    assert len(entries) == whole.usage.output_tokens  # one per answer token
    deltas, done = [], None
    for event in client.responses.create(**ask, temperature=0, stream=True):
        if event.type == "response.output_text.delta":
            deltas += event.logprobs
        elif event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert [(d.token, d.logprob) for d in deltas] == [(e.token, e.logprob) for e in entries]
    assert done.output[0].content[0].logprobs[0].logprob == entries[0].logprob
    plain = client.responses.create(model="m", input="Name a colour.", max_output_tokens=4)
    assert not plain.output[0].content[0].logprobs  # not asked: none
