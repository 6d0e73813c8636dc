"""The published contract is the one kept: every answer of the chat APIs — OpenAI's Chat Completions and
Responses, Anthropic's Messages, the native one — (whole, streamed, with tool calls and logprobs), of
the Conversations, Files and Batches APIs, their errors, and /v1/models validate against the schemas
/openapi.json publishes — the routes build their bodies from the same pydantic models (each API's
protocol module under service/api/) — and, strictly, against the official SDKs' own types
(tests/sdk_types.py): what a client release parses them into. Every route the app serves is in the
document, typed. The app in-process on the embedded model (Flask's test client: the schemas, not the
transport)."""

from __future__ import annotations

import io
import json
import re

import jsonschema
import pytest
from referencing import Registry, Resource

from conftest import app_on, make_settings
from imaging import data_url, encode, pattern
from sdk_types import (
    Batch,
    ChatCompletion,
    ChatCompletionChunk,
    Conversation,
    ConversationDeletedResource,
    ConversationItem,
    ConversationItemList,
    FileDeleted,
    FileObject,
    Message,
    MessageTokensCount,
    Model,
    RawMessageStreamEvent,
    Response,
    ResponseItemList,
    ResponseStreamEvent,
    conforms,
)

PICTURE = data_url(encode(pattern(96, 96), ".png"))
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture(scope="module")
def client(cache_dir, loaded_model):
    return app_on(loaded_model("int8"), make_settings(cache_dir)).test_client()


@pytest.fixture(scope="module")
def document(client):
    return client.get("/openapi.json").json


def validator(document: dict, schema: dict):
    """A validator of `schema` ({"$ref": "#/components/schemas/..."}) in the document's components."""
    root = Resource.from_contents({**document, "$schema": "https://json-schema.org/draft/2020-12/schema"})
    registry = Registry().with_resource("urn:openapi", root)
    return jsonschema.Draft202012Validator({"$ref": "urn:openapi" + schema["$ref"]}, registry=registry)


def response_schema(document: dict, path: str, method: str, media: str) -> dict:
    content = document["paths"][path][method]["responses"]["200"]["content"][media]
    return {"$ref": content["schema"]["$ref"]}


def ref(document: dict, path: str, media: str, key: str) -> list[dict]:
    """The x-event-schema / x-line-schemas refs of a streamed response."""
    value = document["paths"][path]["post"]["responses"]["200"]["content"][media][key]
    return value if isinstance(value, list) else [value]


def valid_against_one(document: dict, schemas: list[dict], instance: dict) -> bool:
    return any(validator(document, {"$ref": s["$ref"]}).is_valid(instance) for s in schemas)


def openai_body(**extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": PICTURE}}, {"type": "text", "text": "What is it?"}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0, **extra}


def sse_events(response) -> list[dict]:
    lines = [line[len("data: ") :] for line in response.get_data(as_text=True).split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize(
    "extra",
    [{}, {"logprobs": True, "top_logprobs": 2}, {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 200}],
    ids=["plain", "logprobs", "tool call"],
)
def test_a_chat_completion_is_what_the_document_says(client, document, extra):
    body = client.post("/v1/chat/completions", json=openai_body(**extra)).json
    schema = response_schema(document, "/v1/chat/completions", "post", "application/json")
    validator(document, schema).validate(body)
    conforms(ChatCompletion, body)
    assert body["object"] == "chat.completion"
    if "tools" in extra:
        assert body["choices"][0]["message"]["tool_calls"] and body["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "extra",
    [{}, {"logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}, {"tools": [WEATHER]}],
    ids=["plain", "logprobs and usage", "tools"],
)
def test_every_streamed_chunk_is_what_the_document_says(client, document, extra):
    events = sse_events(client.post("/v1/chat/completions", json=openai_body(stream=True, **extra)))
    chunk = ref(document, "/v1/chat/completions", "text/event-stream", "x-event-schema")
    assert len(events) > 2 and all(valid_against_one(document, chunk, e) for e in events)
    for event in events:
        conforms(ChatCompletionChunk, event)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 1}], ids=["plain", "logprobs"])
def test_every_native_line_and_answer_is_what_the_document_says(client, document, extra):
    body = {"prompt": "What is it?", "images": [PICTURE], "max_tokens": 10, "temperature": 0, **extra}
    lines = [json.loads(line) for line in client.post("/v1/chat", json=body).get_data(as_text=True).splitlines()]
    head, *deltas, done = lines
    schemas = ref(document, "/v1/chat", "application/x-ndjson", "x-line-schemas")
    assert [valid_against_one(document, [s], line) for s, line in zip(schemas, (head, deltas[0], done))] == [True] * 3
    assert all(valid_against_one(document, [schemas[1]], d) for d in deltas)
    whole = client.post("/v1/chat", json={**body, "stream": False}).json
    validator(document, response_schema(document, "/v1/chat", "post", "application/json")).validate(whole)
    assert whole["done"] is True and whole["text"] == done["text"]


ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}


def anthropic_body(**extra) -> dict:
    picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PICTURE.split(",")[1]}}
    content = [picture, {"type": "text", "text": "What is it?"}]
    return {"model": "m", "max_tokens": 12, "messages": [{"role": "user", "content": content}], **extra}


def sse_typed_events(response) -> list[tuple[str, dict]]:
    """(event name, data) of each `event:`/`data:` pair of an Anthropic stream."""
    out = []
    for block in response.get_data(as_text=True).split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}, "max_tokens": 200}],
    ids=["plain", "tool call"],
)
def test_an_anthropic_message_and_its_stream_are_what_the_document_says(client, document, extra):
    whole = client.post("/v1/messages", json=anthropic_body(**extra)).json
    validator(document, response_schema(document, "/v1/messages", "post", "application/json")).validate(whole)
    conforms(Message, whole)
    events = sse_typed_events(client.post("/v1/messages", json=anthropic_body(stream=True, **extra)))
    schemas = ref(document, "/v1/messages", "text/event-stream", "x-event-schemas")
    assert all(name == data["type"] and valid_against_one(document, schemas, data) for name, data in events)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    for name, data in events:
        if name != "ping":  # Anthropic's keep-alive: the SDK skips it, it has no type there
            conforms(RawMessageStreamEvent, data)
    count = client.post("/v1/messages/count_tokens", json={"messages": anthropic_body()["messages"]}).json
    validator(document, response_schema(document, "/v1/messages/count_tokens", "post", "application/json")).validate(
        count
    )
    conforms(MessageTokensCount, count)


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": [{"type": "function", **WEATHER["function"]}], "tool_choice": "required", "max_output_tokens": 200}],
    ids=["plain", "function call"],
)
def test_a_response_its_stream_and_its_stored_copy_are_what_the_document_says(client, document, extra):
    picture = {"type": "input_image", "image_url": PICTURE}
    body = {"input": [{"role": "user", "content": [picture, {"type": "input_text", "text": "What is it?"}]}]}
    body = {**body, "max_output_tokens": 12, **extra}
    schema = response_schema(document, "/v1/responses", "post", "application/json")
    whole = client.post("/v1/responses", json=body).json
    validator(document, schema).validate(whole)
    conforms(Response, whole)
    events = sse_typed_events(client.post("/v1/responses", json={**body, "stream": True}))
    schemas = ref(document, "/v1/responses", "text/event-stream", "x-event-schemas")
    assert all(name == data["type"] and valid_against_one(document, schemas, data) for name, data in events)
    assert events and events[-1][0] in ("response.completed", "response.incomplete")
    for _, data in events:
        conforms(ResponseStreamEvent, data)
    stored = client.get(f"/v1/responses/{whole['id']}").json
    validator(document, schema).validate(stored)
    conforms(Response, stored)
    items = client.get(f"/v1/responses/{whole['id']}/input_items").json
    path = "/v1/responses/{response_id}/input_items"
    validator(document, response_schema(document, path, "get", "application/json")).validate(items)
    conforms(ResponseItemList, items)
    deleted = response_schema(document, "/v1/responses/{response_id}", "delete", "application/json")
    validator(document, deleted).validate(client.delete(f"/v1/responses/{whole['id']}").json)


def test_errors_are_in_the_shape_each_api_documents(client, document):
    openai_error = client.post("/v1/chat/completions", json={"messages": []})
    anthropic_error = client.post("/v1/messages", json={"messages": []})
    for path, answer in (("/v1/chat/completions", openai_error), ("/v1/messages", anthropic_error)):
        error_ref = document["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert answer.status_code == 400 and validator(document, error_ref).is_valid(answer.json)
    assert anthropic_error.json["type"] == "error" and "type" not in openai_error.json


def test_the_model_list_is_what_the_document_says(client, document):
    schema = response_schema(document, "/v1/models", "get", "application/json")
    models = client.get("/v1/models").json
    validator(document, schema).validate(models)
    for model in models["data"]:
        conforms(Model, model)
    card = response_schema(document, "/v1/models/{model_id}", "get", "application/json")
    validator(document, card).validate(client.get("/v1/models/" + models["data"][0]["id"]).json)


NOT_IN_THE_DOCUMENT = {"/", "/static/{name}", "/openapi.json"}  # the web page, its files, the document itself


def test_every_route_the_app_serves_is_in_the_document_and_typed(client, document):
    """Each route and method of the app (Flask's url_map) is a path and operation of /openapi.json, and the
    answer of each API operation names its schema: a route added untyped fails here."""
    served = {
        (re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
        for rule in client.application.url_map.iter_rules()
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    served = {(path, method) for path, method in served if path not in NOT_IN_THE_DOCUMENT}
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert served - documented == set(), "served, not in /openapi.json"
    assert documented - served == set(), "in /openapi.json, not served"
    for path, method in documented:
        if path.startswith(("/v1/", "/v2/")):
            content = document["paths"][path][method]["responses"]["200"]["content"]
            assert content and all("schema" in media for media in content.values()), (path, method)


def answer_of(document: dict, path: str, method: str):
    return validator(document, response_schema(document, path, method, "application/json"))


def test_a_conversation_and_its_items_are_what_the_document_says(client, document):
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello."}]}
    made = client.post("/v1/conversations", json={"items": [item], "metadata": {"k": "v"}}).json
    one, items = "/v1/conversations/{conversation_id}", "/v1/conversations/{conversation_id}/items"
    for body, path, method in (
        (made, "/v1/conversations", "post"),
        (client.get(f"/v1/conversations/{made['id']}").json, one, "get"),
        (client.post(f"/v1/conversations/{made['id']}", json={"metadata": {"k": "w"}}).json, one, "post"),
    ):
        answer_of(document, path, method).validate(body)
        conforms(Conversation, body)
    picture = {"role": "user", "content": [{"type": "input_image", "image_url": PICTURE}]}
    added = client.post(f"/v1/conversations/{made['id']}/items", json={"items": [picture]})
    answer_of(document, items, "post").validate(added.json)
    listed = client.get(f"/v1/conversations/{made['id']}/items?include[]=message.input_image.image_url").json
    answer_of(document, items, "get").validate(listed)
    conforms(ConversationItemList, listed)
    first = client.get(f"/v1/conversations/{made['id']}/items/{listed['data'][-1]['id']}").json
    answer_of(document, items + "/{item_id}", "get").validate(first)
    conforms(ConversationItem, first)
    without = client.delete(f"/v1/conversations/{made['id']}/items/{first['id']}").json
    answer_of(document, items + "/{item_id}", "delete").validate(without)
    deleted = client.delete(f"/v1/conversations/{made['id']}").json
    answer_of(document, one, "delete").validate(deleted)
    conforms(ConversationDeletedResource, deleted)


def test_files_and_batches_are_what_the_document_says(client, document):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": openai_body(max_tokens=2)}
    form = {"file": (io.BytesIO(json.dumps(line).encode() + b"\n"), "lines.jsonl"), "purpose": "batch"}
    uploaded = client.post("/v1/files", data=form, content_type="multipart/form-data").json
    files, one = "/v1/files", "/v1/files/{file_id}"
    for body, path, method in ((uploaded, files, "post"), (client.get(f"/v1/files/{uploaded['id']}").json, one, "get")):
        answer_of(document, path, method).validate(body)
        conforms(FileObject, body)
    answer_of(document, files, "get").validate(client.get("/v1/files?limit=2").json)
    create = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    request_schema = document["paths"]["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator(document, request_schema).validate(create)
    assert not validator(document, request_schema).is_valid({**create, "endpoint": "/v1/messages"})
    made = client.post("/v1/batches", json=create).json
    batches, batch = "/v1/batches", "/v1/batches/{batch_id}"
    for body, path, method in (
        (made, batches, "post"),
        (client.get(f"/v1/batches/{made['id']}").json, batch, "get"),
        (client.post(f"/v1/batches/{made['id']}/cancel").json, batch + "/cancel", "post"),
    ):
        answer_of(document, path, method).validate(body)
        conforms(Batch, body)
    answer_of(document, batches, "get").validate(client.get("/v1/batches").json)
    content = client.get(f"/v1/files/{uploaded['id']}/content")
    media = document["paths"][one + "/content"]["get"]["responses"]["200"]["content"]
    assert content.status_code == 200 and content.mimetype in media
    deleted = client.delete(f"/v1/files/{uploaded['id']}").json
    answer_of(document, one, "delete").validate(deleted)
    conforms(FileDeleted, deleted)


def test_a_schema_check_catches_a_body_that_breaks_the_contract(document):
    """The control: the same check refuses a chat.completion whose usage lost a field."""
    schema = response_schema(document, "/v1/chat/completions", "post", "application/json")
    broken = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    assert not validator(document, schema).is_valid(broken)
