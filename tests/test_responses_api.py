"""OpenAI's Responses API on the shared Gunicorn, through the official client as a user writes it:
input as text or items (a picture too), instructions, a stored conversation continued by
previous_response_id (its KV reused), store: false, structured outputs and `parse`, function calls, the
typed stream and `responses.stream`, GET and DELETE. The model is random: shapes, events and counts."""

from __future__ import annotations

import json
import logging

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from conftest import BEFORE_THE_NAME, app_on, make_settings
from imaging import data_url, encode, pattern
from sdk_types import ResponseItemList, conforms, sdk_conforms
from servers import openai_client

PICTURE = data_url(encode(pattern(224, 224, seed=11), ".png"))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city today.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def client(shared_server):
    return openai_client(shared_server)


def test_a_string_input_with_instructions_gets_a_stored_response(client):
    reply = client.responses.create(model="m", input="Hello", instructions="Answer briefly.", max_output_tokens=8)
    sdk_conforms(reply)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.status in ("completed", "incomplete")
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output_text == reply.output[0].content[0].text
    usage = reply.usage
    assert usage.output_tokens <= 8 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 8
    assert client.responses.retrieve(reply.id).model_dump() == reply.model_dump()


def test_previous_response_id_continues_the_stored_conversation_from_its_kv_cache(client):
    picture = {"type": "input_image", "image_url": PICTURE}
    first = client.responses.create(
        model="m",
        input=[{"role": "user", "content": [picture, {"type": "input_text", "text": "What is this?"}]}],
        max_output_tokens=6,
        extra_body={"temperature": 0},
    )
    second = client.responses.create(
        model="m", input="And its colour?", previous_response_id=first.id, max_output_tokens=6
    )
    assert second.previous_response_id == first.id
    # the whole first turn (its picture, question and answer) is in the prompt, and came from the cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    third = client.responses.create(model="m", input="Why?", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens


def test_store_false_keeps_nothing_and_delete_forgets(client):
    unstored = client.responses.create(model="m", input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="m", input="Go on", previous_response_id=unstored.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    stored = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


class Verdict(BaseModel):
    answer: bool
    reason: str = Field(max_length=20)


def test_parse_gets_its_pydantic_model_and_a_schema_is_followed(client):
    parsed = client.responses.parse(model="m", input="Is it a cat?", text_format=Verdict, extra_body={"seed": 3})
    assert isinstance(parsed.output_parsed, Verdict) and parsed.status == "completed"
    sdk_conforms(parsed)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}}
    reply = client.responses.create(model="m", input="How many?", text=fmt, max_output_tokens=60)
    assert reply.status == "completed" and list(json.loads(reply.output_text)) == ["n"]


def test_the_text_format_is_echoed_as_openai_echoes_it(client):
    """Free text and any JSON object are a bare type (no name: openai-python's types have none there)."""
    for sent, echoed in (
        (None, {"type": "text"}),
        ({"type": "text"}, {"type": "text"}),
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": False},
            {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": False},
        ),
    ):
        text = {"format": sent} if sent else None
        reply = client.responses.create(model="m", input="Hi", max_output_tokens=2, **({"text": text} if text else {}))
        sdk_conforms(reply)
        assert reply.text.format.to_dict() == echoed


def test_a_function_call_then_its_output_continue_the_conversation(client):
    call = client.responses.create(
        model="m", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    sdk_conforms(call)
    calls = [item for item in call.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "cloudy, 8"}
    answer = client.responses.create(
        model="m", input=[result], previous_response_id=call.id, tools=[WEATHER], max_output_tokens=4
    )
    assert answer.usage.input_tokens_details.cached_tokens > 0 and answer.status in ("completed", "incomplete")
    items = client.responses.input_items.list(answer.id, order="asc").data
    sdk_conforms(*items)
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
    assert items[1].id == calls[0].id and items[2].call_id == calls[0].call_id and items[2].output == "cloudy, 8"


@pytest.mark.parametrize("max_tokens", BEFORE_THE_NAME)
def test_a_forced_function_call_cut_before_its_name_shows_no_markup(client, max_tokens):
    """No item at all, whole or streamed: the response is incomplete, never a `<tool_call…` output_text."""
    kwargs = dict(model="m", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required")
    kwargs.update(max_output_tokens=max_tokens, extra_body={"temperature": 0})
    reply = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    sdk_conforms(reply, *events)
    for response in (reply, events[-1].response):
        assert (response.status, response.output, response.output_text) == ("incomplete", [], "")
        assert response.usage.output_tokens == max_tokens
    assert not any(e.type.startswith(("response.output_", "response.content_part")) for e in events)


def test_input_items_list_what_a_response_was_made_from_page_by_page(client, shared_server):
    """OpenAI's input items: the stored conversation the response continues (earlier inputs and outputs)
    and its own input, newest first unless asked, in pages the client walks by `after`."""
    picture = {"type": "input_image", "image_url": PICTURE, "detail": "low"}
    question = [{"role": "user", "content": [picture, {"type": "input_text", "text": "What is this?"}]}]
    first = client.responses.create(model="m", input=question, instructions="Be brief.", max_output_tokens=3)
    second = client.responses.create(model="m", input="And then?", previous_response_id=first.id, max_output_tokens=3)
    items = list(client.responses.input_items.list(second.id, order="asc", limit=1))  # three pages
    sdk_conforms(*items)
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert [part.type for part in items[0].content] == ["input_image", "input_text"]
    assert items[0].content[0].image_url is None and items[0].content[1].text == "What is this?"  # URLs on request
    assert items[1].id == first.output[0].id and items[1].content[0].text == first.output_text
    assert items[2].content[0].text == "And then?"
    newest_first = requests.get(f"{shared_server}/v1/responses/{second.id}/input_items", timeout=30).json()
    conforms(ResponseItemList, newest_first)
    assert [item["id"] for item in newest_first["data"]] == [item.id for item in reversed(items)]
    assert (newest_first["first_id"], newest_first["last_id"], newest_first["has_more"]) == (
        items[2].id,
        items[0].id,
        False,
    )
    with_urls = client.responses.input_items.list(first.id, include=["message.input_image.image_url"])
    assert with_urls.data[0].content[0].image_url == PICTURE
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_0123456789abcdef")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_items.list(second.id, limit=101)
    assert info.value.body["param"] == "limit"


def test_the_stream_sends_the_typed_events_and_the_same_response(client):
    kwargs = dict(model="m", input="Tell me something.", max_output_tokens=10, extra_body={"temperature": 0})
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    sdk_conforms(whole, *events)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_the_clients_stream_helper_gets_the_completed_parsed_response(client):
    with client.responses.stream(
        model="m", input="Is it a cat?", text_format=Verdict, extra_body={"seed": 5}
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas
    assert isinstance(final.output_parsed, Verdict) and client.responses.retrieve(final.id).output_text == deltas


def test_a_streamed_function_call_arrives_as_arguments_deltas(client):
    events = list(
        client.responses.create(
            model="m", input="Weather in Rome?", tools=[WEATHER], tool_choice="required", stream=True
        )
    )
    sdk_conforms(*events)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done.arguments
    assert events[-1].response.output[0].arguments == done.arguments


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"input": [{"type": "input_file", "file_id": "f"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": ""}]}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"max_output_tokens": 99999}, "max_output_tokens"),
        ({"background": True}, "background"),
    ],
    ids=["input_file item", "audio part", "hosted tool", "over the cap", "background"],
)
def test_what_is_not_supported_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": "m", "input": "hi", **extra})
    assert info.value.body["param"] == param


def schema_format(schema: dict) -> dict:
    return {"text": {"format": {"type": "json_schema", "name": "answer", "schema": schema}}}


@pytest.mark.parametrize(
    "extra,param",
    [
        (schema_format({"type": "nonsense"}), "text.format.schema"),
        (schema_format({"type": "string", "pattern": "(?=a)b"}), "text.format"),
        ({"tools": [{**WEATHER, "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
        ({"input": "word " * 6000}, "input"),
        ({"input": "<|vision_start|>"}, "input"),
    ],
    ids=["invalid schema", "schema not enforceable", "invalid tool parameters", "prompt too long", "placeholder"],
)
def test_an_error_names_the_field_of_the_responses_request(client, extra, param):
    """Not the Chat Completions field the service translates it to (response_format, messages...)."""
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(**{"model": "m", "input": "hi", **extra})
    assert info.value.status_code in (400, 422) and info.value.body["param"] == param


def test_the_agents_sdk_runs_a_tool_loop_on_its_default_responses_model(shared_server):
    """The OpenAI Agents SDK's default model (OpenAIResponsesModel) unmodified: a forced tool call, the
    tool's output sent back (previous_response_id off: the SDK resends items), then a final answer."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_time() -> str:
        """The time now."""
        calls.append(1)
        return "noon"

    model = OpenAIResponsesModel(
        "qwen3-vl", AsyncOpenAI(base_url=shared_server + "/v1", api_key="unused", max_retries=0)
    )
    settings = ModelSettings(tool_choice="required", max_tokens=60, temperature=0)
    agent = Agent(
        name="clock", instructions="Be brief.", model=model, tools=[get_time], model_settings=settings, output_type=Noon
    )  # a structured final answer: the random model's text would run to max_tokens (incomplete: an error there)
    result = Runner.run_sync(agent, "Is it noon?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert calls == [1] and kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Noon)


class Noon(BaseModel):
    noon: bool


def test_a_stored_response_outlives_a_restart_where_the_disk_tier_is_on(serve, tmp_path):
    """Stopped and started again (the disk tier's folder kept), the server still has the response, its
    conversation (a picture in it) and that conversation's keys and values."""
    env = {"KV_DISK_DIR": str(tmp_path / "kv")}
    picture = {"type": "input_image", "image_url": PICTURE}
    question = [{"role": "user", "content": [picture, {"type": "input_text", "text": "What is it?"}]}]
    with serve(env, "responses-restart") as (base, _):
        first = openai_client(base).responses.create(model="m", input=question, max_output_tokens=6)
    with serve(env, "responses-restart") as (base, _):
        client = openai_client(base)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        assert [item.type for item in client.responses.input_items.list(first.id).data] == ["message"]
        second = client.responses.create(
            model="m", input="And then?", previous_response_id=first.id, max_output_tokens=4
        )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_responses_folder_the_disk_refuses_keeps_them_in_memory(tmp_path, loaded_model, caplog):
    """CACHE_DIR/responses taken by a file: the server starts, stores each response in memory with a
    warning, and serves it back — a disk that fails the folder is never an error to a client."""
    (tmp_path / "responses").write_text("not a folder")
    settings = make_settings(tmp_path, kv_disk_dir=tmp_path / "kv")
    client = app_on(loaded_model("int8"), settings).test_client()
    with caplog.at_level(logging.WARNING, logger="service.api.responses.files"):
        made = client.post("/v1/responses", json={"model": "m", "input": "Hello.", "max_output_tokens": 4})
    assert made.status_code == 200
    assert any("not written" in r.getMessage() for r in caplog.records)
    again = client.get(f"/v1/responses/{made.json['id']}")
    assert again.status_code == 200 and again.json["output"] == made.json["output"]
