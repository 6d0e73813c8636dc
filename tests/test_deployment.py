"""The deployment end to end: a real Nginx in front of two real Gunicorn instances, one per core
(`python -m service.deploy`), on the embedded tiny model."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import requests
from safetensors import safe_open

from service import footprint
from service.deploy.planning import instance_bytes, plan_instances
from service.footprint import BYTES_PER_PARAMETER, INT4_BYTES_PER_WEIGHT, checkpoint_parameters, checkpoint_quantization
from service.settings import SettingsError, load_settings

from imaging import encode, pattern
from servers import deployment, free_port, metric, nginx_proxy, openai_client

pytestmark = [pytest.mark.server, pytest.mark.nginx]

MAX_BODY = 1024 * 1024
SLOW_SIDE = 1536  # a 1536x1536 image: ~2300 visual tokens, a prefill of about a second on one core
STACK_ENV = {
    "MAX_BODY_BYTES": str(MAX_BODY),
    "IMAGE_MAX_PIXELS": str(SLOW_SIDE * SLOW_SIDE),
    "CONTEXT_LIMIT": "4096",
    "MAX_NEW_TOKENS": "600",
    "QUEUE_SIZE": "2",
    "GRACEFUL_TIMEOUT": "10",
}
CHAT_OK = 'endpoint="/v1/chat",status="200"'
# Long enough that turn 1 leaves more than the few tokens the conversation cache ignores.
LONG_QUESTION = "Describe a cat in some detail: its fur, its eyes, its tail, and the way it moves about."


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deploy-logs")


@pytest.fixture(scope="module")
def stack(cache_dir, tiny_dir, logs):
    with deployment({**STACK_ENV, "CACHE_DIR": str(cache_dir)}, logs / "deploy.log") as running:
        yield running


def served_chats(stack) -> list[float]:
    """Successful /v1/chat requests each instance has answered so far."""
    return [metric(stack.backend(i), "qwen3vl_requests_total", CHAT_OK) for i in range(len(stack.ports))]


def served_by(stack, index: int) -> float:
    """Native requests an instance answered, once nothing runs there (an earlier test's stream may still end)."""
    deadline = time.monotonic() + 20
    while metric(stack.backend(index), "qwen3vl_generating") and time.monotonic() < deadline:
        time.sleep(0.1)
    return metric(stack.backend(index), "qwen3vl_requests_total", CHAT_OK)


def chat(base: str, conversation: str | None = None, **body) -> dict:
    """A non-streaming native request; the conversation goes in the X-Conversation-Id header."""
    headers = {"X-Conversation-Id": conversation} if conversation else {}
    r = requests.post(base + "/v1/chat", json={"stream": False, "temperature": 0, **body}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def instance_serving(stack, conversation: str | None = None, **body) -> tuple[int, dict]:
    """Send one request through Nginx; (index of the instance that answered it, its reply)."""
    before = served_chats(stack)
    reply = chat(stack.url, conversation, **body)
    moved = [i for i, (b, a) in enumerate(zip(before, served_chats(stack))) if a > b]
    assert len(moved) == 1
    return moved[0], reply


def timed_lines(response) -> list[tuple[float, dict]]:
    return [(time.perf_counter(), json.loads(line)) for line in response.iter_lines() if line]


def slow_image(variant: int) -> bytes:
    """A large grayscale PNG (small on the wire); each variant differs, so no cache shortens its prefill."""
    img = pattern(SLOW_SIDE, SLOW_SIDE, channels=1)
    img[40 * variant : 40 * variant + 20, :] = 128
    return encode(img, ".png")


# -- planning: cores and memory -------------------------------------------------------------------


def test_cores_are_split_into_disjoint_contiguous_sets_one_port_each(tmp_path):
    settings = load_settings(instances=2, port=9100, cache_dir=tmp_path)
    plan = plan_instances(settings, cores=[0, 1, 2, 3, 4])
    assert [i.cores for i in plan] == [(0, 1), (2, 3, 4)]
    assert [i.address for i in plan] == ["127.0.0.1:9100", "127.0.0.1:9101"]
    assert plan[1].cpu_list == "2,3,4"


def test_by_default_one_instance_per_cores_per_instance_in_each_numa_node_as_memory_allows(tiny_dir, cache_dir):
    settings = load_settings(instances=0, cores_per_instance=4, cache_dir=cache_dir)
    one = instance_bytes(settings, checkpoint_parameters(tiny_dir))
    cores = list(range(16))
    plan = plan_instances(settings, cores=cores, memory=100 * one, nodes=[cores])
    assert [i.cores for i in plan] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    # Two NUMA nodes of 6: one instance each (6 // 4), never one across the nodes.
    nodes = [list(range(6)), list(range(6, 12))]
    assert [i.cores for i in plan_instances(settings, cores=list(range(12)), memory=100 * one, nodes=nodes)] == [
        tuple(range(6)),
        tuple(range(6, 12)),
    ]
    assert len(plan_instances(settings, cores=cores, memory=int(2.5 * one), nodes=[cores])) == 2  # what memory holds
    assert len(plan_instances(settings, cores=cores, memory=one // 2, nodes=[cores])) == 1  # never none


def test_this_machine_by_default_gets_one_instance_on_all_its_cores(tmp_path):
    """2 cores here: the default (CORES_PER_INSTANCE=16) plans one instance using both."""
    cores = sorted(os.sched_getaffinity(0))
    plan = plan_instances(load_settings(cache_dir=tmp_path), memory=64 * 1024**3)
    if len(cores) < 16:
        assert [i.cores for i in plan] == [tuple(cores)]


def test_memory_estimate_counts_the_checkpoint_parameters(tiny_dir):
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        expected = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert checkpoint_parameters(tiny_dir) == expected > 100_000


def test_a_4bit_weight_costs_half_a_byte_and_its_groups_scale_and_zero_point(tmp_path):
    from torch import nn

    from service.quant.int4_linear import Int4Linear

    layer = Int4Linear.from_float(nn.Linear(256, 128), group=128)  # 128 rows: whole packed channel groups
    assert layer.nbytes() / (128 * 256) == INT4_BYTES_PER_WEIGHT == 0.5 + (2 + 1) / 128
    steady, peak = BYTES_PER_PARAMETER["int4"]
    assert steady == pytest.approx(BYTES_PER_PARAMETER["int8"][0] - 1 + INT4_BYTES_PER_WEIGHT) and peak == steady
    settings = load_settings(cache_dir=tmp_path)
    assert instance_bytes(settings, 2 * 10**9, "int4") < instance_bytes(settings, 2 * 10**9, "int8")


def test_a_4bit_checkpoint_is_planned_with_its_own_bytes(tiny_dir, int4_dir, tmp_path):
    assert checkpoint_quantization(int4_dir, "int8") == "int4"
    assert checkpoint_quantization(tiny_dir, "int8") == "int8" and checkpoint_quantization(tiny_dir, "fp32") == "fp32"
    published = tmp_path / "awq"
    published.mkdir()
    (published / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    assert checkpoint_quantization(published, "int8") == "int4"
    # Packed 4-bit weights count as the weights they hold (packing pads rows; a tied lm_head is stored twice).
    parameters = checkpoint_parameters(int4_dir)
    assert 1 <= parameters / checkpoint_parameters(tiny_dir) < 1.1
    # Memory for two instances at 4-bit bytes: two are planned, where int8's bytes would allow one.
    settings = load_settings(instances=0, cores_per_instance=1, model_path=int4_dir, cache_dir=tmp_path)
    need = instance_bytes(settings, parameters, "int4")
    assert 2 * need // instance_bytes(settings, parameters, "int8") == 1
    assert len(plan_instances(settings, cores=[0, 1, 2, 3], memory=2 * need, nodes=[[0, 1, 2, 3]])) == 2


def test_the_planners_checkpoint_markers_are_the_quantizers():
    """service/footprint.py repeats them (the planner uses it, without torch): they must stay the same."""
    from service.quant import packing, published

    assert footprint.QUANTIZED_MARKER == packing.QUANTIZED_MARKER
    assert footprint.FORMAT_INT4 == packing.FORMAT_INT4
    assert footprint.PUBLISHED_METHODS == published.METHODS


def test_more_instances_than_cores_is_refused(tmp_path):
    with pytest.raises(SettingsError, match="INSTANCES=3"):
        plan_instances(load_settings(instances=3, cache_dir=tmp_path), cores=[0, 1])


# -- the running stack ----------------------------------------------------------------------------


def test_each_instance_is_pinned_to_its_own_cores_with_matching_threads(stack):
    pinned = []
    for index in range(len(stack.ports)):
        workers = stack.workers(index)
        assert len(workers) == 1  # one model per instance
        status = Path(f"/proc/{workers[0].pid}/status").read_text()
        cpus = next(line.split(":")[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
        pinned.append({int(c) for part in cpus.strip().split(",") for c in _expand(part)})
        env = workers[0].environ()
        assert env["OMP_NUM_THREADS"] == env["THREADS"] == str(len(pinned[-1]))
    assert set().union(*pinned) == os.sched_getaffinity(0)  # every core the machine gives us is used
    assert sum(map(len, pinned)) == len(os.sched_getaffinity(0))  # and none is shared


def _expand(part: str) -> range:
    """ "3" or "2-5" of a Cpus_allowed_list."""
    low, _, high = part.partition("-")
    return range(int(low), int(high or low) + 1)


def test_tokens_arrive_through_nginx_as_they_are_generated(stack):
    body = {"prompt": "Keep talking.", "max_tokens": 300, "temperature": 0}
    spreads = {}
    for name, base in (("direct", stack.backend(0)), ("nginx", stack.url)):
        t0 = time.perf_counter()
        with requests.post(base + "/v1/chat", json=body, stream=True, timeout=30) as r:
            lines = timed_lines(r)
        deltas = [t for t, obj in lines if "delta" in obj]
        assert len(deltas) > 100 and lines[-1][1]["done"] is True
        assert deltas[0] - t0 < 0.5 * (lines[-1][0] - t0)  # the first token came long before the last
        spreads[name] = deltas[-1] - deltas[0]
    # Buffered, the deltas would arrive in one burst at the end: a spread near zero.
    assert spreads["nginx"] > 0.5 * spreads["direct"], spreads


def test_a_conversation_sticks_to_the_instance_that_holds_its_history(stack):
    for k in range(4):
        conversation = f"affinity-{k}-{uuid.uuid4().hex[:8]}"
        first_instance, first = instance_serving(stack, conversation, prompt="Describe a cat.", max_tokens=8)
        assert first["conversation_id"] == conversation  # the header named the conversation
        second_instance, second = instance_serving(stack, conversation, prompt="And a dog?", max_tokens=4)
        assert second_instance == first_instance
        # The instance kept the history: turn 2's prompt holds all of turn 1.
        assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]


def test_turn_two_reuses_the_kv_cache_of_its_instance(stack):
    for k in range(4):
        conversation = f"cached-{k}-{uuid.uuid4().hex[:8]}"
        first = chat(stack.url, conversation, prompt=LONG_QUESTION, max_tokens=24)
        second = chat(stack.url, conversation, prompt="And a dog?", max_tokens=4)
        assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    # The OpenAI endpoint is stateless; a client sets the header once, on the client.
    client = openai_client(
        stack.url, timeout=30, default_headers={"X-Conversation-Id": "openai-" + uuid.uuid4().hex[:8]}
    )
    history = [{"role": "user", "content": LONG_QUESTION}]
    first = client.chat.completions.create(model="m", messages=history, max_tokens=24, temperature=0)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And a dog?"},
    ]
    second = client.chat.completions.create(model="m", messages=history, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_new_conversations_are_spread_over_the_instances(stack):
    """Each new conversation's key (nginx/affinity.js: a hash of its first turn) picks its instance."""
    served = [instance_serving(stack, prompt=f"hi {k}", max_tokens=1)[0] for k in range(12)]
    assert set(served) == set(range(len(stack.ports))), served


def test_an_oversized_upload_is_refused_by_nginx_itself_as_json_413(stack):
    refused_before = sum(
        metric(stack.backend(i), "qwen3vl_requests_total", 'status="413"') for i in range(len(stack.ports))
    )
    big = os.urandom(MAX_BODY + MAX_BODY // 2)
    r = requests.post(
        stack.url + "/v1/chat",
        files=[("image", ("big.png", big, "image/png"))],
        data={"prompt": "x"},
        headers={"X-Request-Id": "upload-1"},
        timeout=30,
    )
    assert r.status_code == 413 and r.headers["Content-Type"] == "application/json"
    assert r.json()["error"] == {
        "message": f"request body is larger than the limit of {MAX_BODY} bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "too_large",
    }
    assert r.headers["X-Request-Id"] == "upload-1"
    assert (
        sum(metric(stack.backend(i), "qwen3vl_requests_total", 'status="413"') for i in range(len(stack.ports)))
        == refused_before
    )  # no instance saw it
    # Just under the limit, the body reaches the service (which judges it by its own rules).
    under = requests.post(
        stack.url + "/v1/chat",
        data=b"x" * (MAX_BODY - 1024),
        headers={"Content-Type": "application/json", "X-Request-Id": "upload-2"},
        timeout=30,
    )
    assert under.status_code == 400 and under.headers["X-Request-Id"] == "upload-2"
    assert under.json()["error"]["code"] != "too_large"


def test_with_no_instance_reachable_nginx_answers_a_json_502_at_once(logs):
    with nginx_proxy([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], logs / "nowhere.log") as url:
        t0 = time.perf_counter()
        r = requests.post(url + "/v1/chat", json={"prompt": "anyone?"}, timeout=10)
        assert time.perf_counter() - t0 < 3
    assert r.status_code == 502 and r.headers["Retry-After"] and r.headers["X-Request-Id"]
    assert r.json()["error"]["code"] == "no_instance"


def _slow_stream(base: str, variant: int) -> tuple[float | None, list[dict]]:
    """Stream a slow-prefill request: (seconds between the head line and the first token, all lines)."""
    files = [("image", ("slow.png", slow_image(variant), "image/png"))]
    lines = []
    try:
        with requests.post(
            base + "/v1/chat", files=files, data={"prompt": "What is it?", "max_tokens": "4"}, stream=True, timeout=30
        ) as r:
            for line in filter(None, r.iter_lines()):
                lines.append((time.perf_counter(), json.loads(line)))
    except requests.exceptions.ChunkedEncodingError:  # Nginx cut the stream
        pass
    head = next((t for t, obj in lines if "model" in obj), None)
    first = next((t for t, obj in lines if "delta" in obj), None)
    return (first - head if head and first else None), [obj for _, obj in lines]


def test_a_slow_prefill_passes_the_configured_read_timeout_and_a_shorter_one_would_cut_it(stack, logs):
    silence, lines = _slow_stream(stack.url, variant=1)
    assert lines[-1]["done"] is True and lines[-1]["usage"]["prompt_tokens"] > 2000
    assert silence > 0.3  # the prefill was silent this long: the read timeout had to outlast it
    with nginx_proxy(
        [f"127.0.0.1:{stack.ports[0]}"], logs / "short-timeout-nginx.log", proxy_read_timeout=silence / 4
    ) as short:
        _, cut = _slow_stream(short, variant=2)
        assert cut and not cut[-1].get("done")  # the head line came, then Nginx gave up
        # Not streamed, the whole answer is silence: Nginx's own 504, in the service's error shape.
        r = requests.post(
            short + "/v1/chat",
            files=[("image", ("slow.png", slow_image(3), "image/png"))],
            data={"prompt": "What is it?", "max_tokens": "4", "stream": "false"},
            timeout=30,
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"


def test_an_instance_that_cannot_serve_hands_its_requests_to_the_next(stack, unloadable_server, logs):
    unready = unloadable_server  # answers 503 like an instance still loading its model

    def refused() -> float:
        return metric(unready, "qwen3vl_requests_total", 'endpoint="/v1/chat",status="503"')

    tried_before = refused()
    with nginx_proxy([unready.removeprefix("http://"), f"127.0.0.1:{stack.ports[0]}"], logs / "retry-nginx.log") as url:
        before, sent = served_by(stack, 0), 0
        # Conversations hash to either instance: send until one went to the unready one first (each answered).
        while sent < 64 and refused() == tried_before:
            chat(url, f"retry-{sent}-{uuid.uuid4().hex[:6]}", prompt="hi", max_tokens=1)
            sent += 1
        assert served_by(stack, 0) == before + sent
    assert refused() > tried_before  # it was tried


def test_killing_an_instance_ends_its_streams_and_the_others_take_new_conversations(stack):
    homes: dict[int, str] = {}
    for k in range(40):  # find a conversation id that Nginx sends to each instance
        conversation = f"home-{k}-{uuid.uuid4().hex[:6]}"
        homes.setdefault(instance_serving(stack, conversation, prompt="hi", max_tokens=1)[0], conversation)
        if len(homes) == len(stack.ports):
            break
    victim, survivor = 1, 0
    old_master = stack.master(victim)
    cores = stack.workers(victim)[0].cpu_affinity()

    stream = requests.post(
        stack.url + "/v1/chat",
        json={"prompt": "Go on and on.", "max_tokens": 600},
        headers={"X-Conversation-Id": homes[victim]},
        stream=True,
        timeout=5,
    )
    lines = stream.iter_lines()
    assert "model" in json.loads(next(lines)) and "delta" in json.loads(next(lines))
    os.killpg(old_master.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # cut, not hanging (timeout=5 would raise)
        for _ in lines:
            pass
    assert time.perf_counter() - t0 < 5

    before = served_by(stack, survivor)
    replies = []
    for conversation in (homes[victim], f"new-{uuid.uuid4().hex[:6]}", None, None):
        t = time.perf_counter()
        replies.append(chat(stack.url, conversation, prompt="Still there?", max_tokens=3))
        assert replies[-1]["usage"]["completion_tokens"] == 3 and time.perf_counter() - t < 5
    assert served_by(stack, survivor) == before + 4
    # What the loss cost: the lost instance's history of that conversation (it starts afresh).
    assert replies[0]["conversation_id"] == homes[victim]
    assert replies[0]["usage"]["prompt_tokens"] == replies[1]["usage"]["prompt_tokens"]

    # The supervisor restarts the lost instance on the same cores; its conversations come home.
    deadline = time.monotonic() + 60
    while True:
        try:
            new_master = stack.master(victim)
            if new_master.pid != old_master.pid and requests.get(stack.backend(victim) + "/ready", timeout=2).ok:
                break
        except (LookupError, requests.RequestException, psutil.Error):
            pass
        assert time.monotonic() < deadline, "the killed instance was not restarted"
        time.sleep(0.2)
    assert stack.workers(victim)[0].cpu_affinity() == cores


def test_sigterm_lets_the_open_stream_finish_then_stops_everything(stack, no_end_of_turn):
    children = [p for p in psutil.Process(stack.supervisor.pid).children(recursive=True)]
    assert any("nginx" in p.name() for p in children) and len(children) >= 2 * len(stack.ports) + 2
    with requests.post(
        stack.url + "/v1/chat",
        json={"prompt": "Keep talking.", "max_tokens": 300, "temperature": 0, "logit_bias": no_end_of_turn},
        stream=True,
        timeout=30,
    ) as r:
        lines = r.iter_lines()
        assert "model" in json.loads(next(lines))
        stack.supervisor.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in lines if line]
    assert rest[-1]["done"] is True and rest[-1]["finish_reason"] == "length", rest[-1]
    assert stack.supervisor.wait(timeout=30) == 0
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(requests.ConnectionError):
        requests.get(stack.url + "/health", timeout=2)


def test_with_api_keys_the_stack_starts_and_the_healthcheck_needs_none(cache_dir, tiny_dir, logs):
    log = logs / "keys.log"
    with deployment({"CACHE_DIR": str(cache_dir), "API_KEYS": "key-one,key-two"}, log, instances=1) as keyed:
        body = {"prompt": "hi", "max_tokens": 1, "stream": False}
        assert requests.post(keyed.url + "/v1/chat", json=body, timeout=30).status_code == 401
        assert (
            requests.post(
                keyed.url + "/v1/chat", json=body, headers={"Authorization": "Bearer key-two"}, timeout=30
            ).status_code
            == 200
        )

        def healthcheck(listen: str) -> int:
            env = {**os.environ, "API_KEYS": "key-one,key-two", "NGINX_LISTEN": listen}
            return subprocess.run([sys.executable, "-m", "service.deploy.healthcheck"], env=env).returncode

        assert healthcheck(keyed.url.removeprefix("http://")) == 0
        assert healthcheck(f"127.0.0.1:{free_port()}") == 1
    assert "key-one" not in log.read_text()  # the curl line it printed names no key


def test_an_instance_that_does_not_become_ready_in_start_timeout_stops_the_deploy(cache_dir, tiny_dir, logs):
    """No waiting forever on a model that never loads: exit 1, the reason logged, no process left."""
    log = logs / "start-timeout.log"
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(
        {
            "CACHE_DIR": str(cache_dir),
            "INSTANCES": "1",
            "PORT": str(free_port()),
            "NGINX_LISTEN": f"127.0.0.1:{free_port()}",
            "START_TIMEOUT": "0.2",
        }
    )
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "service.deploy"],
            cwd=Path(__file__).parent.parent,
            env=env,
            stdout=out,
            stderr=out,
            timeout=120,
        )
    assert proc.returncode == 1
    assert "not ready after START_TIMEOUT=0.2 s" in log.read_text()
    assert time.monotonic() - t0 < 60  # gave up instead of waiting for the model
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if f"--bind 127.0.0.1:{env['PORT']}" in " ".join(p.info["cmdline"] or [])
    ]
