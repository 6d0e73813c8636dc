"""The HTTP API on a real Gunicorn with the embedded model, through requests and the openai client."""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest
import requests

from service import metrics
from service.engine.sampling import Sampler

from conftest import app_on, make_settings
from imaging import data_url, encode, pattern
from sdk_types import sdk_conforms
from servers import metric, openai_client

SERVER_ENV = {
    "QUEUE_SIZE": "1",
    "MAX_BATCH_SIZE": "2",
    "MAX_BODY_BYTES": str(3 * 1024 * 1024),
    "IMAGE_MAX_BYTES": str(1024 * 1024),
    "CONTEXT_LIMIT": "1024",
    "MAX_NEW_TOKENS": "600",
    "QUEUE_TIMEOUT": "60",
}


@pytest.fixture(scope="module")
def server(serve):
    with serve(SERVER_ENV, "http-api") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=60)


PNG = encode(pattern(320, 256), ".png")


def image_message(text="What is in this picture?", png=PNG):
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": text}],
        }
    ]


def ndjson(response) -> list[tuple[float, dict]]:
    return [(time.perf_counter(), json.loads(line)) for line in response.iter_lines() if line]


# -- OpenAI client --------------------------------------------------------------------------------


def test_openai_client_non_streaming_with_an_image(client):
    reply = client.chat.completions.create(model="anything", messages=image_message(), max_tokens=12, temperature=0)
    sdk_conforms(reply)
    assert reply.object == "chat.completion"
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens > 80  # 80 visual tokens for 320x256, plus the text


def test_openai_client_streaming_equals_non_streaming(client):
    kwargs = dict(model="m", messages=image_message("Describe it."), max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    sdk_conforms(*chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_sse_ends_with_done(server):
    r = requests.post(
        server + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
        stream=True,
    )
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_openai_client_sees_errors_as_exceptions(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}],
                }
            ],
        )
    assert info.value.body["code"] == "remote_image_refused"


def test_models_endpoint_says_the_model_is_random(client):
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].model_extra["random_test_model"] is True


# -- native endpoint --------------------------------------------------------------------------------


def test_native_stream_arrives_incrementally_with_ids_first_and_done_last(server, no_end_of_turn):
    body = {"prompt": "Keep talking.", "max_tokens": 300, "temperature": 0, "logit_bias": no_end_of_turn}
    with requests.post(server + "/v1/chat", json=body, stream=True) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = ndjson(r)
    deltas = [t for t, obj in lines if "delta" in obj]
    done = lines[-1][1]
    assert {"id", "model", "conversation_id"} <= set(lines[0][1])
    assert done["done"] is True and done["usage"]["completion_tokens"] == 300
    assert set(done["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "cached_from",
        "drafted_tokens",
        "accepted_tokens",
        "reasoning_tokens",
    }
    assert done["usage"]["cached_from"] is None and done["boxes"] == []  # nothing cached, no boxes named
    for key in ("queue_wait", "image_decode", "vision_encode", "prefill", "time_to_first_token", "decode_tokens_per_s"):
        assert key in done["timings"]
    assert len(deltas) > 10
    # streamed as generated, not held back: the deltas arrive over most of the server's decode time
    decode_seconds = (done["usage"]["completion_tokens"] - 1) / done["timings"]["decode_tokens_per_s"]
    assert deltas[-1] - deltas[0] > 0.5 * decode_seconds


def test_native_multipart_with_two_images_and_a_follow_up(server):
    files = [
        ("image", ("a.png", PNG, "image/png")),
        ("image", ("b.jpg", encode(pattern(256, 256, seed=2), ".jpg"), "image/jpeg")),
    ]
    first = requests.post(
        server + "/v1/chat",
        files=files,
        data={"prompt": "Compare them.", "max_tokens": "8", "temperature": "0", "stream": "false"},
    ).json()
    assert first["images"] == 2 and first["usage"]["completion_tokens"] == 8
    follow = requests.post(
        server + "/v1/chat",
        data={"prompt": "And then?", "max_tokens": "4", "stream": "false", "conversation_id": first["conversation_id"]},
    ).json()
    # The server remembered the images and the answer: the second prompt holds the whole first turn.
    assert follow["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert follow["conversation_id"] == first["conversation_id"]


def test_native_json_messages_and_request_id_passthrough(server):
    r = requests.post(
        server + "/v1/chat",
        json={"messages": image_message(), "max_tokens": 3, "stream": False},
        headers={"X-Request-Id": "my-trace-42"},
    )
    assert r.status_code == 200
    assert r.headers["X-Request-Id"] == "my-trace-42" and r.json()["id"] == "my-trace-42"
    assert r.json()["text"] is not None


# -- errors -----------------------------------------------------------------------------------------

ERROR_CASES = [
    (
        "malformed JSON",
        "/v1/chat/completions",
        dict(data=b'{"messages": [', headers={"Content-Type": "application/json"}),
        400,
    ),
    (
        "bad field",
        "/v1/chat/completions",
        dict(json={"messages": [{"role": "user", "content": "x"}], "temperature": 9}),
        400,
    ),
    ("wrong type", "/v1/chat/completions", dict(json={"messages": "hello"}), 400),
    ("no messages", "/v1/chat/completions", dict(json={"messages": []}), 400),
    (
        "unsupported part",
        "/v1/chat/completions",
        dict(json={"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}),
        400,
    ),
    (
        "undecodable image",
        "/v1/chat/completions",
        dict(json={"messages": image_message(png=b"not an image at all")}),
        400,
    ),
    ("base64 that is not", "/v1/chat", dict(json={"prompt": "x", "images": ["%%%not-base64%%%"]}), 400),
    (
        "file url",
        "/v1/chat/completions",
        dict(
            json={
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}
                ]
            }
        ),
        400,
    ),
    (
        "remote url",
        "/v1/chat",
        dict(
            json={
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "http://10.0.0.1/x.png"}]}]
            }
        ),
        400,
    ),
    (
        "placeholder tokens in text",
        "/v1/chat/completions",
        dict(json={"messages": [{"role": "user", "content": "see <|image_pad|> here"}]}),
        400,
    ),
    (
        "placeholder tokens with an image",
        "/v1/chat",
        dict(json={"messages": image_message("a <|vision_start|><|image_pad|><|vision_end|> b")}),
        400,
    ),
    (
        "bad X-Conversation-Id",
        "/v1/chat/completions",
        dict(json={"messages": [{"role": "user", "content": "x"}]}, headers={"X-Conversation-Id": "not ok!"}),
        400,
    ),
    (
        "native bad X-Conversation-Id",
        "/v1/chat",
        dict(json={"prompt": "x"}, headers={"X-Conversation-Id": "x" * 129}),
        400,
    ),
    ("n > 1", "/v1/chat/completions", dict(json={"messages": [{"role": "user", "content": "x"}], "n": 2}), 400),
    ("multipart without prompt", "/v1/chat", dict(files=[("image", ("a.png", PNG, "image/png"))]), 400),
    ("duplicate prompt", "/v1/chat", dict(files=[("prompt", (None, "a")), ("prompt", (None, "b"))]), 400),
    (
        "multipart part without a name",
        "/v1/chat",
        dict(
            data=b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n'
            b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--\r\n",
            headers={"Content-Type": "multipart/form-data; boundary=b"},
        ),
        400,
    ),
    ("unknown path", "/v1/nothing", dict(json={}), 404),
    (
        "body too large",
        "/v1/chat/completions",
        dict(data=b"x" * (4 * 1024 * 1024), headers={"Content-Type": "application/json"}),
        413,
    ),
    (
        "image too large",
        "/v1/chat",
        dict(files=[("image", ("big.bmp", encode(pattern(700, 700), ".bmp"), "image/bmp"))], data={"prompt": "x"}),
        413,
    ),
    ("wrong content type", "/v1/chat/completions", dict(data=b"hello", headers={"Content-Type": "text/plain"}), 415),
    ("native wrong content type", "/v1/chat", dict(data=b"hello", headers={"Content-Type": "text/plain"}), 415),
    (
        "prompt too long",
        "/v1/chat/completions",
        dict(json={"messages": [{"role": "user", "content": "word " * 3000}]}),
        422,
    ),
]


@pytest.mark.parametrize("name,path,kwargs,status", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_requests_get_openai_shaped_errors_and_the_server_keeps_serving(server, name, path, kwargs, status):
    r = requests.post(server + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    ok = requests.post(server + "/v1/chat", json={"prompt": "still there?", "max_tokens": 2, "stream": False})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_empty_messages_continuing_a_conversation_are_a_400(server):
    first = requests.post(server + "/v1/chat", json={"prompt": "Hello.", "max_tokens": 2, "stream": False}).json()
    r = requests.post(
        server + "/v1/chat", json={"messages": [], "conversation_id": first["conversation_id"], "stream": False}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_wrong_method_is_405_json(server):
    r = requests.get(server + "/v1/chat")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["Allow"]


# -- admission, disconnects, metrics --------------------------------------------------------------


def _open_stream(server, no_end_of_turn, max_tokens=600):
    """A raw socket streaming a long answer (end tokens barred, so it runs until max_tokens or the
    socket closes); returns the socket after the headers and two chunks."""
    body = {"prompt": "Go on and on.", "max_tokens": max_tokens, "temperature": 0, "logit_bias": no_end_of_turn}
    body = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])))
    sock.sendall(
        b"POST /v1/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    received = b""
    while received.count(b"\n{") < 2:  # the head line and at least one delta line
        received += sock.recv(4096)
    return sock


def test_client_disconnect_stops_generation_and_frees_the_model(server, no_end_of_turn):
    cancelled_before = metric(server, "qwen3vl_generations_total", 'finish_reason="cancelled"')
    tokens_before = metric(server, "qwen3vl_generated_tokens_total")
    sock = _open_stream(server, no_end_of_turn)
    sock.close()
    deadline = time.monotonic() + 10
    while metric(server, "qwen3vl_generations_total", 'finish_reason="cancelled"') == cancelled_before:
        assert time.monotonic() < deadline, "generation was not cancelled"
        time.sleep(0.05)
    assert metric(server, "qwen3vl_generated_tokens_total") - tokens_before < 600  # stopped early
    t0 = time.perf_counter()
    r = requests.post(server + "/v1/chat", json={"prompt": "next", "max_tokens": 2, "stream": False})
    assert r.json()["timings"]["queue_wait"] < 0.5  # the next request started at once
    assert time.perf_counter() - t0 < 5


def test_requests_beyond_the_queue_get_429_with_retry_after(server, no_end_of_turn):
    cancelled_before = metric(server, "qwen3vl_generations_total", 'finish_reason="cancelled"')
    running = [_open_stream(server, no_end_of_turn) for _ in range(2)]  # fill the batch (MAX_BATCH_SIZE 2)
    waiter_result = {}

    def wait_in_queue():
        waiter_result["status"] = requests.post(
            server + "/v1/chat", json={"prompt": "w", "max_tokens": 2, "stream": False}
        ).status_code

    waiter = threading.Thread(target=wait_in_queue)
    waiter.start()
    deadline = time.monotonic() + 10
    while metric(server, "qwen3vl_queue_depth") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = requests.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429 and r.headers["Retry-After"]
    assert r.json()["error"]["type"] == "rate_limit_error"
    running[0].close()
    waiter.join(30)
    running[1].close()
    deadline = time.monotonic() + 10
    while metric(server, "qwen3vl_generations_total", 'finish_reason="cancelled"') < cancelled_before + 2:
        assert time.monotonic() < deadline, "the streams were not cancelled"
        time.sleep(0.05)
    assert waiter_result["status"] == 200


def test_a_request_moves_the_metrics_by_what_it_did(server):
    names = [
        ("qwen3vl_requests_total", 'endpoint="/v1/chat",status="200"'),
        ("qwen3vl_generated_tokens_total", ""),
        ("qwen3vl_time_to_first_token_seconds_count", ""),
        ("qwen3vl_generations_total", 'finish_reason="length"'),
        ("qwen3vl_prompt_tokens_total", ""),
    ]
    before = {name: metric(server, *name) for name in names}
    reply = requests.post(
        server + "/v1/chat", json={"prompt": "Talk forever.", "max_tokens": 5, "stream": False, "temperature": 0}
    ).json()
    after = {name: metric(server, *name) for name in names}
    assert reply["usage"]["completion_tokens"] == 5 and reply["finish_reason"] == "length"
    assert [after[n] - before[n] for n in names] == [1, 5, 1, 1, reply["usage"]["prompt_tokens"]]
    assert metric(server, "qwen3vl_process_rss_bytes") > 50e6


@pytest.mark.parametrize("endpoint", ["/v1/chat", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -2),
        ("seed", -1),
        ("repetition_penalty", 0),
        ("stop", ["a", "b", "c", "d", "e"]),
    ],
)
def test_sampling_parameters_out_of_bounds_get_400_naming_the_field(server, endpoint, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": False, field: value}
    reply = requests.post(server + endpoint, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


def test_health_and_ready(server):
    assert requests.get(server + "/health").json() == {"status": "ok"}
    ready = requests.get(server + "/ready").json()
    assert ready["status"] == "ready" and ready["random_model"] is True
    # the INT8 kernel serving each part, chosen by what each measured at start (on /metrics)
    kernels = ready["int8_kernel"]
    metrics = requests.get(server + "/metrics").text
    for part in ("decoder", "vision"):
        assert f'qwen3vl_int8_kernel{{kernel="{kernels[part]}",part="{part}"}} 1.0' in metrics
    for kernel in ("fbgemm", "onednn", "native"):
        assert f'qwen3vl_int8_kernel_probe_milliseconds{{kernel="{kernel}",rows="1"}}' in metrics


def test_a_model_that_fails_to_load_is_reported_by_ready_and_requests(unloadable_server):
    base = unloadable_server
    deadline = time.monotonic() + 60
    while (r := requests.get(base + "/ready")).json()["error"]["code"] == "model_loading":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    chat = requests.post(base + "/v1/chat", json={"prompt": "hi"})
    assert chat.status_code == 503 and requests.get(base + "/health").status_code == 200


@pytest.mark.slow
def test_a_bug_in_a_handler_is_a_json_500_with_the_request_id(cache_dir, loaded_model, caplog):
    """The last-resort handler (here for a route that raises) answers in the API's error shape."""

    app = app_on(loaded_model("int8"), make_settings(cache_dir))

    @app.get("/bug")
    def bug():
        raise RuntimeError("a bug")

    r = app.test_client().get("/bug", headers={"X-Request-Id": "trace-7"})
    assert r.status_code == 500 and r.is_json
    assert r.json["error"]["code"] == "internal_error" and "trace-7" in r.json["error"]["message"]
    assert "a bug" not in r.get_data(as_text=True)  # the traceback stays in the server log
    assert "a bug" in caplog.text


@pytest.mark.slow
def test_a_failure_after_the_200_ends_the_stream_with_an_error_event_and_is_counted(
    cache_dir, loaded_model, monkeypatch
):
    """A stream's status goes out before its first token: a later failure (here injected into the
    sampler after two tokens) must end the body with an error line / SSE error event — never a
    silent cut — and show in qwen3vl_stream_errors_total."""

    real_call = Sampler.__call__

    def failing_after_two(self, token_ids, logits, allowed=None):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 2:
            raise RuntimeError("injected failure")
        return real_call(self, token_ids, logits, allowed)

    monkeypatch.setattr(Sampler, "__call__", failing_after_two)
    client = app_on(loaded_model("int8"), make_settings(cache_dir)).test_client()
    counted = metrics.STREAM_ERRORS.labels("internal_error")
    before = counted._value.get()

    native = client.post("/v1/chat", json={"prompt": "Talk.", "max_tokens": 20, "temperature": 0})
    lines = [json.loads(line) for line in native.get_data(as_text=True).splitlines()]
    assert native.status_code == 200 and [("delta" in line) for line in lines[1:3]] == [True, True]
    assert lines[-1]["done"] is True and lines[-1]["error"]["code"] == "internal_error"

    sse = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Talk."}], "max_tokens": 20, "stream": True},
    )
    events = [e[len("data: ") :] for e in sse.get_data(as_text=True).split("\n\n") if e]
    assert sse.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    assert counted._value.get() - before == 2

    plain = client.post("/v1/chat", json={"prompt": "Talk.", "max_tokens": 20, "stream": False})
    assert plain.status_code == 500 and plain.json["error"]["code"] == "internal_error"
    assert counted._value.get() - before == 2  # a plain request's failure is its status, not a stream error


@pytest.mark.parametrize("endpoint", ["/v1/chat", "/v1/chat/completions"])
def test_the_speculative_field_turns_guessing_off_for_one_request(server, no_end_of_turn, endpoint):
    """The same repetitive prompt guesses tokens by default (prompt lookup) and none with
    `"speculative": false`; both endpoints report the guesses in their usage."""
    text = "Repeat after me: red square, blue circle, red square, blue circle, red square, blue circle."

    def guessed(**extra) -> int:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 40, "temperature": 0}
        body |= {"logit_bias": no_end_of_turn, "stream": False, **extra}
        if endpoint == "/v1/chat/completions":
            body["model"] = "qwen3-vl"
        reply = requests.post(server + endpoint, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        if endpoint == "/v1/chat":
            return usage["drafted_tokens"]
        return usage["speculation"]["drafted_tokens"]  # OpenAI's prediction counts are for Predicted Outputs

    assert guessed() > 0
    assert guessed(speculative=False) == 0


# -- priorities ----------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["/v1/chat", "/v1/chat/completions"])
@pytest.mark.parametrize("priority", [5000, -1001, "soon"])
def test_a_priority_out_of_range_is_a_400_naming_the_field(server, endpoint, priority):
    body = {"messages": [{"role": "user", "content": "Hi."}], "priority": priority, "stream": False}
    r = requests.post(server + endpoint, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_an_urgent_request_takes_a_place_in_a_full_batch_and_the_paused_stream_says_so(server, no_end_of_turn):
    """MAX_BATCH_SIZE 2, both places held by background streams (priority 5): a priority -1 request
    is answered at once, one stream is paused meanwhile, and its done line says so."""
    preempted_before = metric(server, "qwen3vl_preemptions_total", 'priority="background"')
    body = {"prompt": "Go on and on.", "max_tokens": 300, "temperature": 0, "priority": 5, "logit_bias": no_end_of_turn}
    streams = [requests.post(server + "/v1/chat", json=body, stream=True) for _ in range(2)]
    lines = [r.iter_lines() for r in streams]
    for it in lines:
        next(it), next(it)  # the head line and a first delta: both are decoding
    form = {"prompt": "Quick.", "max_tokens": "3", "stream": "false", "priority": "-1"}
    urgent = requests.post(server + "/v1/chat", data=form)
    assert urgent.status_code == 200
    answer = urgent.json()
    assert answer["preempted"] == 0 and answer["timings"]["queue_wait"] < 1.0
    dones = [json.loads([line for line in it if line][-1]) for it in lines]
    assert sorted(d["preempted"] for d in dones) == [0, 1]
    assert all(d["done"] and d["usage"]["completion_tokens"] == 300 for d in dones)
    assert max(d["timings"]["paused"] for d in dones) > 0
    assert metric(server, "qwen3vl_preemptions_total", 'priority="background"') == preempted_before + 1
    assert metric(server, "qwen3vl_time_to_first_token_seconds_count", 'priority="urgent"') >= 1
