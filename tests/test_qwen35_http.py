"""A Qwen3.5 checkpoint served by a real Gunicorn (MODEL_PATH at `tiny-qwen35`, INT8 at load) on every
endpoint: the native one (a picture, a clip, a follow-up from the cache), Chat Completions through the
official client (a picture, streaming, JSON Schema, grounding, the thinking switch, a forced tool call in
Qwen3.5's XML form), Responses (a chain continued from the cache), Anthropic Messages, and a batch."""

from __future__ import annotations

import base64
import json
import time

import pytest
import requests

from clips import write_clip
from imaging import data_url, encode, pattern

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


@pytest.fixture(scope="module")
def server(serve, cache_dir):
    from conftest import built_preset

    path = built_preset(cache_dir, "tiny-qwen35")
    with serve({"MODEL_PATH": str(path), "MAX_NEW_TOKENS": "200"}, "qwen35") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    from servers import openai_client

    return openai_client(server)


def picture_url(seed: int = 0) -> str:
    return data_url(encode(pattern(96, 64, seed=seed), ".png"))


def native(server, **body) -> list[dict]:
    reply = requests.post(f"{server}/v1/chat", json={"max_tokens": 12, "temperature": 0, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return [json.loads(line) for line in reply.text.splitlines()]


def test_the_native_endpoint_answers_a_picture_and_a_follow_up_reuses_its_state(server):
    first = native(server, prompt="What is in this picture?", images=[picture_url()])
    done = first[-1]
    assert done["done"] and done["usage"]["completion_tokens"] == 12 and done["image_tokens"][0] > 0
    follow = native(server, conversation_id=first[0]["conversation_id"], prompt="And the colours?")[-1]
    assert follow["usage"]["cached_tokens"] > 0  # the recurrent state kept where the next turn resumes


def test_a_clip_is_answered(server, tmp_path):
    clip = write_clip(tmp_path / "clip.mp4", frames=12, fps=6.0)
    reply = requests.post(
        f"{server}/v1/chat",
        files={"video": ("clip.mp4", clip, "video/mp4")},
        data={"prompt": "What moves?", "max_tokens": "8"},
        timeout=120,
    )
    done = json.loads(reply.text.splitlines()[-1])
    assert reply.status_code == 200 and done["done"] and done["video_tokens"][0] > 0


def test_chat_completions_streams_a_picture_answer(client):
    content = [{"type": "image_url", "image_url": {"url": picture_url(1)}}, {"type": "text", "text": "Describe it."}]
    reply = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0
    )
    assert reply.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0, stream=True
        )
    )
    streamed = "".join(
        (c.choices[0].delta.content or "") + (c.choices[0].delta.model_extra or {}).get("reasoning_content", "")
        for c in chunks
        if c.choices
    )
    answer = reply.choices[0].message
    assert streamed == (answer.model_extra.get("reasoning_content") or "") + (answer.content or "")


def test_a_json_schema_answer_parses_and_grounding_gives_boxes(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
        extra_body={"enable_thinking": False},
    )
    assert set(json.loads(reply.choices[0].message.content)) == {"colour", "count"}
    content = [{"type": "image_url", "image_url": {"url": picture_url(2)}}, {"type": "text", "text": "Locate it."}]
    grounded = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": content}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "grounding"},
        extra_body={"enable_thinking": False},
    )
    assert isinstance(grounded.choices[0].message.model_extra["boxes"], list)


def test_the_thinking_switch_closes_the_reasoning(client):
    """Qwen3.5 thinks by default; `enable_thinking: false` renders its template's closed block: no reasoning."""
    messages = [{"role": "user", "content": "Hello there."}]
    on = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0)
    off = client.chat.completions.create(
        model="any", messages=messages, max_tokens=8, temperature=0, extra_body={"enable_thinking": False}
    )
    assert on.usage.completion_tokens_details.reasoning_tokens > 0
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_forced_tool_call_is_read_from_the_xml_form(client):
    reply = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "The weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0,
        extra_body={"enable_thinking": False},
    )
    (call,) = reply.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "days"}
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int)
    assert "<function=" not in (reply.choices[0].message.content or "")
    # the call goes back into the history in the XML form, and the conversation goes on
    follow = client.chat.completions.create(
        model="any",
        messages=[
            {"role": "user", "content": "The weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny."},
        ],
        tools=[WEATHER],
        max_tokens=6,
        temperature=0,
    )
    assert follow.usage.completion_tokens == 6


def test_a_responses_chain_continues_from_the_cache(client):
    first = client.responses.create(model="any", input="Tell me about a red square.", max_output_tokens=10)
    second = client.responses.create(
        model="any", input="And a blue one?", previous_response_id=first.id, max_output_tokens=10
    )
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_anthropic_messages_answer_a_picture(server):
    import anthropic

    sdk = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)
    png = base64.b64encode(encode(pattern(64, 64, seed=3), ".png")).decode()
    message = sdk.messages.create(
        model="any",
        max_tokens=8,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    )
    assert message.usage.output_tokens == 8


def test_a_batch_is_answered(client):
    line = {
        "custom_id": "q1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "any", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 5},
    }
    uploaded = client.files.create(file=("q.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    (answer,) = [json.loads(row) for row in client.files.content(batch.output_file_id).text.splitlines()]
    assert answer["custom_id"] == "q1" and answer["response"]["body"]["usage"]["completion_tokens"] == 5
