"""The conversation cache's disk tier (service/caches/kv_disk/) on the real tiny model, fp32, INT8
and 4-bit: a turn whose cache memory lost (evicted, restarted, another instance) continues from
disk with the very bits a turn from memory and a full recompute get; damaged and foreign files are
removed unused; the budget holds. Then through real Gunicorn instances: restarts (graceful and
SIGKILL) and two instances sharing one store.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import signal
import struct
import threading
import time
import weakref

import pytest
import requests
import torch
from prometheus_client import REGISTRY
from test_caches import ANSWER_TOKENS, assistant, image, image_end, turn, user

from service.caches.kv_disk import BLOCK_TOKENS, MAGIC, KVDiskStore, held_bytes
from service.engine.engine import Engine, GenerationRequest, SamplingParams
from service.engine.prefill import covered_positions

from conftest import prepared, weights_settings
from servers import metric, openai_client


def tiered(engine, cache_dir, folder, **settings) -> Engine:
    """An engine on `engine`'s loaded model with its disk tier in `folder` (a new one: as after a restart)."""
    settings = weights_settings(cache_dir, engine.loaded.quantization, kv_disk_dir=folder, **settings)
    return Engine(engine.loaded, settings)


QUESTION = "What is in this picture? Describe each part of it, its colours and its shapes, in detail. " * 2


def first_turn(e: Engine, seed=0):
    """A one-picture conversation's first turn, written to disk: (its history, the second turn's messages)."""
    history = [user(image(e, seed=seed), QUESTION)]
    _, done = turn(e, history, "A")
    assert e.caches.kv.disk.flush(30)
    return history, history + [assistant(done.text), user("Tell me more.")]


def test_a_turn_from_disk_has_the_bits_of_a_turn_from_memory_and_of_a_recompute(engine, cache_dir, tmp_path):
    first = tiered(engine, cache_dir, tmp_path / "kv")
    history, follow = first_turn(first)
    shutil.copytree(tmp_path / "kv", tmp_path / "copy")  # the store as a restart finds it
    memory_ids, from_memory = turn(first, follow, "A")
    disk_ids, from_disk = turn(tiered(engine, cache_dir, tmp_path / "copy"), follow, "A")
    plain_ids, plain = turn(tiered(engine, cache_dir, tmp_path / "off", cache_enabled=False), follow)
    assert (from_memory.cached_from, from_disk.cached_from, plain.cached_from) == ("memory", "disk", None)
    assert any(t.name.startswith("kv-disk-read") for t in threading.enumerate())  # read off the scheduler's thread
    assert from_disk.cached_tokens == from_memory.cached_tokens > image_end(first, history)
    assert disk_ids == memory_ids == plain_ids
    # Every token's log-probability and alternatives as floats: the same keys and values, the same rows after them.
    assert from_disk.logprobs == from_memory.logprobs
    if engine.loaded.quantization in ("int8", "int4"):
        assert from_disk.logprobs == plain.logprobs  # and a recompute's bits (fp32 GEMMs round by row count)


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
def test_a_prefill_waiting_for_its_disk_read_holds_up_no_newcomer(engine, cache_dir, tmp_path, monkeypatch):
    """A turn whose prefix is read from disk is parked while the read lasts — here held until a
    newcomer sent after it has answered — and then continues with the bits of a turn from memory."""
    first = tiered(engine, cache_dir, tmp_path / "kv")
    _, follow = first_turn(first)
    shutil.copytree(tmp_path / "kv", tmp_path / "copy")  # the store as a restart finds it
    _, from_memory = turn(first, follow, "A")
    restarted = tiered(engine, cache_dir, tmp_path / "copy", kv_disk_read_timeout_share=1e6)  # no deadline here
    release, real_read = threading.Event(), KVDiskStore.read

    def held_read(*args, **kwargs):  # a slow device: the read waits for the test's word
        release.wait(60)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(KVDiskStore, "read", held_read)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, logprobs=3)
    parked = restarted.submit(GenerationRequest(follow, params, conversation_id="A"))
    deadline = time.monotonic() + 30
    while parked.status != "reading":
        assert time.monotonic() < deadline and parked.status in ("waiting", "prefilling")
        time.sleep(0.005)
    _, newcomer = turn(restarted, [user("Something else entirely.")], max_tokens=4)
    assert newcomer.completion_tokens > 0 and parked.status == "reading"
    release.set()
    *_, done = parked
    parked.close()
    assert done.cached_from == "disk" and done.cached_tokens == from_memory.cached_tokens
    assert done.token_ids == from_memory.token_ids and done.logprobs == from_memory.logprobs


def test_keys_and_values_read_from_disk_are_the_bits_kept_in_memory(engine, cache_dir, tmp_path):
    e = tiered(engine, cache_dir, tmp_path)
    history, _ = first_turn(e)
    entry = e.caches.kv.memory.entries.peek("id:A")
    length = len(entry.token_ids)
    assert length > 2 * BLOCK_TOKENS  # full blocks and a tail
    positions = covered_positions(e.model, prepared(e, _request(history)), length)
    reuse = e.caches.kv.disk.read(entry.token_ids, positions, entry.images, length, capacity=length)
    assert reuse.tokens == length and reuse.source == "disk"
    for read, kept in zip(reuse.cache.layers, entry.cache.layers, strict=True):
        assert torch.equal(read.keys, kept.keys) and torch.equal(read.values, kept.values)
    # A prompt that differs inside a block (a re-tokenized answer) gets the block's matching part.
    changed = entry.token_ids.clone()
    changed[BLOCK_TOKENS + 10] = (changed[BLOCK_TOKENS + 10] + 1) % 100
    reuse = e.caches.kv.disk.read(changed, positions, entry.images, length, capacity=length)
    assert reuse.tokens == BLOCK_TOKENS + 10
    for read, kept in zip(reuse.cache.layers, entry.cache.layers, strict=True):
        assert torch.equal(read.keys, kept.keys[:, :, : reuse.tokens])


def test_the_writer_lets_go_of_what_it_wrote(engine, cache_dir, tmp_path):
    e = tiered(engine, cache_dir, tmp_path)
    _, follow = first_turn(e)
    first_keys = weakref.ref(e.caches.kv.memory.entries.peek("id:A").cache.layers[0].keys)
    _, done = turn(e, follow, "A")  # the same cache taken over, extended, kept and written again
    assert done.cached_from == "memory" and e.caches.kv.disk.flush(30)
    gc.collect()
    assert first_keys() is None  # the first turn's tensors: neither queued nor held once written
    assert e.caches.kv.memory.entries.peek("id:A") is not None


def test_another_picture_behind_the_same_tokens_is_not_taken_from_disk(engine, cache_dir, tmp_path):
    e = tiered(engine, cache_dir, tmp_path)
    history, _ = first_turn(e)
    other = [user(image(e, seed=7), QUESTION)]  # the same tokens, other pixels
    restarted = tiered(engine, cache_dir, tmp_path)
    _, done = turn(restarted, other, "B")
    assert done.cached_tokens <= prepared(e, _request(other)).image_spans[0][0]


def _request(messages):
    return GenerationRequest(messages)


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("qwen3vl_kv_disk_rejected_files_total", {"reason": reason}) or 0.0


def first_block(folder):
    """The file holding a conversation's first tokens, and its header."""
    for path in folder.glob("*/*.kv"):
        data = path.read_bytes()
        (size,) = struct.unpack("<I", data[8:12])
        header = json.loads(data[12 : 12 + size])
        if header["start"] == 0:
            return path, header, size
    raise AssertionError("no first block")


def rewrite_header(path, size, **changes):
    data = path.read_bytes()
    header = json.loads(data[12 : 12 + size])
    header.update(changes)
    new = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(new)) + new + data[12 + size :])


DAMAGES = {
    "truncated": ("truncated", lambda path, size: path.write_bytes(path.read_bytes()[:-100])),
    "flipped byte": ("corrupt", lambda path, size: path.write_bytes(_flip(path.read_bytes(), -50))),
    "another checkpoint": ("foreign", lambda path, size: rewrite_header(path, size, fingerprint="0" * 32)),
    "another KV layout": (
        "foreign",
        lambda path, size: rewrite_header(
            path, size, layout={**json.loads(path.read_bytes()[12 : 12 + size])["layout"], "dtype": "torch.float32"}
        ),
    ),
    "another block's tokens": ("corrupt", lambda path, size: rewrite_header(path, size, start=0, tokens=[1] * 64)),
}


def _flip(data: bytes, at: int) -> bytes:
    data = bytearray(data)
    data[at] ^= 0x10
    return bytes(data)


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_or_foreign_file_is_removed_and_never_used(engine, cache_dir, tmp_path, damage):
    e = tiered(engine, cache_dir, tmp_path)
    _, follow = first_turn(e)
    path, _, size = first_block(tmp_path)
    reason, harm = DAMAGES[damage]
    harm(path, size)
    damaged = path.read_bytes() if path.exists() else None
    before = rejected(reason)
    restarted = tiered(engine, cache_dir, tmp_path)
    ids, done = turn(restarted, follow, "A")
    assert done.cached_tokens == 0 and done.cached_from is None  # its first block is the way in
    assert rejected(reason) == before + 1
    # Removed; the recomputed turn then writes its own block under that name (behind: flushed here).
    assert restarted.caches.kv.disk.flush(30)
    assert not path.exists() or path.read_bytes() != damaged
    plain_ids, plain = turn(tiered(engine, cache_dir, tmp_path / "off", cache_enabled=False), follow)
    assert ids == plain_ids and done.logprobs == plain.logprobs


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
def test_a_store_of_other_weights_or_another_kv_layout_shares_nothing(engine, cache_dir, fp32_engine, tmp_path):
    _, follow = first_turn(tiered(engine, cache_dir, tmp_path))
    for other in (tiered(fp32_engine, cache_dir, tmp_path), tiered(engine, cache_dir, tmp_path, kv_dtype="float32")):
        _, done = turn(other, follow, "A")
        assert done.cached_tokens == 0
    _, done = turn(tiered(engine, cache_dir, tmp_path), follow, "A")
    assert done.cached_from == "disk"  # the same weights and layout: found


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
def test_the_disk_budget_holds_and_the_least_recently_used_go_first(engine, cache_dir, tmp_path):
    e = tiered(engine, cache_dir, tmp_path, kv_disk_mb=1, conversation_cache_max_entries=1)
    conversations = []
    for seed in range(40):
        history = [user(image(e, seed=seed), f"Picture {seed}: what is in it?")]
        turn(e, history, f"c{seed}", max_tokens=2)
        conversations.append(history)
        assert e.caches.kv.disk.flush(30)
        assert held_bytes(tmp_path) <= 1024**2
    restarted = tiered(engine, cache_dir, tmp_path, kv_disk_mb=1)
    assert turn(restarted, conversations[-1] + [user("More.")], max_tokens=2)[1].cached_from == "disk"
    assert turn(restarted, conversations[0] + [user("More.")], max_tokens=2)[1].cached_from is None


# -- through Gunicorn -----------------------------------------------------------------------------


def pending_writes_done(base: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metric(base, "qwen3vl_kv_disk_pending_writes") > 0:
        assert time.monotonic() < deadline, "writes still pending"
        time.sleep(0.1)


def native_turn(base: str, messages: list[dict]) -> tuple[str, dict]:
    """A stateless native request (the whole history sent): (answer, the done line)."""
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    lines = [json.loads(line) for line in requests.post(base + "/v1/chat", json=body, timeout=60).iter_lines() if line]
    done = lines[-1]
    assert done["done"], done
    return done["text"], done


def picture_question() -> list[dict]:
    from imaging import data_url, encode, pattern

    png = encode(pattern(320, 256, seed=3), ".png")
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": "What?"}],
        }
    ]


def test_a_conversation_outlives_its_instance_shutdown_and_sigkill_on_a_shared_store(serve, tmp_path):
    """Two instances on one store; the first ends (SIGTERM) right after turn 1, the second continues the
    stateless conversation from disk (official client), is SIGKILLed once written, and a third answers
    turn 3 from what the killed one wrote."""
    env = {"KV_DISK_DIR": str(tmp_path)}
    messages = picture_question()
    with serve(env, "kv-shared-a") as (a, first), serve(env, "kv-shared-b") as (b, second):
        answer, done = native_turn(a, messages)
        assert done["usage"]["cached_from"] is None
        first.send_signal(signal.SIGTERM)  # at once: what is queued is written on the way out
        first.wait(60)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me more."}]
        reply = openai_client(b).chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        assert reply.usage.prompt_tokens_details.cached_tokens > done["usage"]["prompt_tokens"] - 8
        assert metric(b, "qwen3vl_cache_hits_total", 'cache="kv_disk"') == 1  # B never saw turn 1: from disk
        assert metric(b, "qwen3vl_kv_disk_read_bytes_total") > 0
        assert metric(b, "qwen3vl_kv_disk_load_seconds_count") == 1
        pending_writes_done(b)
        assert metric(b, "qwen3vl_kv_disk_written_bytes_total") > 0
        second_prompt = reply.usage.prompt_tokens
        workers = _children(second.pid)
        second.send_signal(signal.SIGKILL)
        for worker in workers:
            worker.kill()
        second.wait(60)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    with serve(env, "kv-shared-c") as (c, _):
        _, done = native_turn(c, messages)
        assert done["usage"]["cached_from"] == "disk"
        assert done["usage"]["cached_tokens"] >= second_prompt  # written by the instance killed since


def _children(pid: int):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# -- hostile conditions (through Gunicorn: tests/test_kv_disk_hostile.py) --------------------------


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
def test_a_read_stuck_on_the_device_is_given_up_and_holds_up_no_other_lookup(engine, cache_dir, tmp_path, monkeypatch):
    """A device that never answers one read (a hung mount): past its deadline the turn recomputes, with
    a recompute's bits, and a lookup after it reads from disk on another reader meanwhile."""
    first = tiered(engine, cache_dir, tmp_path)
    _, stuck_follow = first_turn(first)
    _, other_follow = first_turn(first, seed=5)
    restarted = tiered(engine, cache_dir, tmp_path)
    hung, real_read = threading.Event(), KVDiskStore.read
    reads = []

    def first_read_hangs(*args, **kwargs):
        reads.append(args)
        if len(reads) == 1:
            hung.wait(30)  # the device answers when the test ends
        return real_read(*args, **kwargs)

    monkeypatch.setattr(KVDiskStore, "read", first_read_hangs)
    timeouts = REGISTRY.get_sample_value("qwen3vl_kv_disk_read_timeouts_total") or 0.0
    try:
        started = time.monotonic()
        ids, done = turn(restarted, stuck_follow, "A")
        took = time.monotonic() - started
        _, other = turn(restarted, other_follow, "B")
    finally:
        hung.set()
    assert done.cached_from is None and took < 10
    assert other.cached_from == "disk"  # not queued behind the stuck read
    assert REGISTRY.get_sample_value("qwen3vl_kv_disk_read_timeouts_total") == timeouts + 1
    plain_ids, plain = turn(tiered(engine, cache_dir, tmp_path / "off", cache_enabled=False), stuck_follow)
    assert ids == plain_ids and done.logprobs == plain.logprobs


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
def test_a_folder_that_becomes_unusable_while_serving_turns_the_tier_off(engine, cache_dir, tmp_path, caplog):
    folder = tmp_path / "kv"
    e = tiered(engine, cache_dir, folder)
    _, follow = first_turn(e)
    shutil.rmtree(folder)
    folder.write_text("not a folder any more")
    newcomer = [user("Another conversation entirely, asked after the folder went.")]
    with caplog.at_level(logging.WARNING, logger="service.caches.kv_disk"):
        ids, done = turn(e, follow, "A")  # from memory; writing it meets the file
        assert e.caches.kv.disk.flush(30)
        other_ids, other = turn(e, newcomer, "B")
        assert e.caches.kv.disk.flush(30)
    assert not e.caches.kv.disk.usable and REGISTRY.get_sample_value("qwen3vl_kv_disk_usable") == 0
    (off,) = [r.getMessage() for r in caplog.records if "KV disk tier off" in r.getMessage()]  # one warning
    assert off.startswith(f"KV disk tier off: {folder} is unusable (writing a block: Not a directory)")
    assert done.cached_from == "memory" and folder.read_text() == "not a folder any more"
    plain = tiered(engine, cache_dir, tmp_path / "off", cache_enabled=False)
    for (got_ids, got), messages in (((ids, done), follow), ((other_ids, other), newcomer)):
        plain_ids, expected = turn(plain, messages)
        assert got_ids == plain_ids and got.logprobs == expected.logprobs


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
def test_what_is_no_block_under_a_blocks_name_is_swept_and_everything_else_left(engine, cache_dir, tmp_path):
    """The rule of docs/caches.md: under a block's name, a FIFO, a link (not what it points to) and an
    empty directory are removed; a directory holding files, and whatever is not named like a block,
    are left. A FIFO is never opened for reading (it would block)."""
    folder = tmp_path / "ab"
    folder.mkdir()
    name = lambda digit: f"ab{digit * 30}-{digit * 32}.kv"
    fifo, link, empty, holding = (folder / name(d) for d in "1234")
    os.mkfifo(fifo)
    (tmp_path / "precious.kv").write_text("precious")
    link.symlink_to(tmp_path / "precious.kv")
    empty.mkdir()
    holding.mkdir()
    (holding / "keep").write_text("kept")
    (folder / "notes.txt").write_text("mine")
    first_turn(tiered(engine, cache_dir, tmp_path))  # the writer scans the folder when it starts
    assert not fifo.exists() and not link.is_symlink() and not empty.exists()
    assert (holding / "keep").read_text() == "kept" and (folder / "notes.txt").read_text() == "mine"
    assert (tmp_path / "precious.kv").read_text() == "precious"
    from service.caches.kv_disk.block_files import NotABlock, open_block

    os.mkfifo(fifo)
    link.symlink_to(tmp_path / "precious.kv")
    for entry in (fifo, link, holding):
        with pytest.raises(NotABlock):  # at once: a FIFO's open does not wait for a writer
            open_block(entry)


@pytest.mark.parametrize("engine", ["int8"], indirect=True)
def test_a_stray_file_where_a_subfolder_goes_leaves_the_tier_on(engine, cache_dir, tmp_path, caplog):
    """Every block's subfolder name taken by a file: its writes fail and are logged, but the folder itself
    is usable, so the tier stays on (and answers come from memory, the same bits)."""
    folder = tmp_path / "kv"
    e = tiered(engine, cache_dir, folder)
    for prefix in range(256):
        (folder / f"{prefix:02x}").write_text("someone else's file")
    history = [user(image(e, seed=7), QUESTION)]
    with caplog.at_level(logging.WARNING, logger="service.caches.kv_disk"):
        ids, done = turn(e, history, "A")
        assert e.caches.kv.disk.flush(30)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("KV disk tier: writing a block: ") for m in messages)
    assert not any("KV disk tier off" in m for m in messages)
    assert e.caches.kv.disk.usable and REGISTRY.get_sample_value("qwen3vl_kv_disk_usable") == 1
    plain_ids, expected = turn(tiered(engine, cache_dir, tmp_path / "off", cache_enabled=False), history)
    assert ids == plain_ids and done.logprobs == expected.logprobs
