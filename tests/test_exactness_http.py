"""The stateless client of the exactness issue, through real Gunicorns with the default settings
(INT8 weights, bf16 keys and values) and with fp32 keys and values, and the official openai client:
a second turn answered from the first turn's cached keys and values is bit for bit the answer of a
server with nothing cached. (With fp32 keys and values the code before service/model/forward.py failed
this on the embedded model for every picture tried; with bf16 ones, whose rounding hides most
last-bit differences, only now and then — on the 2B-shaped checkpoint, bench_exactness.)

Turn 1: a JPEG and "Describe the picture.", 32 greedy tokens. Turn 2: the whole history resent and
a new question. The answer's token ids (its log-probability records) and every log-probability with
its 5 alternatives — floats in JSON, which round-trip exactly — are compared.
"""

from __future__ import annotations

import pytest

from conftest import SHARED_ENV
from imaging import data_url, encode, pattern
from servers import openai_client

JPEG = encode(pattern(448, 448, seed=11), ".jpg")
PICTURE = {"type": "image_url", "image_url": {"url": data_url(JPEG, "image/jpeg")}}


@pytest.fixture(scope="module", params=[{}, {"KV_DTYPE": "float32"}], ids=["defaults", "kv-fp32"])
def servers(serve, request):
    """One server that keeps turn 1, and a fresh one (the client's turns spread over instances). With
    the defaults, the session's shared server keeps turn 1 (no other test sends this picture) and the
    fresh one has its settings; with fp32 keys and values, two servers of their own."""
    if request.param:
        with serve(request.param, "exactness-kept") as (kept, _), serve(request.param, "exactness-fresh") as (fresh, _):
            yield openai_client(kept), openai_client(fresh)
    else:
        kept = request.getfixturevalue("shared_server")
        with serve(SHARED_ENV, "exactness-fresh") as (fresh, _):
            yield openai_client(kept), openai_client(fresh)


def ask(client, messages, **extra):
    return client.chat.completions.create(
        model="qwen3-vl", messages=messages, max_tokens=32, temperature=0, logprobs=True, top_logprobs=5, **extra
    )


def bits(response) -> list:
    """Every token of the answer with its logprob and alternatives, as the server sent them."""
    return [
        (t.token, t.bytes, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
        for t in response.choices[0].logprobs.content
    ]


def test_a_resent_history_answers_with_the_bits_of_a_fresh_server(servers):
    kept, fresh = servers
    turn1 = [{"role": "user", "content": [PICTURE, {"type": "text", "text": "Describe the picture."}]}]
    first = ask(kept, turn1)
    assert first.usage.completion_tokens == 32 and first.choices[0].finish_reason == "length"
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what colour is it?"},
    ]
    from_cache = ask(kept, turn2)
    recomputed = ask(fresh, turn2)
    # the first turn's prompt (its picture included) came from the cache, the rest was computed
    assert from_cache.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert recomputed.usage.prompt_tokens_details.cached_tokens == 0
    assert from_cache.usage.completion_tokens == recomputed.usage.completion_tokens == 32
    assert from_cache.choices[0].message.content == recomputed.choices[0].message.content
    assert bits(from_cache) == bits(recomputed)
    # streamed, the same again (the fresh server now holds the history too: a hit there as well)
    streamed = ask(fresh, turn2, stream=True)
    tokens = [
        t
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in tokens] == [(t, lp) for t, _, lp, _ in bits(recomputed)]
