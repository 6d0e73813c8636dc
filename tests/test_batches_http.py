"""OpenAI's Batch API on real Gunicorn instances, through the official `openai` client: files and
batches created, listed, read and deleted; a batch's answers are the bits the Chat Completions
endpoint gives the same requests; a bad line fails alone; limits refused at upload, naming them;
cancel keeps what finished; a killed instance's lines are finished by another, each written once; a
broken or unreachable job store takes down the Batch API alone; uploads streamed in bounded memory;
any file name downloads; files expire, storage has a quota; tenants' batches take turns."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import threading
import time

import openai
import psutil
import pytest
import requests
from werkzeug.http import parse_options_header

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
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
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
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# -- the job store unusable: the Batch API answers 503, everything else serves ---------------------------


def assert_only_the_batch_api_is_down(base: str, problem: str) -> None:
    """The batch endpoints 503 naming the store; Chat Completions, Responses and Messages answer; /ready
    is 200 and says degraded; the gauge the alert reads is 0."""
    client = openai_client(base)
    for call in (lambda: client.files.list(), lambda: client.batches.list(), lambda: run_batch(client, b"{}\n")):
        with pytest.raises(openai.APIStatusError) as refused:
            call()
        assert refused.value.status_code == 503 and refused.value.body["code"] == "job_store_unavailable"
        assert "job store" in refused.value.message and problem in refused.value.message
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content is not None
    assert client.responses.create(model="m", input="hi", max_output_tokens=2).output  # answered
    messages = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert requests.post(base + "/v1/messages", json=messages).status_code == 200
    ready = requests.get(base + "/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "degraded"
    assert problem in ready.json()["degraded"]["job_store"]
    assert "qwen3vl_job_store_usable 0.0" in requests.get(base + "/metrics").text


def wait_for(check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "never"
        time.sleep(0.2)
    return found


@pytest.mark.parametrize("broken", ["garbage", "a folder"])
def test_an_unusable_job_store_takes_down_the_batch_api_alone(serve, tmp_path, broken):
    """CACHE_DIR/jobs.sqlite3 garbage or a folder when the instance starts: it starts and serves; the
    Batch API answers 503 naming the store."""
    store = tmp_path / "jobs.sqlite3"
    if broken == "garbage":
        store.write_bytes(b"these bytes are no database " * 1000)
    else:
        store.mkdir()
    with serve({"JOB_STORE_URL": f"sqlite:///{store}"}, f"batches-{broken.replace(' ', '-')}") as (base, _):
        wait_for(lambda: requests.get(base + "/ready").json()["status"] == "degraded")  # the runner's first poll
        assert_only_the_batch_api_is_down(base, "not a database" if broken == "garbage" else "is a directory")


def test_a_job_store_replaced_while_serving_is_noticed_then_found_again(roomy_server):
    """The SQLite file replaced underneath (writes would go to the deleted file, lost at the next
    start): 503 at once; the garbage removed, the instance opens a new store as a restart would."""
    base, _, store = roomy_server
    client = openai_client(base)
    kept = client.files.create(file=("kept.jsonl", jsonl([line("a", question(1))])), purpose="batch")
    (store.parent / "garbage").write_bytes(b"not a database " * 1000)
    os.replace(store.parent / "garbage", store)
    assert_only_the_batch_api_is_down(base, "replaced while serving")
    store.unlink()
    for side in ("-wal", "-shm"):  # the replaced store's: a new one must not read them
        store.with_name(store.name + side).unlink(missing_ok=True)
    wait_for(lambda: requests.get(base + "/v1/files").status_code == 200)
    assert requests.get(base + "/ready").json()["status"] == "ready"
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(kept.id)
    assert "qwen3vl_job_store_usable 1.0" in requests.get(base + "/metrics").text


def test_an_unreachable_redis_takes_down_the_batch_api_alone_until_it_answers(serve, tmp_path):
    from servers import free_port, redis_server

    port = free_port()
    with serve({"JOB_STORE_URL": f"redis://127.0.0.1:{port}/0"}, "batches-redis-down") as (base, _):
        wait_for(lambda: requests.get(base + "/ready").json()["status"] == "degraded")
        assert_only_the_batch_api_is_down(base, "Redis is unreachable")
        with redis_server(tmp_path / "redis.log", port=port):
            wait_for(lambda: requests.get(base + "/v1/batches").status_code == 200)
            _, batch = run_batch(openai_client(base), jsonl([line("a", question(1, max_tokens=2))]))
            assert wait_until_ended(openai_client(base), batch.id).request_counts.completed == 1


# -- uploads: streamed in bounded memory; any file name downloads ----------------------------------------


@pytest.fixture(scope="module")
def roomy_server(serve, tmp_path_factory):
    """(base URL, Gunicorn master, its SQLite store) with the default batch limits (100 MiB files)."""
    store = tmp_path_factory.mktemp("roomy") / "jobs.sqlite3"
    with serve({"JOB_STORE_URL": f"sqlite:///{store}"}, "batches-roomy") as (base, master):
        yield base, master, store


@pytest.fixture(scope="module")
def server_running_no_lines(serve, tmp_path_factory):
    """(base URL, Gunicorn master) with the default batch limits and no batch runner: what a batch costs
    to make, with no line of it running meanwhile (a running line's tensors would be counted too)."""
    store = tmp_path_factory.mktemp("no-runner") / "jobs.sqlite3"
    with serve({"JOB_STORE_URL": f"sqlite:///{store}", "BATCH_RUNNER": "false"}, "batches-no-runner") as (base, master):
        yield base, master


def growth_while(process: psutil.Process, call) -> tuple[object, float]:
    """(what `call` returned, the most the process's resident memory grew meanwhile, in MiB)."""
    before, peak, done = process.memory_info().rss, [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        answer = call()
    finally:
        done.set()
        watcher.join()
    return answer, (peak[0] - before) / 2**20


def test_a_file_read_in_chunks_has_the_lines_splitlines_finds():
    """Any chunking (a "\\r\\n" cut in two, a line over the limit across chunks, a last line with no
    end): the non-blank lines of bytes.splitlines, a line over the limit as None."""
    from service.api.batches.serving import batch_lines

    pieces = [b"a", b"{}", b" ", b"\t", b"\n", b"\r", b"\r\n", b"\x0b", b"xyz", b"  \n"]
    draw = random.Random(53)
    for _ in range(3000):
        data = b"".join(draw.choice(pieces) for _ in range(draw.randint(0, 40)))
        limit, size = draw.randint(1, 10), draw.randint(1, 12)
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        expected = [line if len(line) <= limit else None for line in data.splitlines() if line.strip()]
        assert list(batch_lines(chunks, limit)) == expected, (data, limit, size)


@pytest.mark.parametrize("mib", [24, 96])
def test_an_upload_is_counted_as_it_streams_in_bounded_memory(roomy_server, mib):
    """The tester's files of 2-byte lines (24 and 96 MiB, under the 100 MiB limit): the line limit
    refuses them with the worker growing a few MiB (it grew 478 MiB and 1.9 GiB when every line was
    an object before the count)."""
    base, master, _ = roomy_server
    [worker] = psutil.Process(master.pid).children()
    files = {"file": ("lines.jsonl", b"{}\n" * (mib * 2**20 // 3))}
    post = lambda: requests.post(base + "/v1/files", files=files, data={"purpose": "batch"}, timeout=300)  # noqa: E731
    refused, grew = growth_while(worker, post)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "too_many_lines"
    assert grew < 48, f"the worker grew {grew:.0f} MiB taking a {mib} MiB upload"


def test_a_large_upload_and_the_batch_made_of_it_take_bounded_memory(server_running_no_lines):
    """A 93 MiB file of 45,000 lines is kept, and a batch made of it, with the worker growing a few MiB
    each (283 and 291 MiB before: the file read whole, split whole, its requests held two and three times).
    No line runs meanwhile: with a runner, lines claimed during the measurement put 51–103 MiB into it."""
    base, master = server_running_no_lines
    [worker] = psutil.Process(master.pid).children()
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 2000}]}
    files = {"file": ("big.jsonl", jsonl(line(f"c{i}", body) for i in range(45_000)))}
    post = lambda: requests.post(base + "/v1/files", files=files, data={"purpose": "batch"}, timeout=300)  # noqa: E731
    kept, grew = growth_while(worker, post)
    assert kept.status_code == 200 and kept.json()["bytes"] > 90 * 2**20
    assert grew < 48, f"the worker grew {grew:.0f} MiB keeping a 93 MiB upload"
    made = {"input_file_id": kept.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created, grew = growth_while(worker, lambda: requests.post(base + "/v1/batches", json=made, timeout=300))
    assert created.status_code == 200 and grew < 48, f"the worker grew {grew:.0f} MiB making a batch of 93 MiB"
    cancelled = requests.post(f"{base}/v1/batches/{created.json()['id']}/cancel").json()
    assert cancelled["status"] in ("cancelling", "cancelled")
    requests.delete(f"{base}/v1/files/{kept.json()['id']}")


def test_a_file_downloads_whatever_its_name(roomy_server):
    """Non-ASCII, quotes, backslashes, a CR LF given through RFC 5987's filename*: each downloads with a
    Content-Disposition of RFC 6266 that names it exactly (it was Gunicorn's HTML 500, a JSON 500, a
    malformed header)."""
    base = roomy_server[0]
    client, content = openai_client(base), jsonl([line("a", question(1))])
    names = ["数据.jsonl", 'say "hi".jsonl', "back\\slash.jsonl", "plain.jsonl"]
    made = {name: client.files.create(file=(name, content), purpose="batch").id for name in names}
    boundary, injected = "b0undary", "a\r\nX-Injected: 1.jsonl"
    raw = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            "filename*=UTF-8''a%0D%0AX-Injected%3A%201.jsonl\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    uploaded = requests.post(base + "/v1/files", data=raw, headers=headers).json()
    assert uploaded["filename"] == injected
    made[injected] = uploaded["id"]
    for name, file_id in made.items():
        got = requests.get(f"{base}/v1/files/{file_id}/content")
        assert got.status_code == 200 and got.content == content, name
        assert "X-Injected" not in got.headers and got.headers["Content-Disposition"].isascii()
        kind, options = parse_options_header(got.headers["Content-Disposition"])
        assert (kind, options["filename"]) == ("attachment", name)
        assert client.files.content(file_id).content == content


# -- retention: files expire, each tenant's storage has a quota, the store is private ----------------------


@pytest.fixture(scope="module")
def retention_server(serve, tmp_path_factory):
    """(base URL, its SQLite store) where a file is kept 3 s unless asked otherwise and a tenant may
    store 64 KiB."""
    store = tmp_path_factory.mktemp("retention") / "jobs.sqlite3"
    env = {"JOB_STORE_URL": f"sqlite:///{store}", "BATCH_FILE_TTL": "3", "BATCH_MAX_STORED_BYTES": "65536"}
    with serve(env, "batches-retention") as (base, _):
        yield base, store


def test_files_expire_as_asked_or_by_default(retention_server):
    base = retention_server[0]
    client, content = openai_client(base), jsonl([line("a", question(1, max_tokens=2))])
    asked = client.files.create(
        file=("asked.jsonl", content), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert asked.expires_at == asked.created_at + 3600
    default = client.files.create(file=("default.jsonl", content), purpose="batch")
    assert default.expires_at == default.created_at + 3
    with pytest.raises(openai.BadRequestError) as short:
        client.files.create(
            file=("x.jsonl", content), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
        )
    assert short.value.body["param"] == "expires_after.seconds"
    wait_for(lambda: requests.get(f"{base}/v1/files/{default.id}").status_code == 404, timeout=10)
    assert requests.get(f"{base}/v1/files/{default.id}/content").status_code == 404
    assert default.id not in [f.id for f in client.files.list()] and client.files.retrieve(asked.id).id == asked.id
    batch = client.batches.create(
        input_file_id=asked.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    output = client.files.retrieve(wait_until_ended(client, batch.id).output_file_id)
    assert output.expires_at == output.created_at + 7200
    client.files.delete(asked.id)


def test_a_tenants_storage_has_a_quota_naming_it(retention_server):
    client = openai_client(retention_server[0])
    keep = {"anchor": "created_at", "seconds": 3600}
    first = client.files.create(file=("a.jsonl", b"x" * 40_000), purpose="user_data", expires_after=keep)
    with pytest.raises(openai.RateLimitError) as full:
        client.files.create(file=("b.jsonl", b"x" * 40_000), purpose="user_data", expires_after=keep)
    assert full.value.body["code"] == "storage_quota_exceeded" and "BATCH_MAX_STORED_BYTES" in full.value.message
    with pytest.raises(openai.APIStatusError) as never:
        client.files.create(file=("c.jsonl", b"x" * 70_000), purpose="user_data", expires_after=keep)
    assert never.value.status_code == 413 and "BATCH_MAX_STORED_BYTES" in never.value.message
    client.files.delete(first.id)
    client.files.delete(client.files.create(file=("b.jsonl", b"x" * 40_000), purpose="user_data").id)


def test_deleting_an_input_file_cancels_its_batch(retention_server, no_end_of_turn):
    client = openai_client(retention_server[0])
    body = {"model": "m", "max_tokens": 400, "logit_bias": no_end_of_turn}
    keep = {"anchor": "created_at", "seconds": 3600}
    lines = [line(f"l{i}", {**body, "messages": [{"role": "user", "content": f"Count to {i}."}]}) for i in range(6)]
    uploaded = client.files.create(
        file=("long.jsonl", jsonl(lines)),
        purpose="batch",
        expires_after=keep,
    )
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.files.delete(uploaded.id).deleted
    done = wait_until_ended(client, batch.id, timeout=60)
    assert done.status == "cancelled" and done.request_counts.completed < 6


def test_the_job_store_and_stored_responses_are_the_services_alone(retention_server, cache_dir):
    """Every tenant's prompts: the store (and its -wal, -shm) and a stored response's files 0600."""
    base, store = retention_server
    openai_client(base).files.create(file=("a.jsonl", jsonl([line("a", question(1))])), purpose="batch")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in store.parent.glob("jobs.sqlite3*")}
    assert modes == {"jobs.sqlite3": 0o600, "jobs.sqlite3-wal": 0o600, "jobs.sqlite3-shm": 0o600}
    stored = openai_client(base).responses.create(model="m", input="hi", max_output_tokens=2)
    files = list((cache_dir / "responses").glob(f"{stored.id}.*"))
    assert len(files) == 2 and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}


# -- tenants take turns ----------------------------------------------------------------------------------


def test_a_small_batch_is_not_held_behind_another_tenants_big_one(keyed_server, no_end_of_turn):
    """The tester's case: one tenant's 24 lines, then another's 1 line half a second later. The small
    batch ends while the big one has most of its lines still to run (it waited for all 24 before)."""
    from conftest import KEY

    base, _ = keyed_server
    big, small = openai_client(base, api_key=KEY), openai_client(base, api_key="other-key")
    body = {"max_tokens": 300, "logit_bias": no_end_of_turn}
    text_only = lambda i: {"model": "m", "messages": [{"role": "user", "content": f"Count to {i}."}], **body}  # noqa: E731
    _, first = run_batch(big, jsonl([line(f"b{i}", text_only(i)) for i in range(24)]))
    time.sleep(0.5)
    _, second = run_batch(small, jsonl([line("s", text_only(99))]))
    wait_until_ended(small, second.id)
    counts = big.batches.retrieve(first.id).request_counts
    assert counts.completed + counts.failed <= 12, counts
    big.batches.cancel(first.id)
