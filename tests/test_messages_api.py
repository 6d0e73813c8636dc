"""Anthropic's Messages API on the shared Gunicorn, through the official anthropic client as a user
writes it: text, a picture, a tool loop, streams, count_tokens, stop sequences, errors in Anthropic's
shape, and x-api-key on the keyed server. The model is random: shapes, events and counts are checked."""

from __future__ import annotations

import base64
import json

import anthropic
import jsonschema
import pytest
import requests

from conftest import BEFORE_THE_NAME, KEY
from imaging import encode, pattern
from sdk_types import sdk_conforms

PNG = base64.b64encode(encode(pattern(224, 224, seed=7), ".png")).decode()
PICTURE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city today.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}  # parallel calls may go on to max_tokens
GREEDY = {"temperature": 0}  # the API takes it; this client release has no argument for it


def sdk(base: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(shared_server):
    return sdk(shared_server)


def user(*content) -> list[dict]:
    """One user message: a string, or blocks."""
    return [{"role": "user", "content": content[0] if isinstance(content[0], str) else list(content)}]


def test_a_text_message_with_a_system_prompt(client):
    reply = client.messages.create(model="qwen3-vl", max_tokens=8, system="Answer briefly.", messages=user("Hello"))
    assert (reply.type, reply.role) == ("message", "assistant") and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert reply.usage.output_tokens == 8 if reply.stop_reason == "max_tokens" else reply.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model="qwen3-vl", system="Answer briefly.", messages=user("Hello"))
    sdk_conforms(reply, counted)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens


def test_a_picture_as_a_base64_block_is_seen(client):
    text = {"type": "text", "text": "What is in this picture?"}
    with_picture = client.messages.count_tokens(model="m", messages=user(PICTURE, text)).input_tokens
    without = client.messages.count_tokens(model="m", messages=user(text)).input_tokens
    assert with_picture - without >= 49  # 224x224: 49 visual tokens, plus the picture's markers
    reply = client.messages.create(model="m", max_tokens=4, messages=user(PICTURE, text))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == with_picture


def test_a_tool_loop_calls_the_tool_then_answers_from_its_result_reusing_the_prompt(client):
    question = user("What is the weather in Paris?")
    call = client.messages.create(model="m", max_tokens=200, messages=question, tools=[WEATHER], tool_choice=ONE_CALL)
    assert call.stop_reason == "tool_use"
    sdk_conforms(call)
    uses = [b for b in call.content if b.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    history = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21"}]},
    ]
    answer = client.messages.create(model="m", max_tokens=6, messages=history, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.cache_read_input_tokens > 0  # the first turn's prompt came from the cache


def test_a_stream_sends_anthropics_event_sequence_and_the_same_message(client):
    kwargs = dict(model="m", max_tokens=12, messages=user("Tell me something."), extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    sdk_conforms(whole, final, *events)
    kinds = [e.type for e in events if e.type not in ("text",)]  # "text": the client's own helper events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[kinds.index("content_block_start") : kinds.index("message_delta")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens
    )


def test_a_streamed_tool_call_arrives_as_input_json_deltas(client):
    with client.messages.stream(
        model="m",
        max_tokens=200,
        messages=user("Weather in Rome?"),
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    sdk_conforms(final, *events)
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].name == "get_weather"
    assert starts[0].id.startswith("toolu_") and final.content[0].id == starts[0].id
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == final.content[0].input
    assert final.stop_reason == "tool_use"
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])


@pytest.mark.parametrize("max_tokens", BEFORE_THE_NAME)
def test_a_forced_tool_call_cut_before_its_name_shows_no_markup(client, max_tokens):
    """No block at all, whole or streamed: the message was cut (max_tokens), never a `<tool_call…` text."""
    kwargs = dict(model="m", max_tokens=max_tokens, messages=user("Weather?"), tools=[WEATHER], tool_choice=ONE_CALL)
    reply = client.messages.create(**kwargs, extra_body=GREEDY)
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    sdk_conforms(reply, final, *events)
    for message in (reply, final):
        assert (message.stop_reason, message.content, message.usage.output_tokens) == ("max_tokens", [], max_tokens)
    assert not any(e.type.startswith("content_block") for e in events)


VERDICT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 16}},
    "required": ["answer", "why"],
    "additionalProperties": False,
}
STRUCTURED_OUTPUTS_BETA = "structured-outputs-2025-11-13"


def test_the_structured_outputs_betas_output_format_is_followed(client):
    """LiteLLM's form of structured outputs: the beta's header and a top-level output_format, honoured
    as output_config.format is (before, it was ignored: free text)."""
    fmt = {"type": "json_schema", "schema": VERDICT}
    kwargs = dict(model="m", messages=user("Is it a cat?"), betas=[STRUCTURED_OUTPUTS_BETA])
    reply = client.beta.messages.create(max_tokens=60, **kwargs, extra_body={"output_format": fmt, "temperature": 0})
    sdk_conforms(reply)
    assert reply.stop_reason == "end_turn" and [b.type for b in reply.content] == ["text"]
    jsonschema.validate(json.loads(reply.content[0].text), VERDICT)
    same = client.messages.create(
        max_tokens=60, model="m", messages=kwargs["messages"], output_config={"format": fmt}, extra_body=GREEDY
    )
    assert same.content[0].text == reply.content[0].text
    with pytest.raises(anthropic.BadRequestError) as info:  # both forms at once: which one is meant?
        client.beta.messages.create(
            max_tokens=60, **kwargs, output_config={"format": fmt}, extra_body={"output_format": fmt}
        )
    assert "output_format" in info.value.body["error"]["message"]


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    kwargs = dict(model="m", max_tokens=30, messages=user("Keep talking."), extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"the random answer has no text to stop at: {text!r}"
    reply = client.messages.create(**kwargs, stop_sequences=[stop, "never-there"])
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert reply.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    "body,words",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "'document'",
        ),
        (
            {
                "max_tokens": 4,
                "messages": user({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}),
            },
            "fetches nothing",
        ),
        ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, "temperature"),
        ({"max_tokens": 99999, "messages": [{"role": "user", "content": "hi"}]}, "MAX_NEW_TOKENS"),
    ],
    ids=["no max_tokens", "unsupported block", "remote image", "temperature", "over the cap"],
)
def test_bad_requests_get_anthropic_shaped_400s(client, shared_server, body, words):
    r = requests.post(shared_server + "/v1/messages", json={"model": "m", **body})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and words in r.json()["error"]["message"]


def test_the_client_sees_errors_in_anthropics_shape_as_its_exceptions(client, shared_server):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=4, messages=user("hi"), extra_body={"temperature": 1.5})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    missing = requests.post(shared_server + "/v1/messages/nowhere", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_x_api_key_is_accepted_as_the_key(keyed_server):
    base, _ = keyed_server
    reply = sdk(base, api_key=KEY).messages.create(model="m", max_tokens=2, messages=user("Hi"))
    assert reply.usage.output_tokens <= 2
    with pytest.raises(anthropic.AuthenticationError) as info:
        sdk(base, api_key="wrong-key").messages.create(model="m", max_tokens=2, messages=user("Hi"))
    assert info.value.body["error"]["type"] == "authentication_error"
