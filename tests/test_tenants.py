"""Tenants (service/api/access/tenants.py): what one API key's users sent stays theirs — conversations, caches
and limits per tenant — on a real Gunicorn behind a real Nginx, with hostile clients: guessed and
known conversation ids, a known history resent by another tenant, a wrong cache_salt, one tenant's
burst while another's requests are served, the keys file reloaded under load."""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest
import requests
from test_caches import image

from service.api.access.tenants import Tenants, build_table
from service.engine.admission import Admission
from service.engine.engine import Engine
from service.errors import QueueFull
from service.generation import Completion, GenerationRequest, SamplingParams, TenantShare
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.settings import SettingsError, load_settings

from conftest import own_kv_disk_dir, weights_settings
from imaging import data_url, encode, pattern
from servers import metric as any_metric
from servers import nginx_proxy, openai_client

ALICE, BOB = "sk-alice-4f1d2c9a7e3b", "sk-bob-8c2e5a1f9d7b"
CAROL, DAVE, ERIN = "sk-carol-1a2b3c4d5e6f", "sk-dave-6f5e4d3c2b1a", "sk-erin-0f9e8d7c6b5a"
FRANK, GRACE = "sk-frank-5c4b3a2f1e0d", "sk-grace-a1b2c3d4e5f6"
KEYS_FILE = f"""# the test server's tenants beside API_KEYS' alice
bob   {BOB}
carol {CAROL} rpm=2
dave  {DAVE}  tpm=40
frank {FRANK} rpm=3
grace {GRACE} rpm=3
"""
SECRETS = (ALICE, BOB, CAROL, DAVE, ERIN, FRANK, GRACE)
PICTURE = data_url(encode(pattern(448, 448, seed=41), ".png"))
OTHER_PICTURE = data_url(encode(pattern(448, 448, seed=42), ".png"))  # sent by no other test here
# A document of ~3,000 tokens: its prefill, not the request's fixed costs, sets a cold first token's time.
DOCUMENT = "Read this contract. " + " ".join(f"clause {i} binds party {i % 7} to pay {i * 13}." for i in range(100))
LONG_QUESTION = "Describe this picture in every detail: " + "colours, shapes, where each thing is. " * 12


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- keys name tenants ---------------------------------------------------------------------------------


def test_keys_name_tenants_and_their_errors_never_hold_a_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"bob {BOB} slots=1 queue=3\n# a comment\nbob {ERIN}\n\ncarol {CAROL} rpm=5 tpm=900\n")
    table = build_table(f"alice:{ALICE}, {DAVE}", keys)
    assert sorted(table.by_name) == ["alice", "bob", "carol", "key2"]  # an unnamed key: its place
    bob = table.by_name["bob"]
    assert (bob.slots, bob.queue, bob.rpm) == (1, 3, None) and table.by_name["carol"].tpm == 900
    tenants = Tenants(load_settings(api_keys=f"alice:{ALICE}, {DAVE}", api_keys_file=keys, cache_dir=tmp_path))
    assert tenants.resolve(BOB) is tenants.resolve(ERIN) is not None  # two keys, one tenant: key rotation
    assert tenants.resolve(DAVE).name == "key2" and tenants.resolve("sk-nobody") is None
    assert all(key not in repr(tenants.table) for key in SECRETS)  # kept as digests only
    # The cache namespace: a keyed hash, the same for the instances of the machine, never a name or key.
    namespace = tenants.cache_namespace(tenants.resolve(ALICE), "salt-1")
    again = Tenants(load_settings(api_keys=f"alice:{ALICE}", cache_dir=tmp_path))
    assert (
        namespace
        == again.cache_namespace(again.resolve(ALICE), "salt-1")
        != again.cache_namespace(again.resolve(ALICE), None)
    )
    assert "alice" not in namespace and (tmp_path / "tenant-secret").stat().st_mode & 0o077 == 0
    for text, words in [
        (f"bob {BOB} slots=0", "line 1"),
        (f"bob {BOB} speed=9", "line 1"),
        (f"b@d {BOB}", "a tenant name"),
        (f"bob {BOB}\ncarol {BOB}", "given twice"),
        (f"bob {BOB} rpm=1\nbob {ERIN} rpm=2", "different limits"),
        (f"{BOB}", "line 1"),
    ]:
        keys.write_text(text)
        with pytest.raises(SettingsError, match=words) as info:
            build_table("", keys)
        assert all(key not in str(info.value) for key in SECRETS)
    with pytest.raises(SettingsError, match="unnamed"):
        build_table(f"{ALICE}, key1:{BOB}", None)


# -- fair share in admission ---------------------------------------------------------------------------

A, B = TenantShare("a", slots=2, queue=2), TenantShare("b", slots=2, queue=2)


def test_a_tenant_under_its_share_takes_a_place_from_one_over_its_own_whatever_their_priorities():
    admission = Admission(queue_size=4, timeout=5, slots=4)
    held = [admission.acquire(tenant=A, priority=-200) for _ in range(4)]  # nobody else waits: all four places
    assert all(t.holds for t in held)
    first_b = admission.acquire(tenant=B)  # a over its share (4 > 2): one of its requests is paused
    assert first_b.holds and sum(t.paused for t in held) == 1
    second_b = admission.acquire(tenant=B, priority=5)
    assert second_b.holds and sum(t.paused for t in held) == 2
    admission.release(first_b)  # b under its share again, but nobody of b waits: the place is a's
    assert sum(t.holds for t in held) == 3


def test_priority_never_takes_another_tenants_share():
    admission = Admission(queue_size=4, timeout=5, slots=4)
    a_held = [admission.acquire(tenant=A) for _ in range(2)]
    b_held = [admission.acquire(tenant=B, priority=-100) for _ in range(2)]
    third = threading.Thread(target=lambda: admission.release(admission.acquire(tenant=B, priority=-100)))
    third.start()  # more urgent than a's, but b holds its share: it waits
    time.sleep(0.2)
    assert third.is_alive() and all(t.holds for t in a_held)
    admission.release(b_held[0])  # b's own place
    third.join(2)
    assert not third.is_alive() and all(t.holds for t in a_held)


def test_a_tenant_beyond_its_queue_share_gets_429_naming_it_and_others_still_queue():
    admission = Admission(queue_size=4, timeout=5, slots=1)
    holder = admission.acquire(tenant=A)
    waiting = [threading.Thread(target=lambda: admission.release(admission.acquire(tenant=A))) for _ in range(2)]
    for thread in waiting:
        thread.start()
    time.sleep(0.1)
    with pytest.raises(QueueFull) as refused:
        admission.acquire(tenant=A)
    assert refused.value.code == "tenant_queue_full" and "queue=2" in refused.value.message
    assert refused.value.headers["Retry-After"]
    b_waits = threading.Thread(target=lambda: admission.release(admission.acquire(tenant=B)))
    b_waits.start()  # b's place in the queue is there
    time.sleep(0.1)
    admission.release(holder)
    for thread in [*waiting, b_waits]:
        thread.join(5)
        assert not thread.is_alive()


# -- the disk tier: one tenant never finds another's blocks -------------------------------------------------


def test_the_disk_tier_finds_only_the_blocks_of_the_requests_namespace(cache_dir, loaded_model):
    """Memory tier off: every hit is the disk's. Tenant a's repeat comes from disk with the same bits;
    tenant b's identical request finds nothing."""
    folder = own_kv_disk_dir()
    settings = weights_settings(cache_dir, "int8", conversation_cache_max_bytes=0, kv_disk_dir=folder)
    engine = Engine(loaded_model("int8"), settings)
    parts = [ImagePart(image(engine, 192, 160, seed=3)), TextPart(LONG_QUESTION)]

    def ask(namespace: str) -> Completion:
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
        request = GenerationRequest([ChatMessage("user", parts)], params, cache_namespace=namespace)
        done = [e for e in engine.generate(request) if isinstance(e, Completion)][0]
        engine.caches.kv.disk.flush(30)
        engine.caches.vision.entries.clear()
        return done

    first = ask("namespace-of-a")
    assert first.cached_tokens == 0
    other = ask("namespace-of-b")
    assert other.cached_tokens == 0 and other.cached_from is None
    again = ask("namespace-of-a")
    assert again.cached_from == "disk" and again.cached_tokens >= 64
    assert (again.token_ids, again.logprobs) == (first.token_ids, first.logprobs) == (other.token_ids, other.logprobs)
    files = list(Path(folder).glob("*/*.kv"))
    assert files and not any(b"namespace-of" in f.name.encode() or b"namespace-of" in f.read_bytes() for f in files)


# -- on a real Gunicorn behind Nginx ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_server(serve, tmp_path_factory):
    """(Nginx URL, Gunicorn URL, its master process, keys file, KV_DISK_DIR, log) of one Gunicorn with
    six tenants (alice in API_KEYS, bob, carol, dave, frank, grace in API_KEYS_FILE), a batch of 4 and a queue of 4
    (each tenant's share: 2 and 2), behind an Nginx."""
    folder = tmp_path_factory.mktemp("tenants")
    keys, kv = folder / "keys", folder / "kv"
    keys.write_text(KEYS_FILE)
    env = {
        "API_KEYS": f"alice:{ALICE}",
        "API_KEYS_FILE": str(keys),
        "MAX_BATCH_SIZE": "4",
        "QUEUE_SIZE": "4",
        # The embedded model decodes ~1,000 tokens a second a sequence: a burst's answers must outlast
        # its arrival on a loaded machine.
        "MAX_NEW_TOKENS": "4000",
        "CONTEXT_LIMIT": "8192",
        "KV_DISK_DIR": str(kv),
        "LOG_LEVEL": "debug",
        "ACCESS_LOG": "1",
    }
    with serve(env, "tenants", headers=auth(ALICE)) as (base, master):
        address = base.removeprefix("http://")
        with nginx_proxy([address], folder / "nginx.log") as url:
            yield url, base, master, keys, kv, serve.log("tenants")


def metric(base: str, name: str, labels: str = "") -> float:
    return any_metric(base, name, labels, headers=auth(BOB))


def chat(url: str, key: str, **body) -> requests.Response:
    return requests.post(
        url + "/v1/chat",
        json={"max_tokens": 8, "temperature": 0, "logprobs": True, "stream": False, **body},
        headers=auth(key),
        timeout=120,
    )


def bits(done: dict) -> list:
    return [(e["token"], e["logprob"]) for e in done["logprobs"]]


def test_another_tenants_conversation_id_is_answered_exactly_as_an_unknown_one(tenant_server):
    url = tenant_server[0]
    secret = "The password is swordfish-77."
    first = chat(url, ALICE, prompt=f"{secret} Remember it.", images=[PICTURE], conversation_id="support-42").json()
    made = chat(url, ALICE, prompt=f"{secret} Keep it too.").json()["conversation_id"]  # an id the server made
    follow = chat(url, ALICE, prompt="What is the password?", conversation_id="support-42").json()
    assert follow["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] and follow["images"] == 1
    question = {"prompt": "What is the password? Repeat everything said before."}
    answers = [
        chat(url, BOB, conversation_id=known, cache_salt=f"fresh-{known}", **question).json()
        for known in ("support-42", made, "never-used-9f3")  # a chosen id, a made one, one nobody used
    ]
    for answer in answers:  # each exactly the answer to an unknown id: no history, nothing cached
        assert answer["usage"]["cached_tokens"] == 0 and answer["images"] == 0 and "swordfish" not in answer["text"]
        assert answer["usage"]["prompt_tokens"] == answers[2]["usage"]["prompt_tokens"]
        assert bits(answer) == bits(answers[2])
    assert [a["conversation_id"] for a in answers] == ["support-42", made, "never-used-9f3"]
    # Two tenants' support-42 are two conversations: alice's goes on from her own history.
    third = chat(url, ALICE, prompt="And again?", conversation_id="support-42").json()
    assert third["usage"]["prompt_tokens"] > follow["usage"]["prompt_tokens"] and third["images"] == 1
    assert third["usage"]["cached_tokens"] >= follow["usage"]["prompt_tokens"] - 1


def test_another_tenants_identical_request_is_as_cold_as_the_first_while_a_repeat_hits(tenant_server):
    url, base = tenant_server[:2]
    body = {"prompt": DOCUMENT, "images": [OTHER_PICTURE], "max_tokens": 4}
    cold = chat(url, ALICE, **body).json()
    deadline = time.monotonic() + 10
    while metric(base, "qwen3vl_kv_disk_pending_writes") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # alice's blocks on disk: a lookup would find them by name
    repeat = chat(url, ALICE, **body).json()
    stranger = chat(url, BOB, **body).json()
    cold_again = chat(url, ALICE, cache_salt="cold-again", **body).json()  # a cold one now, for the timing
    assert cold["usage"]["cached_tokens"] == 0 == cold_again["usage"]["cached_tokens"]
    assert repeat["usage"]["cached_tokens"] >= cold["usage"]["prompt_tokens"] - 1
    assert stranger["usage"]["cached_tokens"] == 0 and stranger["usage"]["cached_from"] is None
    assert stranger["vision_cache_hits"] == 0
    ttft = {name: d["timings"]["time_to_first_token"] for name, d in (("repeat", repeat), ("b", stranger))}
    ttft["cold"] = min(cold["timings"]["time_to_first_token"], cold_again["timings"]["time_to_first_token"])
    assert ttft["b"] >= 0.5 * ttft["cold"] and ttft["repeat"] < 0.5 * ttft["b"], ttft
    assert bits(cold) == bits(repeat) == bits(stranger)  # the caches never change an answer
    # The OpenAI endpoint: bob resending alice's messages finds nothing cached either.
    messages = [{"role": "user", "content": LONG_QUESTION + " (sent to the OpenAI endpoint)"}]
    runs = [openai_client(url, api_key=key) for key in (ALICE, BOB, ALICE)]
    cached = [c.chat.completions.create(model="m", messages=messages, max_tokens=2) for c in runs]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in cached] == [False, False, True]


def test_a_cache_salt_narrows_the_cache_within_a_tenant_on_both_endpoints(tenant_server):
    url = tenant_server[0]
    body = {"prompt": "(salted) " + LONG_QUESTION, "max_tokens": 2}  # no other test's prefix
    salted = [chat(url, ALICE, cache_salt="salt-one", **body).json() for _ in range(2)]
    assert salted[0]["usage"]["cached_tokens"] == 0 and salted[1]["usage"]["cached_tokens"] > 0
    assert chat(url, ALICE, cache_salt="salt-two", **body).json()["usage"]["cached_tokens"] == 0
    assert chat(url, ALICE, **body).json()["usage"]["cached_tokens"] == 0  # no salt: another namespace
    assert chat(url, BOB, cache_salt="salt-one", **body).json()["usage"]["cached_tokens"] == 0  # a salt is per key
    client = openai_client(url, api_key=ALICE)
    messages = [{"role": "user", "content": "(salted, openai) " + LONG_QUESTION}]
    runs = [
        client.chat.completions.create(model="m", messages=messages, max_tokens=2, extra_body={"cache_salt": salt})
        for salt in ("s-1", "s-1", "s-2")
    ]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in runs] == [False, True, False]
    for bad in ("", "x" * 300):
        refused = chat(url, ALICE, cache_salt=bad, **body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"
    form = {"prompt": "hi", "cache_salt": "s-form", "stream": "false", "max_tokens": "1"}
    assert requests.post(url + "/v1/chat", data=form, headers=auth(ALICE)).status_code == 200


def test_a_burst_from_one_tenant_leaves_another_its_share(tenant_server, no_end_of_turn):
    url, base = tenant_server[:2]
    refused_before = metric(base, "qwen3vl_tenant_refused_total", 'tenant="alice",limit="queue"')
    long = {"prompt": "Tell a long story.", "max_tokens": 4000, "logit_bias": no_end_of_turn, "logprobs": False}
    with ThreadPoolExecutor(12) as pool:
        burst = [pool.submit(chat, url, ALICE, **long) for _ in range(10)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (  # all ten in: four places, two queued, four refused
            metric(base, "qwen3vl_tenant_batch_places", 'tenant="alice"') < 4
            or metric(base, "qwen3vl_tenant_queue_depth", 'tenant="alice"') < 2
            or metric(base, "qwen3vl_tenant_refused_total", 'tenant="alice",limit="queue"') - refused_before < 4
        ):
            time.sleep(0.01)
        assert time.monotonic() < deadline, "the burst never filled alice's places and queue"
        started = time.monotonic()
        bobs = [pool.submit(chat, url, BOB, prompt=f"A quick question {i}.", max_tokens=16) for i in range(2)]
        bob_answers = [f.result() for f in bobs]
        bob_seconds = time.monotonic() - started
        alice_answers = [f.result() for f in burst]
    for answer in bob_answers:
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 16
        assert answer.json()["timings"]["queue_wait"] < 1.0
    ok = [a for a in alice_answers if a.status_code == 200]
    refused = [a for a in alice_answers if a.status_code != 200]
    assert len(ok) == 6 and all(a.json()["usage"]["completion_tokens"] == 4000 for a in ok)  # 4 places + 2 queued
    assert len({a.json()["text"] for a in ok}) == 1  # paused or not, the same answer
    for answer in refused:
        assert answer.status_code == 429 and answer.headers["Retry-After"]
        error = answer.json()["error"]
        assert error["code"] == "tenant_queue_full" and "alice" in error["message"] and "queue=2" in error["message"]
    assert sum(a.json()["preempted"] for a in ok) >= 2  # bob took two of her places at once
    slowest_alice = max(a.json()["timings"]["total"] for a in ok)
    assert bob_seconds < 0.5 * slowest_alice
    alone = [
        chat(url, BOB, prompt=f"A quick question {i}.", max_tokens=16, cache_salt="alone").json() for i in range(2)
    ]
    assert [bits(a) for a in alone] == [bits(a.json()) for a in bob_answers]  # exact beside the burst
    assert metric(base, "qwen3vl_tenant_refused_total", 'tenant="alice",limit="queue"') - refused_before == 4


def test_requests_and_tokens_a_minute_are_limited_per_key(tenant_server, no_end_of_turn):
    url, base = tenant_server[:2]
    assert [chat(url, CAROL, prompt="hi", max_tokens=1).status_code for _ in range(2)] == [200, 200]
    third = chat(url, CAROL, prompt="hi", max_tokens=1)
    assert third.status_code == 429 and third.json()["error"]["code"] == "tenant_rpm_exceeded"
    assert "rpm=2" in third.json()["error"]["message"] and 1 <= int(third.headers["Retry-After"]) <= 60
    assert chat(url, DAVE, prompt="hi", max_tokens=40, logit_bias=no_end_of_turn).status_code == 200  # > 40 tokens
    over = openai_client(url, api_key=DAVE)
    with pytest.raises(openai.RateLimitError) as limited:
        over.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert limited.value.body["code"] == "tenant_tpm_exceeded" and "tpm=40" in limited.value.message
    assert chat(url, BOB, prompt="hi", max_tokens=1).status_code == 200  # the others' limits are their own
    assert metric(base, "qwen3vl_tenant_refused_total", 'tenant="carol",limit="rpm"') >= 1
    assert metric(base, "qwen3vl_tenant_requests_total", 'tenant="dave",status="429"') >= 1
    text = requests.get(base + "/metrics", headers=auth(BOB)).text
    assert 'tenant="carol"' in text and not any(key in text for key in SECRETS)


def test_count_tokens_counts_against_the_tenants_requests_a_minute(tenant_server):
    """Anthropic's count_tokens is a request like Messages: at rpm=3 the fourth in a minute is refused
    (all ten were answered before)."""
    url = tenant_server[0]
    body = {"model": "m", "messages": [{"role": "user", "content": "How many tokens is this?"}]}
    answers = [
        requests.post(url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": FRANK}) for _ in range(4)
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert answers[0].json()["input_tokens"] > 0
    refused = answers[3].json()["error"]
    assert refused["type"] == "rate_limit_error" and "rpm=3" in refused["message"]
    assert 1 <= int(answers[3].headers["Retry-After"]) <= 60


def test_uploads_and_batches_count_against_the_tenants_requests_a_minute(tenant_server):
    """An upload is a request: at rpm=3 the fourth request in a minute is refused, naming the limit."""
    client = openai_client(tenant_server[0], api_key=GRACE)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"max_tokens": 1}}
    uploaded = [client.files.create(file=("a.jsonl", json.dumps(line).encode()), purpose="batch") for _ in range(2)]
    client.batches.create(input_file_id=uploaded[0].id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError) as limited:
        client.files.create(file=("a.jsonl", json.dumps(line).encode()), purpose="batch")
    assert limited.value.body["code"] == "tenant_rpm_exceeded" and "rpm=3" in limited.value.message
    assert metric(tenant_server[1], "qwen3vl_tenant_refused_total", 'tenant="grace",limit="rpm"') >= 1


def test_the_keys_file_reloads_on_sighup_under_load_and_loses_no_request(tenant_server, no_end_of_turn):
    url, base, master, keys, _, log = tenant_server
    worker = psutil.Process(master.pid).children()[0].pid
    streams = []

    def stream():
        body = {"prompt": "Count slowly.", "max_tokens": 200, "logit_bias": no_end_of_turn, "stream": True}
        with requests.post(url + "/v1/chat", json=body, headers=auth(ALICE), stream=True, timeout=120) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        streams.append(lines)

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    keys.write_text(KEYS_FILE.replace(f"bob   {BOB}", f"erin {ERIN} rpm=100"))  # bob goes, erin comes
    os.kill(master.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while chat(url, ERIN, prompt="hi", max_tokens=1).status_code != 200:
        assert time.monotonic() < deadline, "the new key was never taken"
        time.sleep(0.1)
    gone = chat(url, BOB, prompt="hi", max_tokens=1)
    assert gone.status_code == 401 and BOB not in gone.text
    keys.write_text("this line is not a key\n")  # a broken file: the keys in force stay
    os.kill(master.pid, signal.SIGHUP)
    time.sleep(0.5)
    assert chat(url, ERIN, prompt="hi", max_tokens=1).status_code == 200
    for thread in threads:
        thread.join(120)
    assert len(streams) == 3 and all(s[-1].get("done") and s[-1]["usage"]["completion_tokens"] == 200 for s in streams)
    assert psutil.Process(master.pid).children()[0].pid == worker  # nothing restarted
    keys.write_text(KEYS_FILE)
    os.kill(master.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while chat(url, BOB, prompt="hi", max_tokens=1).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    text = log.read_text()
    assert "API keys not reloaded" in text and not any(key in text for key in SECRETS)


def test_no_key_tenant_or_salt_is_in_a_block_file_or_the_log(tenant_server):
    """After every test above: the disk tier's names and headers carry only keyed hashes."""
    kv, log = tenant_server[4], tenant_server[5]
    files = list(kv.glob("*/*.kv"))
    assert files
    for path in files:
        data = path.read_bytes()
        (header_bytes,) = struct.unpack_from("<I", data, 8)
        header = path.name.encode() + data[12 : 12 + header_bytes]  # the payload: keys and values, random bytes
        assert not any(word.encode() in header for word in ("alice", "bob", "salt-one", "s-1"))
        assert not any(key.encode() in data for key in SECRETS)
    assert not any(key in log.read_text() for key in SECRETS)


def test_a_stored_response_is_its_tenants_alone(tenant_server):
    """Responses API: another tenant's GET, DELETE and previous_response_id find nothing (the 404 of an
    unknown id), and the x-api-key header names the same tenant as the bearer key."""
    url = tenant_server[0]
    alice, bob = openai_client(url, api_key=ALICE), openai_client(url, api_key=BOB)
    first = alice.responses.create(model="m", input="Remember this picture of mine.", max_output_tokens=4)
    unknown = "resp_" + "0" * 32
    for response_id in (first.id, unknown):
        with pytest.raises(openai.NotFoundError) as got:
            bob.responses.retrieve(response_id)
        assert response_id in got.value.message
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="m", input="And then?", previous_response_id=response_id, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(response_id)
    assert alice.responses.retrieve(first.id).id == first.id  # still hers
    headers = {"x-api-key": ALICE, "anthropic-version": "2023-06-01"}
    mine = requests.get(f"{url}/v1/responses/{first.id}", headers={"x-api-key": ALICE}, timeout=60)
    assert mine.status_code == 200 and mine.json()["id"] == first.id  # the same tenant as her bearer key
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert requests.post(url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    bad = requests.post(url + "/v1/messages", json=body, headers={**headers, "x-api-key": "sk-nobody"}, timeout=60)
    assert bad.status_code == 401 and "sk-nobody" not in bad.text
