"""Structured outputs, tool calls and logprobs through a real Gunicorn, as the official openai client
(and curl, on the native endpoint) uses them."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests
from pydantic import BaseModel, Field
from test_structured import RECEIPT, YES_NO

from sdk_types import sdk_conforms
from servers import metric, openai_client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


@pytest.fixture
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(shared_server):
    return openai_client(shared_server)


def user(text="Read the receipt in this message."):
    return [{"role": "user", "content": text}]


def json_schema_format(schema: dict, name="receipt") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_client_gets_json_valid_against_its_schema(client, seed):
    response = client.chat.completions.create(
        model="m",
        messages=user(),
        response_format=json_schema_format(RECEIPT),
        temperature=1.0,
        seed=seed,
        max_tokens=300,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), RECEIPT)


def test_streamed_json_is_the_same_json(client):
    kwargs = dict(model="m", messages=user(), response_format=json_schema_format(YES_NO), seed=4, temperature=1.0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(streamed), YES_NO)


class Verdict(BaseModel):
    answer: bool
    reason: str = Field(max_length=30)
    score: int = Field(ge=0, le=9)


def test_the_clients_parse_helper_gets_its_pydantic_model(client):
    """client.chat.completions.parse builds a strict schema from the model and parses the answer into it."""
    parsed = client.chat.completions.parse(
        model="m", messages=user("Is this a cat?"), response_format=Verdict, seed=1, temperature=1.0
    )
    verdict = parsed.choices[0].message.parsed
    assert isinstance(verdict, Verdict) and 0 <= verdict.score <= 9
    assert parsed.choices[0].finish_reason == "stop"


def test_json_object_mode_gives_a_json_object(client):
    finished = 0
    for seed in range(3):
        response = client.chat.completions.create(
            model="m",
            messages=user("Answer in JSON."),
            response_format={"type": "json_object"},
            seed=seed,
            temperature=1.0,
            max_tokens=400,
        )
        choice = response.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
        else:  # an object with no schema may go on: cut short, it says so
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert finished >= 1  # at least one whole object was parsed


def test_max_tokens_cutting_the_json_is_finish_length(client):
    response = client.chat.completions.create(
        model="m", messages=user(), response_format=json_schema_format(RECEIPT), max_tokens=5
    )
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            dict(response_format=json_schema_format({"type": "object", "properties": {"a": {"pattern": "(?<=x)"}}})),
            "response_format",
        ),
        (dict(response_format=json_schema_format({"type": "bogus"})), "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (dict(response_format={"type": "xml"}), "response_format.type"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (
            dict(tools=[{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": 7}}}]),
            "tools[0].function.parameters",
        ),
        (dict(response_format=json_schema_format({"type": "array", "uniqueItems": True})), "response_format"),
        (
            dict(response_format=json_schema_format({"if": {"type": "integer"}, "then": {"minimum": 0}})),
            "response_format",
        ),
        (dict(response_format=json_schema_format({"not": {"type": "string"}})), "response_format"),
        (
            dict(response_format=json_schema_format({"type": "object", "title": "\ud800"})),
            "response_format.json_schema.schema",
        ),
        (
            dict(tools=[{**WEATHER, "function": {**WEATHER["function"], "description": "\udfff"}}]),
            "tools.0.function.description",
        ),
        (dict(top_logprobs=3), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logit_bias={"12": 101}), "logit_bias.12"),
        (dict(logit_bias={"a token": 1}), "logit_bias.a token.[key]"),
        (dict(logit_bias={"99999999": 1}), "logit_bias"),
        (dict(n=2), "n"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_what_cannot_be_honoured_is_a_clear_400_and_the_server_keeps_serving(server, body, param):
    response = requests.post(server + "/v1/chat/completions", json={"messages": user(), **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert requests.post(server + "/v1/chat/completions", json={"messages": user(), "max_tokens": 2}, timeout=60).ok


def test_required_tool_choice_gives_a_call_that_parses_then_the_loop_goes_on(client):
    """The client's own tool loop, unmodified: call, run the tool, send its result back, get an answer."""
    messages = user("What is the weather in Paris?")
    response = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER, CLOCK], tool_choice="required", seed=3, temperature=1.0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    messages.append(choice.message)
    for call in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"})
    follow_up = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER, CLOCK], max_tokens=8, seed=1
    )
    assert isinstance(follow_up.choices[0].message.content, str)
    assert follow_up.usage.prompt_tokens > response.usage.prompt_tokens  # the call and its result are in the prompt
    # The second turn is nearly free: the first turn's prompt (tools included) comes from the KV cache.
    assert follow_up.usage.prompt_tokens_details.cached_tokens >= response.usage.prompt_tokens


def test_a_named_function_is_the_one_called_once(client):
    response = client.chat.completions.create(
        model="m",
        messages=user("Time?"),
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=7,
    )
    calls = response.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    assert response.choices[0].message.content is None


def test_streamed_tool_calls_arrive_as_delta_tool_calls_arguments_piece_by_piece(client):
    kwargs = dict(
        model="m",
        messages=user("Weather?"),
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        seed=2,
        temperature=1.0,
        logprobs=True,
    )
    response = client.chat.completions.create(**kwargs)
    whole = response.choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    sdk_conforms(response, *chunks)
    # Every generated token's logprob arrives with the chunk its text went out in, calls included.
    streamed = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in response.choices[0].logprobs.content] and streamed
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    calls: dict[int, dict] = {}
    for d in deltas:  # as a client accumulates them: the first piece of a call names it
        if d.index not in calls:
            assert d.id.startswith("call_") and d.function.name
            calls[d.index] = {"name": d.function.name, "arguments": "", "pieces": 0}
        else:
            assert d.id is None and d.function.name is None
        calls[d.index]["arguments"] += d.function.arguments or ""
        calls[d.index]["pieces"] += 1
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert list(calls) == list(range(len(whole))) and all(c["pieces"] > 2 for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The client's own stream helper assembles the same calls.
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in final] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_a_tool_call_cut_short_by_max_tokens_is_finish_length(client):
    response = client.chat.completions.create(
        model="m", messages=user("Weather?"), tools=[WEATHER], tool_choice="required", max_tokens=12
    )
    assert response.choices[0].finish_reason == "length"


def test_tools_are_shown_to_the_model_unless_tool_choice_is_none(client):
    def prompt_tokens(**kwargs):
        return client.chat.completions.create(
            model="m", messages=user("Hi"), max_tokens=1, **kwargs
        ).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=[WEATHER]) > plain + 50
    assert prompt_tokens(tools=[WEATHER], tool_choice="none") == plain


def test_logprobs_in_the_openai_shape_streamed_and_not(client):
    kwargs = dict(
        model="m", messages=user("Say something."), max_tokens=10, logprobs=True, top_logprobs=3, temperature=0
    )
    response = client.chat.completions.create(**kwargs)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens - (response.choices[0].finish_reason == "stop")
    # The random model emits stray bytes: its text shows U+FFFD where they are, as their decode does.
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == response.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob >= token.logprob - 1e-6  # greedy: the chosen one is the top one
        assert token.top_logprobs[0].token == token.token
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs]
    sdk_conforms(response, *chunks)
    streamed = [t for c in chunks for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == pytest.approx([(t.token, t.logprob) for t in content])
    plain = client.chat.completions.create(model="m", messages=user("Say something."), max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_the_native_endpoint_takes_response_format_and_logprobs(server):
    body = {
        "prompt": "Is it a cat?",
        "response_format": json_schema_format(YES_NO, "verdict"),
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 3,
        "temperature": 1.0,
    }
    lines = [json.loads(line) for line in requests.post(server + "/v1/chat", json=body, timeout=60).iter_lines()]
    deltas, done = lines[1:-1], lines[-1]
    assert done["done"] and done["finish_reason"] == "stop"
    jsonschema.validate(json.loads(done["text"]), YES_NO)
    assert "".join(d["delta"] for d in deltas) == done["text"]
    assert [t for d in deltas for t in d["logprobs"]] == done["logprobs"]
    assert all(len(t["top_logprobs"]) <= 2 for t in done["logprobs"])
    # Where the schema leaves a choice (the JSON's text), two alternatives; where it does not, one.
    assert all(len(t["top_logprobs"]) >= 1 for t in done["logprobs"])
    assert any(len(t["top_logprobs"]) == 2 for t in done["logprobs"])
    form = {"prompt": "Is it?", "logprobs": "true", "top_logprobs": "1", "stream": "false", "max_tokens": "3"}
    answer = requests.post(server + "/v1/chat", files={k: (None, v) for k, v in form.items()}, timeout=60).json()
    assert len(answer["logprobs"]) == answer["usage"]["completion_tokens"] - (answer["finish_reason"] == "stop")
    refused = requests.post(server + "/v1/chat", json={"prompt": "x", "tools": [WEATHER]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


# 40 levels are enforced; deeper ones are too deep for the JSON Schema check: a 400 naming the schema.
DEEP_SCHEMA_OUTCOME = {
    40: (200, None),
    300: (400, "response_format.json_schema.schema"),
    900: (400, "response_format.json_schema.schema"),
}


@pytest.mark.parametrize("depth", [40, 300, 900])
def test_a_deeply_nested_schema_is_refused_or_enforced_never_a_crash(server, depth):
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    body = {"messages": user(), "response_format": json_schema_format(schema), "max_tokens": 4}
    response = requests.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200:
        assert response.json()["choices"][0]["message"]["content"].startswith("[")
    expected_status, expected_param = DEEP_SCHEMA_OUTCOME[depth]
    assert response.status_code == expected_status, response.text
    if expected_status == 200:
        choice = response.json()["choices"][0]
        assert set(choice["message"]["content"]) == {"["} and choice["finish_reason"] == "length"
    else:
        assert response.json()["error"]["param"] == expected_param
    assert requests.post(server + "/v1/chat/completions", json={"messages": user(), "max_tokens": 2}, timeout=60).ok


def test_the_openapi_document_covers_the_new_fields(server):
    document = requests.get(server + "/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    openai_fields = schemas["ChatCompletionRequest"]["properties"]
    for name in ("response_format", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs"):
        assert name in openai_fields, name
    native_fields = {"response_format", "logprobs", "top_logprobs", "max_pixels"}
    assert native_fields <= set(schemas["NativeChatRequest"]["properties"])
    formats = {"text", "json_object", "json_schema", "grounding"}
    assert set(schemas["ResponseFormat"]["properties"]["type"]["enum"]) == formats
    assert "boxes" in schemas["NativeDone"]["properties"] and "boxes" in schemas["AssistantMessage"]["properties"]
    assert "tool" in schemas["Message"]["properties"]["role"]["enum"]
    form = document["paths"]["/v1/chat"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["response_format"]["$ref"] == "#/components/schemas/ResponseFormat"


def test_without_parallel_tool_calls_required_gives_exactly_one_call(client):
    for seed in range(3):
        response = client.chat.completions.create(
            model="m",
            messages=user("Weather and time?"),
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
        )
        assert len(response.choices[0].message.tool_calls) == 1


def test_auto_with_a_response_format_answers_in_that_format_or_calls_a_tool(client):
    for seed in range(4):
        response = client.chat.completions.create(
            model="m",
            messages=user("Is it sunny?"),
            tools=[WEATHER],
            response_format=json_schema_format(YES_NO, "verdict"),
            temperature=1.0,
            seed=seed,
        )
        message = response.choices[0].message
        if message.tool_calls:
            assert (
                response.choices[0].finish_reason == "tool_calls"
                and message.tool_calls[0].function.name == "get_weather"
            )
        else:
            jsonschema.validate(json.loads(message.content), YES_NO)


def test_grammar_compiles_are_counted_by_outcome(server):
    def count(result):
        return metric(server, "qwen3vl_grammars_total", f'result="{result}"')

    before = {r: count(r) for r in ("compiled", "hit", "invalid")}
    schema = {**YES_NO, "title": "metrics probe"}
    body = {"messages": user(), "response_format": json_schema_format(schema), "max_tokens": 40}
    for _ in range(2):
        assert requests.post(server + "/v1/chat/completions", json=body, timeout=60).ok
    bad = {**body, "response_format": json_schema_format({"type": "string", "pattern": "(?<=x)"})}
    assert requests.post(server + "/v1/chat/completions", json=bad, timeout=60).status_code == 400
    assert {r: count(r) - before[r] for r in before} == {"compiled": 1, "hit": 1, "invalid": 1}
