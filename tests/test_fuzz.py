"""Fuzzing a real Gunicorn: schemathesis from /openapi.json plus hypothesis-generated hostile bodies,
images and forms. Zero 5xx, no worker crash, and the same answer afterwards. FUZZ_EXAMPLES scales it
(the long run is `python -m bench.bench_fuzz`)."""

from __future__ import annotations

import json
import os
import re

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

import hostile
from servers import metric

pytestmark = [pytest.mark.server, pytest.mark.slow]

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ_ENV = {
    "MAX_NEW_TOKENS": "6",
    "DEFAULT_MAX_TOKENS": "4",
    "QUEUE_SIZE": "4",
    "MAX_BODY_BYTES": str(2 * 1024 * 1024),
    "IMAGE_MAX_PIXELS": str(128 * 128),
    "CONTEXT_LIMIT": "2048",
}
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
REFERENCE = {"prompt": "What is this?", "max_tokens": 6, "temperature": 0, "stream": False}


def status_counts(base: str) -> dict[str, float]:
    """Requests the server has answered so far, by status (from /metrics)."""
    pairs = re.findall(
        r'qwen3vl_requests_total\{endpoint="[^"]*",status="(\d+)"\} ([0-9.e+]+)', requests.get(base + "/metrics").text
    )
    counts: dict[str, float] = {}
    for status, count in pairs:
        counts[status] = counts.get(status, 0) + float(count)
    return counts


def worker_pids(base: str) -> set[str]:
    return set(re.findall(r'qwen3vl_process_rss_bytes\{pid="(\d+)"\}', requests.get(base + "/metrics").text))


@pytest.fixture(scope="module")
def fuzz_server(serve):
    with serve(FUZZ_ENV, "fuzz") as (base, _):
        answer = requests.post(base + "/v1/chat", json=REFERENCE).json()["text"]
        pids, before = worker_pids(base), status_counts(base)  # from here on: the fuzzing's requests
        yield base
        # After everything: the same worker, healthy, giving the same greedy answer.
        restarted = worker_pids(base) != pids
        same_answer = requests.post(base + "/v1/chat", json=REFERENCE).json()["text"] == answer
        if os.environ.get("FUZZ_TALLY_FILE"):  # for bench/bench_fuzz.py's table
            tally = {k: n - before.get(k, 0) for k, n in status_counts(base).items() if n > before.get(k, 0)}
            stream_errors = metric(base, "qwen3vl_stream_errors_total")
            with open(os.environ["FUZZ_TALLY_FILE"], "w") as f:
                json.dump(
                    {
                        "statuses": tally,
                        "stream_errors": stream_errors,
                        "worker_restarted": restarted,
                        "same_answer": same_answer,
                    },
                    f,
                )
        assert not restarted, "a worker crashed and was restarted"
        assert same_answer


def _complete_stream(content_type: str, text: str) -> None:
    """A 200 stream must end with its done line / [DONE] and hold no error event: its status went
    out before the first token, so a failure after that shows only in the body."""
    if content_type.startswith("application/x-ndjson"):
        lines = [json.loads(line) for line in text.splitlines() if line]
        assert lines and lines[-1].get("done") is True and "error" not in lines[-1], text[-300:]
    elif content_type.startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
        assert events, text[-300:]
        if events[-1] == "[DONE]":  # Chat Completions
            assert not any("error" in json.loads(e) for e in events[:-1]), text[-300:]
            return
        kinds = [json.loads(e)["type"] for e in events]  # the typed streams: Anthropic's, Responses'
        assert kinds[-1] in ("message_stop", "response.completed", "response.incomplete"), text[-300:]
        assert "error" not in kinds, text[-300:]


def _no_server_error(response: requests.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        assert "error" in response.json()
    else:
        _complete_stream(response.headers.get("Content-Type", ""), response.text)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@FUZZ_SETTINGS
def test_schemathesis_finds_no_server_error(case):
    response = case.call_and_validate(checks=[not_a_server_error], timeout=60)
    if response.status_code == 200 and not response.stream_cut_short:  # schemathesis reads 20 SSE events at most
        content_type = next((v for k, v in response.headers.items() if k.lower() == "content-type"), [])
        _complete_stream(", ".join(content_type), response.text)


@given(body=hostile.openai_bodies())
@FUZZ_SETTINGS
def test_hostile_openai_bodies(fuzz_server, body):
    _no_server_error(
        requests.post(
            fuzz_server + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}, timeout=60
        )
    )


@given(body=hostile.native_bodies())
@FUZZ_SETTINGS
def test_hostile_native_bodies(fuzz_server, body):
    _no_server_error(
        requests.post(fuzz_server + "/v1/chat", data=body, headers={"Content-Type": "application/json"}, timeout=60)
    )


@given(body=hostile.raw_bodies, path=hostile.st.sampled_from(["/v1/chat", "/v1/chat/completions"]))
@FUZZ_SETTINGS
def test_raw_garbage_bodies(fuzz_server, body, path):
    _no_server_error(
        requests.post(fuzz_server + path, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    )


@given(form=hostile.multipart_forms())
@FUZZ_SETTINGS
def test_hostile_multipart_forms(fuzz_server, form):
    files, data = form
    if not files:
        files = [("prompt", (None, b"x"))]
    _no_server_error(requests.post(fuzz_server + "/v1/chat", files=files, data=data, timeout=60))
