"""What OpenAI's own clients expect of the chat API beyond the answer: strict schemas as OpenAI means
them, the fields it always sends, refusals of what would change the answer, a model by id, the token
cap, CORS. On the shared Gunicorn through the official client (CORS: the app in-process)."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from service.answer.structured import closed_objects

from conftest import BEFORE_THE_NAME, SHARED_ENV, app_on, make_settings
from sdk_types import sdk_conforms
from servers import openai_client

CAP = int(SHARED_ENV["MAX_NEW_TOKENS"])
# As instructor and pydantic write a model's schema: objects with no additionalProperties.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "boolean"},
        "where": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
    },
    "required": ["answer", "where"],
}


@pytest.fixture(scope="module")
def client(shared_server):
    return openai_client(shared_server)


def ask(client, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}], **kwargs)


def test_a_strict_schema_allows_no_keys_beyond_its_properties(client):
    """Without the change the grammar let the random model open keys of its own (and often never close them)."""
    strict = {"type": "json_schema", "json_schema": {"name": "place", "schema": OPEN_SCHEMA, "strict": True}}
    for seed in range(6):
        reply = ask(client, response_format=strict, temperature=1.0, seed=seed, max_tokens=120)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        answer = json.loads(reply.choices[0].message.content)
        assert set(answer) == {"answer", "where"} and set(answer["where"]) == {"city"}


def test_strict_closes_only_objects_that_say_nothing_of_more_keys():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object"}, "free": {"type": "object", "additionalProperties": True}},
        "$defs": {"item": {"type": ["object", "null"], "properties": {}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["$defs"]["item"]["additionalProperties"] is False
    assert closed["properties"]["properties"] == {"type": "object", "additionalProperties": False}
    assert closed["properties"]["free"]["additionalProperties"] is True and "additionalProperties" not in schema


def test_refusal_and_system_fingerprint_come_as_openai_sends_them(client, shared_server):
    whole = requests.post(
        shared_server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    ).json()
    assert whole["choices"][0]["message"]["refusal"] is None
    fingerprint = whole["system_fingerprint"]
    assert fingerprint.startswith("fp_") and ask(client).system_fingerprint == fingerprint
    chunks = list(ask(client, stream=True))
    sdk_conforms(*chunks)
    assert {c.system_fingerprint for c in chunks} == {fingerprint}
    first = chunks[0].choices[0].delta.model_dump(exclude_unset=True)
    assert first == {"role": "assistant", "content": "", "refusal": None}


def test_speculation_is_counted_in_its_own_field_not_in_predicted_outputs(client):
    """A forced tool call's grammar drafts tokens; OpenAI's Predicted Outputs counts stay 0."""
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    reply = ask(client, tools=[tool], tool_choice="required", max_tokens=60, temperature=0)
    sdk_conforms(reply)
    usage = reply.usage
    details = usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    speculation = usage.model_extra["speculation"]
    assert speculation["drafted_tokens"] > 0 and 0 < speculation["accepted_tokens"] <= speculation["drafted_tokens"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_forced_tool_calls_first_chunk_has_a_null_content(client):
    """As OpenAI streams a tool call: the answer is known to be a call, there is no content to start."""
    chunks = list(ask(client, tools=[WEATHER], tool_choice="required", max_tokens=2, stream=True))
    sdk_conforms(*chunks)
    assert chunks[0].choices[0].delta.model_dump(exclude_unset=True) == {
        "role": "assistant",
        "content": None,
        "refusal": None,
    }


@pytest.mark.parametrize("max_tokens", BEFORE_THE_NAME)
def test_a_forced_tool_call_cut_before_its_name_shows_no_markup(client, max_tokens):
    """No call and no text, whole or streamed: the answer was cut (length), never `<tool_call…`."""
    kwargs = dict(tools=[WEATHER], tool_choice="required", max_tokens=max_tokens, temperature=0)
    reply = ask(client, **kwargs)
    chunks = list(ask(client, stream=True, **kwargs))
    sdk_conforms(reply, *chunks)
    message = reply.choices[0].message
    assert (reply.choices[0].finish_reason, message.content, message.tool_calls) == ("length", None, None)
    assert reply.usage.completion_tokens == max_tokens  # the grammar allows no end before the call's
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert not any(d.content or d.tool_calls for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "field,value",
    [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("function_call", "auto"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
    ],
)
def test_what_would_change_the_answer_and_is_not_supported_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, extra_body={field: value})
    assert info.value.status_code == 400 and info.value.body["param"] == field


def test_an_unsupported_content_part_is_a_400_naming_its_type(client):
    part = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [part]}])
    assert "'input_audio'" in info.value.body["message"] and info.value.body["param"] == "messages.0.content"


def test_the_model_is_found_by_its_id_and_another_is_a_404(client):
    listed = client.models.list().data[0]
    assert client.models.retrieve(listed.id).model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_token_limit_beyond_the_cap_is_a_400_naming_the_cap(client, shared_server, field):
    assert ask(client, **{"max_tokens": None, field: CAP}).usage.completion_tokens <= CAP
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, **{"max_tokens": None, field: CAP + 1})
    assert info.value.body["param"] == field and str(CAP) in info.value.body["message"]
    native = requests.post(shared_server + "/v1/chat", json={"prompt": "Hi", "max_tokens": CAP + 1})
    assert native.status_code == 400 and "MAX_NEW_TOKENS" in native.json()["error"]["message"]


@pytest.fixture(scope="module")
def cors_app(cache_dir, loaded_model):
    settings = make_settings(cache_dir, cors_origins="https://app.example.com", api_keys="sk-cors")
    return app_on(loaded_model("int8"), settings).test_client()


def test_cors_lets_an_allowed_origin_preflight_and_read_but_keeps_the_key(cors_app, shared_server):
    origin = {"Origin": "https://app.example.com"}
    off = requests.get(shared_server + "/v1/models", headers=origin)  # CORS_ORIGINS unset: off
    assert off.status_code == 200 and "Access-Control-Allow-Origin" not in off.headers
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, x-stainless-os"}
    pre = cors_app.options("/v1/chat/completions", headers={**origin, **asked})
    assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, x-stainless-os"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    keyless = cors_app.get("/v1/models", headers=origin)
    assert keyless.status_code == 401 and keyless.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    keyed = cors_app.get("/v1/models", headers={**origin, "Authorization": "Bearer sk-cors"})
    assert keyed.status_code == 200 and "X-Request-Id" in keyed.headers["Access-Control-Expose-Headers"]
    other = cors_app.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **asked})
    assert other.status_code == 401 and "Access-Control-Allow-Origin" not in other.headers
    refused = cors_app.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer sk-cors"})
    assert "Access-Control-Allow-Origin" not in refused.headers and "Origin" in refused.headers["Vary"]
