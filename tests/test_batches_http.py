"""OpenAI's Batch API on real Gunicorn instances, through the official `openai` client: files and
batches created, listed, read and deleted; a batch's answers are the bits the Chat Completions
endpoint gives the same requests; a bad line fails alone; limits refused at upload, naming them;
cancel keeps what finished; a killed instance's lines are finished by another, each written once."""

from __future__ import annotations

import json
import signal
import time

import openai
import pytest
import requests

from imaging import data_url, encode, pattern
from servers import metric, openai_client

pytestmark = pytest.mark.server

ENDED = ("completed", "failed", "expired", "cancelled")


def question(i: int, max_tokens: int = 8, **extra) -> dict:
    content = [{"type": "text", "text": f"Question {i}: name a colour and a shape."}]
    if i % 3 == 0:  # some lines bring a picture, inline as a data URL
        png = encode(pattern(96, 64, seed=i), ".png")
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(png)}})
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return {"temperature": 0, "logprobs": True, "top_logprobs": 2, **body, **extra}


def jsonl(items) -> bytes:
    return b"".join((item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in items)


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run_batch(client, content: bytes):
    uploaded = client.files.create(file=("questions.jsonl", content), purpose="batch")
    return uploaded, client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait_until_ended(client, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, f"the batch is still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)
    return batch


def lines_of(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    records = [json.loads(text) for text in client.files.content(file_id).text.splitlines()]
    return {r["custom_id"]: r for r in records}


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('jobs') / 'jobs.sqlite3'}"


@pytest.fixture(scope="module")
def server(serve, store_url):
    env = {"JOB_STORE_URL": store_url, "MAX_BATCH_SIZE": "2", "BATCH_MAX_LINES": "40", "BATCH_MAX_FILE_BYTES": "400000"}
    with serve(env, "batches") as (base, _):
        yield base


def test_the_official_client_runs_a_batch_with_the_endpoints_own_answers(server):
    client = openai_client(server)
    good = {f"q{i}": question(i) for i in range(5)}
    content = jsonl(
        [line(cid, body) for cid, body in good.items()]
        + [
            b"{not json",
            line("wrong-url", question(9), url="/v1/embeddings"),
            line("bad-body", question(10, max_tokens=-1)),
            line("q0", question(11)),  # a custom_id used before
        ]
    )
    uploaded, batch = run_batch(client, content)
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(content), "questions.jsonl")
    assert batch.status == "in_progress" and batch.request_counts.total == 9
    done = wait_until_ended(client, batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (5, 4)
    assert done.completed_at and done.in_progress_at and done.expires_at > done.created_at
    answers = lines_of(client, done.output_file_id)
    assert sorted(answers) == sorted(good)
    for custom_id, body in good.items():
        record = answers[custom_id]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        batched = record["response"]["body"]
        direct = requests.post(server + "/v1/chat/completions", json=body).json()
        assert batched["object"] == "chat.completion"
        assert batched["choices"][0]["message"] == direct["choices"][0]["message"]
        assert batched["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"]  # every float the same
        assert batched["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    errors = lines_of(client, done.error_file_id)
    assert set(errors) == {"line-6", "wrong-url", "bad-body", "q0"}
    assert errors["line-6"]["error"]["code"] == "invalid_json_line"
    assert errors["wrong-url"]["error"]["code"] == "invalid_request_line"
    assert errors["bad-body"]["response"]["status_code"] == 400
    assert errors["bad-body"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert metric(server, "qwen3vl_batch_lines_run_total", 'result="ok"') >= 5
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_the_cli_submits_follows_and_fetches_a_batch(server, tmp_path):
    """`python -m service batch submit FILE --wait` / `status ID` / `results ID`, as a user types them."""
    from conftest import run_cli

    batch_file, answers, errors = tmp_path / "cli.jsonl", tmp_path / "answers.jsonl", tmp_path / "errors.jsonl"
    batch_file.write_bytes(jsonl([line("one", question(1)), line("two", question(2)), b"[1, 2]"]))
    submitted = run_cli("batch", "--url", server, "submit", str(batch_file), "--wait")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    assert batch_id.startswith("batch_") and "3/3" in submitted.stderr  # the progress bar, at its end
    status = run_cli("batch", "--url", server, "status", batch_id)
    assert json.loads(status.stdout)["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    fetched = run_cli("batch", "--url", server, "results", batch_id, "-o", str(answers), "--errors", str(errors))
    assert fetched.returncode == 0 and "2 answered, 1 failed, of 3" in fetched.stderr
    assert [json.loads(t)["custom_id"] for t in answers.read_text().splitlines()] == ["one", "two"]
    assert json.loads(errors.read_text())["error"]["code"] == "invalid_request_line"
    missing = run_cli("batch", "--url", server, "status", "batch_nope")
    assert missing.returncode != 0 and "404" in missing.stderr


def test_files_and_batches_belong_to_the_key_that_made_them(keyed_server):
    from conftest import KEY

    base, _ = keyed_server
    mine, theirs = openai_client(base, api_key=KEY), openai_client(base, api_key="other-key")
    uploaded, batch = run_batch(mine, jsonl([line("a", question(1, max_tokens=2))]))
    for call in (
        lambda: theirs.files.retrieve(uploaded.id),
        lambda: theirs.files.content(uploaded.id),
        lambda: theirs.batches.retrieve(batch.id),
        lambda: theirs.batches.cancel(batch.id),
        lambda: theirs.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):  # exactly as an id that does not exist
            call()
    assert theirs.batches.list().data == [] and theirs.files.list().data == []
    assert requests.get(f"{base}/v1/batches/{batch.id}").status_code == 401
    assert wait_until_ended(mine, batch.id).request_counts.completed == 1


def test_limits_are_refused_at_upload_naming_them(server):
    client = openai_client(server)
    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("big.jsonl", b"x" * 500_000), purpose="batch")
    assert big.value.status_code == 413 and "BATCH_MAX_FILE_BYTES" in big.value.message
    too_many = jsonl([line(f"c{i}", {"messages": []}) for i in range(41)])
    with pytest.raises(openai.BadRequestError) as many:
        client.files.create(file=("many.jsonl", too_many), purpose="batch")
    assert "BATCH_MAX_LINES" in many.value.message
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    uploaded = client.files.create(file=("ok.jsonl", jsonl([line("a", question(1))])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert endpoint.value.body["param"] == "endpoint"


def test_cancel_stops_the_running_lines_and_keeps_the_finished_ones(server, no_end_of_turn):
    client = openai_client(server)
    content = jsonl([line(f"long-{i}", question(i + 1, max_tokens=400, logit_bias=no_end_of_turn)) for i in range(8)])
    _, batch = run_batch(client, content)
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_until_ended(client, batch.id, timeout=30)
    assert done.status == "cancelled" and done.cancelled_at
    kept = lines_of(client, done.output_file_id)
    assert 1 <= len(kept) == done.request_counts.completed < 8
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 400 for r in kept.values())  # whole answers


@pytest.fixture(params=["sqlite", "redis"])
def shared_store(request, tmp_path) -> str:
    """A job store two instances share: a new SQLite file, or an emptied database of the real Redis."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    import redis

    url = request.getfixturevalue("redis_url").rsplit("/", 1)[0] + "/3"
    redis.Redis.from_url(url).flushdb()
    return url


def test_a_killed_instances_lines_are_finished_by_another_each_written_once(serve, shared_store, no_end_of_turn):
    """Two instances on one store, leases of 2 s: the first is SIGKILLed while it holds lines, the
    second (running beside it, taking lines too) finishes them once their leases end: the batch
    completes with every line once, each a whole answer."""
    env = {"JOB_STORE_URL": shared_store, "BATCH_LEASE_SECONDS": "2", "MAX_BATCH_SIZE": "2"}
    with serve(env, "batch-survives") as (second, _), serve(env, "batch-killed") as (first, first_process):
        client = openai_client(first)
        body = {"max_tokens": 120, "logit_bias": no_end_of_turn}
        _, batch = run_batch(client, jsonl([line(f"k{i}", question(i + 1, **body)) for i in range(8)]))
        deadline = time.monotonic() + 60
        while metric(first, "qwen3vl_batch_lines_running") < 1:  # this instance holds a line
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for worker in _children(first_process.pid):
            worker.kill()
        first_process.send_signal(signal.SIGKILL)
        first_process.wait(30)
        client = openai_client(second)
        done = wait_until_ended(client, batch.id, timeout=180)
        assert done.status == "completed" and done.request_counts.completed == 8
        answers = lines_of(client, done.output_file_id)
        assert sorted(answers) == [f"k{i}" for i in range(8)]  # each once
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 120 for r in answers.values())
        assert metric(second, "qwen3vl_batch_lines_run_total", 'result="ok"') >= 1


def _children(pid: int):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
