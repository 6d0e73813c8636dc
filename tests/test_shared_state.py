"""The shared store (service/shared/) on a real Redis: records bounded per tenant in count and bytes,
expiring, each tenant's apart, versioned; pictures and clips kept in few bytes that give back the same
bits (a PNG, or the bytes sent where fewer); a store that serves from its own copy while Redis is down,
writes up what it kept meanwhile unless another instance changed the record first, never brings back
what another instance deleted, and refuses a delete it could not make last; turns added at once to one
Conversation all kept, on one instance or two; the affinity ledger counting a miss."""

from __future__ import annotations

import sys
import threading
import time

import cv2
import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY

from service.api.conversations.store import ConversationStore, StoredConversation
from service.api.native.histories import HistoryStore
from service.caches.lru import BudgetedLRU
from service.errors import SharedStateUnavailable
from service.media.images import ImageLimits, decode_image
from service.media.video import DecodedVideo, video_digest
from service.model.prompts import ChatMessage, ImagePart, TextPart, VideoPart, messages_bytes
from service.shared import codec, link
from service.shared.affinity import AffinityLedger, checked_key, new_id
from service.shared.layered import LayeredStore
from service.shared.link import SharedLink, SharedUnavailable
from service.shared.pictures import PictureMismatch, Pictures
from service.shared.records import ABSENT, SharedRecords, VersionConflict

LIMITS = ImageLimits(max_bytes=20 * 2**20, max_decoded_pixels=64_000_000, max_pixels=448 * 448)


@pytest.fixture
def shared(redis_url) -> SharedLink:
    redis.Redis.from_url(redis_url).flushdb()
    return SharedLink(redis_url)


@pytest.fixture
def quick_retry(monkeypatch):
    monkeypatch.setattr(link, "REOPEN_SECONDS", 0.2)


def usable() -> float | None:
    return REGISTRY.get_sample_value("qwen3vl_shared_state_usable")


def photo(width: int = 320, height: int = 240, seed: int = 0) -> np.ndarray:
    """A smooth picture with noise (a PNG of it is larger than a JPEG of it), BGR."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    return np.clip(ramp + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, ext: str) -> bytes:
    return cv2.imencode(ext, pixels)[1].tobytes()


def conversation(image_bytes: bytes) -> list[ChatMessage]:
    image = decode_image(image_bytes, LIMITS)
    answer = ChatMessage("assistant", [TextPart("a cat")], token_ids=(11, 2, 301), reasoning="hmm")
    return [ChatMessage("user", [ImagePart(image), TextPart("what is it?")]), answer]


# -- records: bounded per tenant, expiring ------------------------------------------------------------


def test_records_keep_each_tenant_within_its_count_and_bytes_oldest_out_first(shared):
    records = SharedRecords(shared, "test", max_count=3, max_bytes=1000, ttl=60)
    for name in "abcd":
        assert records.put("alice", name, b"x" * 100)
    assert records.get("alice", "a") is None and records.count("alice") == 3
    assert records.get("bob", "b") is None  # another tenant's: as unknown
    records.get("alice", "b")  # used: now the most recent
    assert records.put("alice", "big", b"y" * 750)  # 750 + 3 × 100 > 1000: the least recently used go
    assert records.get("alice", "c") is None and records.get("alice", "b") == b"x" * 100
    assert records.get("alice", "d") == b"x" * 100  # 3 records, 950 bytes: within both bounds
    assert not records.put("alice", "huge", b"z" * 1001)  # larger than what a tenant may keep
    client = shared.client
    assert (
        int(client.get("qwen3vl:s:test:alice:bytes"))
        == 950
        == sum(int(v) for v in client.hvals("qwen3vl:s:test:alice:sizes"))
    )


def test_a_record_expires_its_ttl_after_its_last_use_and_a_delete_frees_its_bytes(shared):
    records = SharedRecords(shared, "test", max_count=10, max_bytes=10**6, ttl=2)
    records.put("", "a", b"1234")
    time.sleep(1.2)
    assert records.get("", "a") == b"1234"  # read: kept another TTL
    time.sleep(1.2)
    assert records.get("", "a") == b"1234"
    time.sleep(2.2)
    assert records.get("", "a") is None
    records.put("", "b", b"123")
    assert records.delete("", "b") and not records.delete("", "b")
    assert int(shared.client.get("qwen3vl:s:test:-:bytes")) == 0


def test_a_write_based_on_a_version_is_made_only_if_the_store_still_holds_it(shared):
    records = SharedRecords(shared, "test", max_count=10, max_bytes=10**6, ttl=60)
    first = records.put("", "a", b"one", based_on=ABSENT)
    assert first >= 1 and records.read("", "a") == (b"one", first)
    with pytest.raises(VersionConflict):
        records.put("", "a", b"again", based_on=ABSENT)  # it is there now
    second = records.put("", "a", b"two", based_on=first)
    assert second > first
    with pytest.raises(VersionConflict):
        records.put("", "a", b"stale", based_on=first)  # made from what another write replaced
    assert records.read("", "a") == (b"two", second)
    records.delete("", "a")
    with pytest.raises(VersionConflict):
        records.put("", "a", b"back", based_on=second)  # deleted meanwhile: not brought back
    assert records.get("", "a") is None and records.put("", "a", b"new") > second  # versions never repeat


# -- pictures: few bytes, the same bits ---------------------------------------------------------------


def test_a_picture_is_kept_as_the_jpeg_sent_where_smaller_and_decodes_to_the_same_bits():
    jpeg = encoded(photo(), ".jpg")
    messages = conversation(jpeg)
    pictures = Pictures()
    blob = codec.encode({"k": 1}, messages, pictures)
    raw = messages[0].images[0].pixels.nbytes
    assert len(blob) < len(jpeg) + 2000 and len(jpeg) < raw / 4
    record, back = codec.decode(blob, Pictures())  # another process's: nothing remembered
    assert record == {"k": 1}
    assert np.array_equal(back[0].images[0].pixels, messages[0].images[0].pixels)
    assert back[0].images[0].digest == messages[0].images[0].digest
    assert back[1].token_ids == (11, 2, 301) and back[1].reasoning == "hmm" and back[0].text == "what is it?"


def test_a_picture_sent_larger_than_its_pixels_is_kept_as_a_lossless_png():
    bmp = encoded(photo(900, 700), ".bmp")  # uncompressed, and resized into 448²: its pixels are fewer
    messages = conversation(bmp)
    assert messages[0].images[0].sent is None  # not kept beside the pixels it is larger than
    blob = codec.encode({}, messages, Pictures())
    assert len(blob) < messages[0].images[0].pixels.nbytes < len(bmp)
    _, back = codec.decode(blob, Pictures())
    assert np.array_equal(back[0].images[0].pixels, messages[0].images[0].pixels)


def test_a_clip_comes_back_frame_for_frame():
    frames = np.stack([cv2.cvtColor(photo(64, 64, seed), cv2.COLOR_BGR2RGB) for seed in range(4)])
    clip = DecodedVideo(frames, (0, 5, 10, 15), 10.0, "mp4", (64, 64), 20, 0.1, video_digest(frames))
    messages = [ChatMessage("user", [VideoPart(clip), TextPart("what happens?")])]
    _, back = codec.decode(codec.encode({}, messages, Pictures()), Pictures())
    assert np.array_equal(back[0].videos[0].frames, frames) and back[0].videos[0].frame_indices == (0, 5, 10, 15)


def test_a_stored_picture_of_other_pixels_is_refused_not_served():
    blob = bytearray(codec.encode({}, conversation(encoded(photo(), ".png")), Pictures()))
    blob[-60] ^= 0xFF  # a bit flipped inside the picture's bytes (a PNG's CRC or its pixels)
    with pytest.raises((PictureMismatch, ValueError)):
        codec.decode(bytes(blob), Pictures())
    with pytest.raises(codec.RecordCorrupt):
        codec.decode(b"something else", Pictures())


# -- a store of many instances, while Redis comes and goes -----------------------------------------------


def instance(shared: SharedLink | None) -> HistoryStore:
    return HistoryStore(100, 60, 10**8, shared)


def test_another_instance_continues_a_conversation_with_the_same_bits(shared):
    messages = conversation(encoded(photo(), ".jpg"))
    instance(shared).save("conv-1", messages, owner="alice")
    elsewhere = instance(shared).history("conv-1", owner="alice")
    assert np.array_equal(elsewhere[0].images[0].pixels, messages[0].images[0].pixels)
    assert elsewhere[1].token_ids == messages[1].token_ids
    assert instance(shared).history("conv-1", owner="bob") == []


def test_while_redis_is_down_each_instance_serves_its_own_and_writes_it_up_when_it_is_back(tmp_path, quick_retry):
    from servers import free_port, redis_server

    folder, port = tmp_path / "redis-data", free_port()
    folder.mkdir()
    messages = [ChatMessage("user", [TextPart("hello")])]
    with redis_server(tmp_path / "redis.log", folder, port) as url:
        here, there = instance(SharedLink(url)), instance(SharedLink(url))
        here.save("before", messages)
        assert there.history("before") == messages and usable() == 1
    # Redis is down: what each instance holds serves it; the other's is not there; deletes would not last.
    assert here.history("before") == messages and usable() == 0
    here.save("during", messages)
    assert here.history("during") == messages
    with pytest.raises(SharedStateUnavailable):
        here.entries.delete("", "before")
    with redis_server(tmp_path / "redis.log", folder, port):
        time.sleep(0.3)
        assert there.history("before") == messages  # appendonly: the restart kept it
        assert there.history("during") == []  # not written up yet: only `here` held it, and it has not
        assert here.history("before") == messages and usable() == 1  # seen Redis back until now: ...
        deadline = time.monotonic() + 5
        while there.history("during") != messages:  # ... what it kept alone goes up at once
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert there.entries.delete("", "during")  # deleted by the other instance ...
        assert here.history("during") == []  # ... is not brought back by this one's copy


def conversations(shared: SharedLink | None) -> ConversationStore:
    return ConversationStore(100, 60, 10**8, shared)


def add_turn(store: ConversationStore, conversation_id: str, text: str) -> None:
    """A response's turn as /v1/responses adds it: its input item and message, and the answer's."""
    said = {"id": f"msg_{text}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    answer = ChatMessage("assistant", [TextPart(f"re: {text}")], token_ids=(7, 8))
    store.add_turn(conversation_id, "", [said], [], [ChatMessage("user", [TextPart(text)]), answer])


def said(store: ConversationStore, conversation_id: str) -> list[str]:
    return [m.text for m in store.get(conversation_id).messages if m.role == "user" and not m.images]


def new_conversation(store: ConversationStore, conversation_id: str) -> None:
    """A conversation whose first message holds a picture (its record takes a while to encode)."""
    store.save(StoredConversation(conversation_id, 0, "", messages=conversation(encoded(photo(), ".png"))))


@pytest.mark.parametrize("with_redis", [True, False], ids=["two instances, one Redis", "one instance, no Redis"])
def test_turns_added_at_once_to_one_conversation_are_all_kept(redis_url, with_redis):
    """Eight threads add six turns each to one Conversation at once — on two instances sharing a Redis, or
    on one alone — and every turn is kept, each thread's in its order: none is written over by another
    made from the same earlier state."""
    if with_redis:
        redis.Redis.from_url(redis_url).flushdb()
    stores = [conversations(SharedLink(redis_url)) for _ in range(2)] if with_redis else [conversations(None)]
    new_conversation(stores[0], "conv_busy")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads interleave often: a lost turn shows in a short test
    start = threading.Barrier(8)

    def turns(n: int) -> None:
        store = stores[n % len(stores)]
        start.wait()
        for k in range(6):
            add_turn(store, "conv_busy", f"t{n}-{k}")

    try:
        threads = [threading.Thread(target=turns, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    for store in stores:
        kept = said(store, "conv_busy")
        assert sorted(kept) == sorted(f"t{n}-{k}" for n in range(8) for k in range(6)), len(kept)
        for n in range(8):
            assert [t for t in kept if t.startswith(f"t{n}-")] == [f"t{n}-{k}" for k in range(6)]
        items = [item["id"] for item in store.get("conv_busy").items]
        assert len(items) == len(set(items)) == 48


def conflicts() -> float:
    return REGISTRY.get_sample_value("qwen3vl_shared_state_conflicts_total", {"kind": "conversations"}) or 0.0


def test_a_turn_kept_while_cut_off_from_redis_never_overwrites_one_added_elsewhere(redis_url, quick_retry):
    """Instance `here` loses its Redis (a relay cut) while `there` keeps it. A turn `here` adds meanwhile is
    made from the version it last saw; once `here` is back it goes up only if Redis still holds that version.
    `there` added a turn meanwhile: Redis's conversation is kept, `here`'s turn dropped and counted. With no
    turn elsewhere, what `here` kept alone goes up."""
    from servers import TcpRelay

    relay = TcpRelay(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    try:
        here = conversations(SharedLink(f"redis://127.0.0.1:{relay.port}/0"))
        there = conversations(SharedLink(redis_url))
        here.save(StoredConversation("conv_cut", 0, ""))
        add_turn(here, "conv_cut", "first")
        assert said(there, "conv_cut") == ["first"]
        relay.cut()
        add_turn(here, "conv_cut", "kept-here-alone")
        assert said(here, "conv_cut") == ["first", "kept-here-alone"] and usable() == 0
        add_turn(there, "conv_cut", "from-there")
        before = conflicts()
        relay.mend()
        time.sleep(0.3)  # past the link's pause: `here` tries Redis again
        assert said(here, "conv_cut") == ["first", "from-there"]  # Redis's word: its turn is not lost
        assert said(there, "conv_cut") == ["first", "from-there"] and conflicts() == before + 1
        relay.cut()
        add_turn(here, "conv_cut", "second-here")
        relay.mend()
        time.sleep(0.3)
        assert here.entries.shared.link.problem() is None  # what /ready asks: Redis is back, write up
        deadline = time.monotonic() + 5
        while said(there, "conv_cut") != ["first", "from-there", "second-here"]:  # written up: nothing newer
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert said(here, "conv_cut") == ["first", "from-there", "second-here"] and conflicts() == before + 1
    finally:
        relay.cut()


def test_a_link_to_no_redis_fails_fast_and_says_why(quick_retry):
    from servers import free_port

    unreachable = SharedLink(f"redis://:secret@127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(SharedUnavailable):
        unreachable.run(lambda r: r.ping())
    with pytest.raises(SharedUnavailable):  # set aside: not tried again at once
        unreachable.run(lambda r: r.ping())
    assert time.monotonic() - started < 1.5
    assert unreachable.problem() == "Redis is unreachable" and "secret" not in unreachable.where


def test_a_local_store_without_redis_is_todays_store():
    store = LayeredStore(BudgetedLRU("test", 10**6, 10, 60), None, None, None, messages_bytes)
    store.put("", "a", [ChatMessage("user", [TextPart("x")])])
    assert store.get("", "a")[0].text == "x" and store.delete("", "a") and store.get("", "a") is None


# -- affinity ------------------------------------------------------------------------------------------


def test_ids_begin_with_their_affinity_key_and_a_miss_is_counted_where_the_key_last_ran_elsewhere(shared):
    key = "0123456789abcdef"
    assert new_id("resp_", key, 16).startswith("resp_" + key) and len(new_id("resp_", key, 16)) == 37
    assert checked_key(key) == key and checked_key("../etc") is None and checked_key(None) is None

    def misses() -> float:
        return REGISTRY.get_sample_value("qwen3vl_affinity_misses_total", {"api": "chat"}) or 0.0

    first, second = AffinityLedger(shared, "m1", 60), AffinityLedger(shared, "m2", 60)
    before = misses()
    first.note(key, "chat")
    first.note(key, "chat")
    assert misses() == before
    second.note(key, "chat")
    assert misses() == before + 1
