"""API keys and per-request limits, on a real Gunicorn."""

from __future__ import annotations

import openai
import pytest
import requests

from conftest import AUTH, KEY
from imaging import data_url, encode, pattern
from servers import openai_client


@pytest.fixture
def server(keyed_server):
    """(base URL, log) of the session's server with API keys and small limits (conftest.KEYED_ENV)."""
    return keyed_server


def chat(base, body, headers=AUTH):
    return requests.post(base + "/v1/chat", json={"max_tokens": 3, "stream": False, **body}, headers=headers)


def test_health_and_ready_are_open_everything_else_needs_a_key(server):
    """Liveness and readiness probes carry no key; /ready tells only that, the model's name, whether it thinks, and the
    INT8 kernels' names (what they measured is on /metrics)."""
    base, _ = server
    assert requests.get(base + "/health").status_code == 200
    ready = requests.get(base + "/ready")
    fields = {"status", "model", "random_model", "thinking", "int8_kernel", "startup"}
    assert ready.status_code == 200 and set(ready.json()) == fields
    assert set(ready.json()["int8_kernel"]) == {"decoder", "vision"}
    for method, path in [
        ("get", "/metrics"),
        ("get", "/v1/models"),
        ("get", "/openapi.json"),
        ("post", "/v1/chat"),
        ("post", "/v1/chat/completions"),
    ]:
        r = getattr(requests, method)(base + path, json={})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_wrong_key_is_refused_and_never_echoed(server):
    base, log = server
    wrong = "sk-wrong-secret-value-xyz"
    r = chat(base, {"prompt": "hi"}, headers={"Authorization": f"Bearer {wrong}"})
    assert r.status_code == 401 and wrong not in r.text and KEY not in r.text
    assert chat(base, {"prompt": "hi"}, headers={"Authorization": KEY}).status_code == 401  # no Bearer scheme
    text = log.read_text()
    assert '"POST /v1/chat HTTP/1.1" 401' in text  # the log does record these requests…
    assert wrong not in text and KEY not in text  # …but not their keys


def test_each_configured_key_works_including_through_the_openai_client(server):
    base, _ = server
    assert chat(base, {"prompt": "hi"}, headers={"Authorization": "Bearer other-key"}).status_code == 200
    client = openai_client(base, api_key=KEY)
    assert (
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ).usage.completion_tokens
        == 2
    )
    with pytest.raises(openai.AuthenticationError):
        openai_client(base, api_key="nope").models.list()


def _png_url(seed):
    return data_url(encode(pattern(64, 64, seed=seed), ".png"))


@pytest.mark.parametrize(
    "body,code",
    [
        ({"prompt": "x", "images": [_png_url(1), _png_url(2), _png_url(3)]}, "too_many_images"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                    {"role": "assistant", "content": "d"},
                    {"role": "user", "content": "e"},
                ]
            },
            "too_many_messages",
        ),
        ({"prompt": "x", "stop": ["a", "b", "c"]}, "invalid_request"),
    ],
)
def test_limits_refuse_with_400(server, body, code):
    base, _ = server
    r = chat(base, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


def test_prompt_token_limit_is_422(server):
    base, _ = server
    r = chat(base, {"prompt": "many words here " * 200})
    assert r.status_code == 422 and "300" in r.json()["error"]["message"]


def test_images_in_history_count_towards_the_limit(server):
    base, _ = server
    first = chat(base, {"prompt": "x", "images": [_png_url(1), _png_url(2)]})
    assert first.status_code == 200
    follow = chat(base, {"prompt": "y", "images": [_png_url(3)], "conversation_id": first.json()["conversation_id"]})
    assert follow.status_code == 400 and follow.json()["error"]["code"] == "too_many_images"


def test_deadline_ends_a_long_generation_with_what_it_has(server, tiny_dir):
    from transformers import AutoTokenizer

    base, _ = server
    # The random model may end an answer early: its end tokens are barred, so only the deadline ends it.
    ends = AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    body = {"prompt": "Talk forever.", "max_tokens": 4000, "temperature": 1.0, "seed": 0}
    r = chat(base, {**body, "logit_bias": {str(end): -100 for end in ends}})
    done = r.json()
    assert r.status_code == 200, done
    assert done["finish_reason"] == "deadline"
    assert 0 < done["usage"]["completion_tokens"] < 4000
    assert done["timings"]["total"] < 3.0
