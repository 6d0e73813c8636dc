"""A thinking checkpoint served by a real Gunicorn (MODEL_PATH at `tiny-thinking`): the reasoning apart
from the answer on both endpoints and in the official client, the switches, tools and JSON behind
the reasoning, logprobs marked, a conversation's cache reuse, and the command line."""

from __future__ import annotations

import json
import re

import anthropic
import pytest
import requests

from conftest import run_cli
from sdk_types import sdk_conforms

QUESTION = "Tell me a long story about a red square and a blue circle, with many details."
CLOSING = 3  # </think> and the separator (two "\n" tokens in the tiny tokenizer)


@pytest.fixture(scope="module")
def server(serve, tiny_thinking_dir):
    """MAX_NEW_TOKENS unset: the cap is a thinking checkpoint's default."""
    with serve({"MODEL_PATH": str(tiny_thinking_dir)}, "thinking") as (base, _):
        yield base


@pytest.fixture(scope="module")
def no_end(tiny_thinking_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_thinking_dir)
    return {str(tokenizer.convert_tokens_to_ids(t)): -100 for t in ("<|im_end|>", "<|endoftext|>")}


def openai_body(no_end, **extra) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0,
            "logit_bias": no_end, **extra}  # fmt: skip


def test_ready_and_the_model_card_say_it_is_a_thinking_checkpoint(server):
    from servers import openai_client

    assert requests.get(f"{server}/ready", timeout=10).json()["thinking"] is True
    assert openai_client(server).models.list().data[0].model_extra["thinking"] is True


def test_the_openai_client_reads_the_reasoning_apart_streamed_or_not(server, no_end):
    from servers import openai_client

    client = openai_client(server)
    body = openai_body(no_end, max_thinking_tokens=6)
    messages, max_tokens = body.pop("messages"), body.pop("max_tokens")
    reply = client.chat.completions.create(
        model="any", messages=messages, max_tokens=max_tokens, temperature=0, extra_body=body
    )
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.model_extra["reasoning"] == reasoning and "</think>" not in message.content
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6 + CLOSING
    assert reply.usage.completion_tokens == 24
    chunks = client.chat.completions.create(
        model="any", messages=messages, max_tokens=max_tokens, temperature=0, extra_body=body, stream=True
    )
    order = []
    for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and (delta.model_extra or {}).get("reasoning_content"):
            order.append(("reasoning", delta.model_extra["reasoning_content"]))
        if delta is not None and delta.content:
            order.append(("content", delta.content))
    kinds = [kind for kind, _ in order]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] == "reasoning"  # all reasoning, then the answer
    assert "".join(t for k, t in order if k == "reasoning") == reasoning
    assert "".join(t for k, t in order if k == "content") == message.content


def test_native_lines_bring_the_reasoning_first_and_a_follow_up_reuses_the_cache(server, no_end):
    def chat(**body):
        lines = requests.post(f"{server}/v1/chat", json={"max_tokens": 20, "logit_bias": no_end, **body}, timeout=60)
        return [json.loads(line) for line in lines.text.splitlines()]

    first = chat(prompt=QUESTION, max_thinking_tokens=5)
    kinds = [("reasoning" if "reasoning" in o else "delta") for o in first[1:-1]]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] == "reasoning"
    done = first[-1]
    assert done["reasoning"] == "".join(o["reasoning"] for o in first[1:-1] if "reasoning" in o)
    assert done["text"] == "".join(o["delta"] for o in first[1:-1] if "delta" in o)
    assert done["usage"]["reasoning_tokens"] == 5 + CLOSING
    second = chat(prompt="And then?", conversation_id=done["conversation_id"], max_thinking_tokens=5)[-1]
    # the history renders without the first answer's reasoning: the first prompt is what is reused
    assert second["usage"]["cached_tokens"] >= done["usage"]["prompt_tokens"] - 2


def test_anthropic_thinking_has_room_and_its_budget_is_bounded_as_anthropics(server):
    """A valid `thinking: enabled` request (a budget of at least 1,024 tokens, max_tokens above it) is
    served: the cap left room for it (before: 400, over MAX_NEW_TOKENS' 1,024). A smaller budget, or a
    max_tokens not above it, is a 400 as Anthropic answers it."""
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=300)
    question = [{"role": "user", "content": QUESTION}]
    reply = client.messages.create(
        model="m", max_tokens=1100, thinking={"type": "enabled", "budget_tokens": 1024}, messages=question
    )
    sdk_conforms(reply)
    assert reply.content[0].type == "thinking" and reply.usage.output_tokens <= 1100
    for max_tokens, budget, words in ((1100, 1023, "budget_tokens"), (2000, 2000, "greater than thinking.budget")):
        thinking = {"type": "enabled", "budget_tokens": budget}
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="m", max_tokens=max_tokens, thinking=thinking, messages=question)
        assert words in info.value.body["error"]["message"]


@pytest.mark.parametrize(
    "switch",
    [{"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}, {"reasoning_effort": "minimal"}],
    ids=["chat_template_kwargs", "enable_thinking", "reasoning_effort"],
)
def test_thinking_switched_off_gives_an_answer_without_reasoning(server, no_end, switch):
    reply = requests.post(f"{server}/v1/chat/completions", json=openai_body(no_end, **switch), timeout=60).json()
    assert reply["choices"][0]["message"]["reasoning_content"] == ""
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == CLOSING


def test_an_unknown_template_variable_or_a_negative_budget_is_a_400_naming_it(server, no_end):
    for extra, field in (({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                         ({"max_thinking_tokens": -1}, "max_thinking_tokens")):  # fmt: skip
        reply = requests.post(f"{server}/v1/chat/completions", json=openai_body(no_end, **extra), timeout=60)
        assert reply.status_code == 400 and field in reply.json()["error"]["param"]


def test_a_forced_tool_call_and_a_json_answer_come_after_the_reasoning(server, no_end):
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    parameters = {**city, "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    body = openai_body(no_end, tools=[tool], tool_choice="required", max_thinking_tokens=4, max_tokens=120)
    message = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] is not None
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 3]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    answer_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    body = openai_body(no_end, max_thinking_tokens=4, max_tokens=60, response_format=answer_format)
    message = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message["reasoning_content"] and isinstance(json.loads(message["content"])["n"], int)


def test_logprobs_cover_both_parts_and_mark_the_reasoning(server, no_end):
    body = openai_body(no_end, max_thinking_tokens=4, logprobs=True, top_logprobs=1)
    entries = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    marks = [entry.get("reasoning", False) for entry in entries["content"]]
    assert marks == [True] * (4 + CLOSING) + [False] * (24 - 4 - CLOSING)


def test_the_command_line_says_it_thinks_and_shows_the_reasoning_before_the_answer(cache_dir, tiny_thinking_dir):
    done = run_cli("chat", QUESTION, "--model-path", str(tiny_thinking_dir), "--cache-dir", str(cache_dir),
                   "--max-tokens", "12", "--max-thinking-tokens", "3", "--temperature", "0")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "is a thinking checkpoint" in done.stderr and "12 new tokens (length)" in done.stderr
    assert "</think>" not in done.stdout and done.stdout.strip()


@pytest.mark.browser
def test_the_page_shows_the_reasoning_folded_above_the_answer(server, browser):
    from test_web_page import ask, finished_turn, set_options

    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    page.goto(server + "/")
    set_options(page, max_tokens=16, temperature=0)
    ask(page, QUESTION)
    turn = finished_turn(page, 1)
    folded = turn.locator("details.reasoning")
    assert folded.evaluate("details => details.open") is False
    assert re.fullmatch(r"Reasoning \(\d+ tokens\)", folded.locator("summary").inner_text())
    assert folded.locator(".reasoning-text").text_content().strip()
    context.close()
    assert not errors, errors
