"""The native endpoint's chat histories (service/api/native/histories.py): bounded by count, bytes and idle time."""

from __future__ import annotations

import time

import numpy as np

from service.api.native.histories import HistoryStore
from service.media.images import DecodedImage
from service.model.prompts import ChatMessage, ImagePart, TextPart


def with_image(nbytes: int) -> list[ChatMessage]:
    img = DecodedImage(np.zeros((nbytes // 3, 1, 3), np.uint8), "png", (1, 1), "d")
    return [ChatMessage("user", [ImagePart(img), TextPart("q")])]


def test_remembers_and_returns_a_copy():
    store = HistoryStore(10, 60, 10**6)
    store.save("a", with_image(300))
    history = store.history("a")
    history.append(ChatMessage("user", [TextPart("not stored")]))
    assert len(store.history("a")) == 1 and store.history("unknown") == []


def test_oldest_conversations_go_first_beyond_count_or_bytes():
    store = HistoryStore(2, 60, 1000)
    for name in "abc":
        store.save(name, with_image(300))
    assert store.history("a") == [] and store.history("c")
    store.save("big", with_image(900))  # pushes out everything else to stay within 1000 bytes
    assert len(store) == 1 and store.bytes <= 1000
    store.save("huge", with_image(3000))  # larger than the budget: not kept at all
    assert store.history("huge") == [] and store.bytes <= 1000


def test_idle_conversations_expire():
    store = HistoryStore(10, 0.05, 10**6)
    store.save("a", with_image(30))
    time.sleep(0.1)
    assert store.history("a") == [] and store.bytes == 0
