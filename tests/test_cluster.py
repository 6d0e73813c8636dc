"""Many machines as one service, on loopback: three Gunicorn "machines" on 127.0.0.2–127.0.0.4 (separate
processes, CACHE_DIRs and ports), one Redis, the proxy service.deploy renders (Nginx with affinity.js),
driven by the real `openai` and `anthropic` clients. Any machine continues any conversation with the
same bits (logprob floats compared); through the proxy each conversation stays where its KV cache is
without a header of ours; a machine killed mid-stream cuts its stream at once and the turn answers
elsewhere with the same bits; with Redis down each machine serves its own, /ready and a gauge say so,
and the shared state is back when Redis is; batch lines survive a machine kill and a Redis restart,
none lost, none written twice."""

from __future__ import annotations

import json
import time
import uuid

import anthropic
import numpy as np
import openai
import pytest
import requests

from bench.core.cluster import loopback_cluster

from imaging import data_url, encode, pattern
from servers import metric, openai_client

pytestmark = [pytest.mark.server, pytest.mark.nginx]

ENV = {
    "BATCH_LEASE_SECONDS": "3",
    "MAX_NEW_TOKENS": "600",
    "CONTEXT_LIMIT": "2048",
    "QUEUE_TIMEOUT": "60",
    "LOG_LEVEL": "warning",
}
PICTURE = data_url(encode(pattern(160, 120, seed=5), ".jpg"), "image/jpeg")
LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_dir, cache_dir):
    from service import native

    native.prebuild(cache_dir)  # the machines' image: kernels built once, copied into each CACHE_DIR
    logs = tmp_path_factory.mktemp("cluster-logs")
    with loopback_cluster(logs, tiny_dir, ENV, cache_template=cache_dir) as made:
        yield made


def rid() -> str:
    return "req-" + uuid.uuid4().hex[:20]


def native(url: str, request_id: str | None = None, **body) -> dict:
    """A non-streamed native turn with its tokens' logprobs."""
    body = {"stream": False, "max_tokens": 10, "logprobs": True, "top_logprobs": 2, **body}
    headers = {"X-Request-Id": request_id} if request_id else {}
    reply = requests.post(url + "/v1/chat", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def floats(entries) -> list:
    """Each token's text, logprob and alternatives: what must be the same bits anywhere."""
    get = (lambda e, k: e[k]) if entries and isinstance(entries[0], dict) else getattr
    return [(get(e, "token"), get(e, "logprob"), [(get(t, "token"), get(t, "logprob")) for t in get(e, "top_logprobs")])
            for e in entries]  # fmt: skip


# -- any machine continues any conversation, with the same bits ---------------------------------------

TURNS = [
    {"prompt": "What is in this picture?", "images": [PICTURE]},
    {"prompt": "And which colours?"},
    {"prompt": "Say it once more."},
]


def test_a_native_picture_conversation_continues_on_each_machine_with_the_same_bits(cluster):
    a, b, c = cluster.machines
    reference, conversation = [], None
    for turn in TURNS:  # all on one machine
        done = native(a.url, **turn, **({"conversation_id": conversation} if conversation else {}))
        conversation = done["conversation_id"]
        reference.append(done)
    moved, conversation = [], None
    for machine, turn in zip((a, b, c), TURNS):  # each turn on the next machine
        done = native(machine.url, **turn, **({"conversation_id": conversation} if conversation else {}))
        conversation = done["conversation_id"]
        moved.append(done)
    for there, here in zip(reference, moved):
        assert floats(here["logprobs"]) == floats(there["logprobs"]) and here["text"] == there["text"]
        assert here["usage"]["prompt_tokens"] == there["usage"]["prompt_tokens"]
    assert moved[1]["usage"]["cached_tokens"] == 0 < reference[1]["usage"]["cached_tokens"]  # recomputed on b
    assert moved[1]["image_tokens"] == reference[1]["image_tokens"]  # the picture came along, compactly


def test_a_response_chain_and_a_conversation_made_on_one_machine_continue_on_the_others(cluster):
    clients = [openai_client(m.url) for m in cluster.machines]
    asks = ["Describe a red square.", "Now a blue circle.", "Which is larger?"]
    ask = {"model": "m", "max_output_tokens": 10, "include": LOGPROBS, "top_logprobs": 2}

    def chain(order):
        previous, out = None, []
        for client, text in zip(order, asks):
            extra = {"previous_response_id": previous} if previous else {}
            response = client.responses.create(input=text, **ask, **extra)
            previous = response.id
            out.append(floats(response.output[0].content[0].logprobs))
        return out

    assert chain(clients) == chain([clients[0]] * 3)  # a → b → c, against a alone

    def conversation(order):
        made = order[0].conversations.create(items=[{"role": "system", "content": "Answer briefly."}])
        out = [floats(c.responses.create(input=t, conversation=made.id, **ask).output[0].content[0].logprobs)
               for c, t in zip(order, asks)]  # fmt: skip
        listed = order[-1].conversations.items.list(made.id, order="asc").data
        return out, [item.role for item in listed]

    moved, roles = conversation(clients)
    assert (moved, roles) == conversation([clients[0]] * 3)
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]


# -- affinity: each conversation stays with its KV cache, no header of ours ----------------------------


def test_through_the_proxy_every_api_finds_its_kv_cache_on_the_second_turn(cluster):
    url = cluster.proxy_url
    client = openai_client(url)
    # Chat Completions: the client resends the history; the first messages keep it on one machine.
    first_ids, second_ids = rid(), rid()
    history = [
        {"role": "system", "content": f"You are terse {uuid.uuid4().hex[:6]}."},
        {"role": "user", "content": "Name three fruits."},
    ]
    chat = client.chat.completions.create
    one = chat(model="m", messages=history, max_tokens=8, extra_headers={"X-Request-Id": first_ids})
    history += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "More."}]
    two = chat(model="m", messages=history, max_tokens=8, extra_headers={"X-Request-Id": second_ids})
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 1
    assert cluster.served_by(first_ids) is cluster.served_by(second_ids)
    # Anthropic Messages, likewise, by its metadata.user_id.
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    user = {"user_id": "user-" + uuid.uuid4().hex[:8]}
    turns = [{"role": "user", "content": "Count to five."}]
    first = claude.messages.create(model="m", max_tokens=8, messages=turns, metadata=user)
    turns += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Again."}]
    second = claude.messages.create(model="m", max_tokens=8, messages=turns, metadata=user)
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - 1
    # Responses by previous_response_id, and a Conversation: the ids begin with their affinity key.
    r1 = client.responses.create(model="m", input=f"Hello {uuid.uuid4().hex[:6]}", max_output_tokens=8)
    r2 = client.responses.create(model="m", input="Go on.", previous_response_id=r1.id, max_output_tokens=8)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens - 1
    made = client.conversations.create(items=[{"role": "user", "content": f"Hi {uuid.uuid4().hex[:6]}"}])
    c1 = client.responses.create(model="m", input="Tell me more.", conversation=made.id, max_output_tokens=8)
    c2 = client.responses.create(model="m", input="And more.", conversation=made.id, max_output_tokens=8)
    assert c2.usage.input_tokens_details.cached_tokens >= c1.usage.input_tokens - 1
    # The native endpoint by its conversation_id (which begins with the first turn's key).
    n1 = native(url, prompt=f"Hello there {uuid.uuid4().hex[:6]}")
    n2 = native(url, prompt="And?", conversation_id=n1["conversation_id"])
    assert n2["usage"]["cached_tokens"] >= n1["usage"]["prompt_tokens"]
    # New conversations spread over the machines (a hash of their first turn each).
    homes = set()
    for k in range(12):
        request_id = rid()
        native(url, request_id=request_id, prompt=f"topic {k} {uuid.uuid4().hex[:6]}")
        homes.add(cluster.served_by(request_id).name)
    assert len(homes) >= 2


def test_a_follow_up_naming_an_id_lands_where_the_id_was_made(cluster):
    first = rid()
    made = native(cluster.proxy_url, request_id=first, prompt=f"Where am I {uuid.uuid4().hex[:6]}?")
    home = cluster.served_by(first)
    continued = metric(home.url, "qwen3vl_affinity_continuations_total", 'api="native"')
    for _ in range(3):
        again = rid()
        native(cluster.proxy_url, request_id=again, prompt="Still?", conversation_id=made["conversation_id"])
        assert cluster.served_by(again) is home
    assert metric(home.url, "qwen3vl_affinity_continuations_total", 'api="native"') == continued + 3


def test_a_clients_user_or_prompt_cache_key_keeps_all_its_conversations_on_one_machine(cluster):
    client = openai_client(cluster.proxy_url)
    for field in ("user", "prompt_cache_key"):
        value, homes = f"{field}-{uuid.uuid4().hex[:8]}", set()
        for k in range(4):  # different first turns: alone, they would spread
            request_id = rid()
            ask = {"model": "m", "input": f"Question {k} {uuid.uuid4().hex[:6]}", "max_output_tokens": 2, field: value}
            client.responses.create(**ask, extra_headers={"X-Request-Id": request_id})
            homes.add(cluster.served_by(request_id).name)
        assert len(homes) == 1, (field, homes)


def test_forms_and_bodies_past_a_mebibyte_keep_their_conversations_key(cluster):
    """A native multipart form is keyed by its conversation_id field (else its prompt); a body over 1 MiB
    (a large picture) is keyed as its smaller turns were, so a growing conversation stays home."""
    url, topic = cluster.proxy_url, uuid.uuid4().hex[:6]
    first, second = rid(), rid()
    form = {"prompt": f"What is this {topic}?", "max_tokens": "4", "stream": "false"}
    picture = encode(pattern(96, 64, seed=2), ".png")
    made = requests.post(
        url + "/v1/chat", data=form, files={"image": ("p.png", picture)}, headers={"X-Request-Id": first}
    )
    follow = {"prompt": "And?", "max_tokens": "4", "stream": "false", "conversation_id": made.json()["conversation_id"]}
    again = requests.post(
        url + "/v1/chat", data=follow, files={"image": ("p.png", picture)}, headers={"X-Request-Id": second}
    )
    assert again.status_code == 200 and cluster.served_by(first) is cluster.served_by(second)
    noise = np.random.default_rng(3).integers(0, 255, (700, 700, 3), dtype=np.uint8)
    large = data_url(encode(noise, ".png"))  # ~1.9 MB of base64: the body passes 1 MiB
    history = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"Look {topic}."},
                {"type": "image_url", "image_url": {"url": PICTURE}},
            ],
        }
    ]
    chat = openai_client(url).chat.completions.create
    ids = [rid(), rid()]
    one = chat(model="m", messages=history, max_tokens=4, extra_headers={"X-Request-Id": ids[0]})
    history += [{"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": large}}]}]  # fmt: skip
    two = chat(model="m", messages=history, max_tokens=4, extra_headers={"X-Request-Id": ids[1]})
    assert len(json.dumps(history)) > 2**20 and cluster.served_by(ids[0]) is cluster.served_by(ids[1])
    assert two.usage.prompt_tokens_details.cached_tokens > 0


# -- a machine lost mid-stream ------------------------------------------------------------------------


def test_a_machine_killed_mid_stream_cuts_the_stream_and_the_turn_answers_elsewhere_with_the_same_bits(
    cluster, no_end_of_turn
):
    url = cluster.proxy_url
    topic = uuid.uuid4().hex[:6]
    first_turn, second_turn = {"prompt": f"Tell a story about {topic}."}, {"prompt": "Go on."}
    reference = native(cluster.machines[0].url, **first_turn)  # the uninterrupted run, on one machine
    reference = native(cluster.machines[0].url, **second_turn, conversation_id=reference["conversation_id"])
    request_id = rid()
    made = native(url, request_id=request_id, **first_turn)
    home = cluster.served_by(request_id)
    body = {**second_turn, "conversation_id": made["conversation_id"], "max_tokens": 500, "logit_bias": no_end_of_turn}
    lines = []
    with requests.post(url + "/v1/chat", json=body, stream=True, timeout=60) as stream:
        chunks = stream.iter_lines()
        while len(lines) < 4:
            lines.append(json.loads(next(chunks)))
        home.kill()
        killed_at = time.monotonic()
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for chunk in chunks:
                lines.append(json.loads(chunk))
        assert time.monotonic() - killed_at < 10  # cut, never hung
    assert not any(line.get("done") for line in lines)
    others = [m for m in cluster.machines if m is not home]
    misses = {m.name: metric(m.url, "qwen3vl_affinity_misses_total", 'api="native"') for m in others}
    retried = rid()
    again = native(url, request_id=retried, **second_turn, conversation_id=made["conversation_id"])
    elsewhere = cluster.served_by(retried)
    assert elsewhere is not home
    assert floats(again["logprobs"]) == floats(reference["logprobs"]) and again["text"] == reference["text"]
    # its KV was computed on the lost machine: an affinity miss where it landed
    assert metric(elsewhere.url, "qwen3vl_affinity_misses_total", 'api="native"') == misses[elsewhere.name] + 1


# -- Redis down, and back -----------------------------------------------------------------------------


def ready(machine) -> dict:
    return requests.get(machine.url + "/ready", timeout=10).json()


def test_with_redis_down_each_machine_serves_its_own_and_the_shared_state_comes_back(cluster):
    url, client = cluster.proxy_url, openai_client(cluster.proxy_url)
    request_id = rid()
    made = native(url, request_id=request_id, prompt=f"Before the outage {uuid.uuid4().hex[:6]}.")
    home = cluster.served_by(request_id)
    kept = client.conversations.create(items=[{"role": "user", "content": "keep me"}])
    cluster.redis.stop()
    try:
        during = native(url, prompt="During it.", conversation_id=made["conversation_id"])
        assert during["usage"]["cached_tokens"] > 0  # its machine's own copy and KV cache
        assert ready(home)["degraded"]["shared_state"] == "Redis is unreachable"
        assert metric(home.url, "qwen3vl_shared_state_usable") == 0
        assert native(url, prompt=f"A new one {uuid.uuid4().hex[:6]}.")["text"] is not None
        with pytest.raises(openai.APIStatusError) as refused:  # a delete would not last: refused, not half done
            openai_client(home.url).conversations.delete(kept.id)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "shared_state_unavailable"
        with pytest.raises(openai.APIStatusError) as through:  # through the proxy: the store's 503 as it is
            client.conversations.delete(kept.id)
        assert through.value.status_code == 503 and through.value.body["code"] == "shared_state_unavailable"
    finally:
        cluster.redis.start()
    live = [m for m in cluster.machines if m.process is not None]
    deadline = time.monotonic() + 15  # each machine tries Redis again every 5 s
    while any("degraded" in ready(m) or metric(m.url, "qwen3vl_shared_state_usable") != 1 for m in live):
        assert time.monotonic() < deadline, [ready(m) for m in live]
        time.sleep(0.25)
    elsewhere = next(m for m in cluster.machines if m is not home and m.process is not None)  # one was killed
    deadline = time.monotonic() + 10
    while True:  # the turn kept on `home` alone goes up to Redis once it is back: the next turn anywhere has it
        after = native(elsewhere.url, prompt="After it.", conversation_id=made["conversation_id"])
        if after["usage"]["prompt_tokens"] > during["usage"]["prompt_tokens"] + during["usage"]["completion_tokens"]:
            break
        assert time.monotonic() < deadline, after["usage"]
        time.sleep(0.25)
    assert client.conversations.delete(kept.id).deleted


# -- batch lines across a machine kill and a Redis restart ---------------------------------------------


def test_batch_lines_survive_a_machine_kill_and_a_redis_restart_each_written_once(cluster, no_end_of_turn):
    client = openai_client(cluster.proxy_url)
    lines = 8
    bodies = [
        {"model": "m", "max_tokens": 80, "logit_bias": no_end_of_turn, "temperature": 0,
         "messages": [{"role": "user", "content": f"Line {i}: list colours."}]}
        for i in range(lines)
    ]  # fmt: skip
    requests_ = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(bodies)
    ]
    content = b"".join(json.dumps(r).encode() + b"\n" for r in requests_)
    uploaded = client.files.create(file=("lines.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    live = [m for m in cluster.machines if m.process is not None]
    deadline = time.monotonic() + 60
    victim = None
    while victim is None:  # a machine holding a line
        victim = next((m for m in live if metric(m.url, "qwen3vl_batch_lines_running") >= 1), None)
        assert time.monotonic() < deadline
    victim.kill()
    cluster.redis.stop()  # and at once back, on its appendonly file
    cluster.redis.start()
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.request_counts
        time.sleep(0.3)
        try:
            batch = client.batches.retrieve(batch.id)
        except openai.APIStatusError as refused:  # each machine opens the job store again within 5 s
            assert refused.status_code == 503 and refused.body["code"] == "job_store_unavailable"
    assert batch.status == "completed" and batch.request_counts.completed == lines
    records = [json.loads(text) for text in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in records) == sorted(f"line-{i}" for i in range(lines))  # each once
    direct = openai_client(next(m for m in cluster.machines if m.process is not None).url)
    for record in records[:3]:  # the answers are the endpoint's own
        body = bodies[int(record["custom_id"].split("-")[1])]
        expected = direct.chat.completions.create(**body).choices[0].message.content
        assert record["response"]["body"]["choices"][0]["message"]["content"] == expected
