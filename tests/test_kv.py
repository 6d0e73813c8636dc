"""GrowingCache: the same keys and values as transformers' DynamicCache, without copying the whole
cache at every decode step."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from service.caches.conversation import kv_bytes
from service.model.kv import HEADROOM, MAX_HEADROOM, GrowingCache, GrowingLayer, compacted, headroom


def _append_both(growing, plain, layers, tokens):
    k, v = torch.randn(2, 2, tokens, 8), torch.randn(2, 2, tokens, 8)
    for i in range(layers):
        a, b = growing.update(k + i, v - i, i), plain.update(k + i, v - i, i)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def recorded_grows(monkeypatch) -> list[int]:
    """The capacities GrowingLayer grows a buffer to from now on (each growth a copy), in order."""
    grows = []
    real_grow = GrowingLayer._grow
    monkeypatch.setattr(
        GrowingLayer,
        "_grow",
        lambda layer, capacity, like: (grows.append(capacity), real_grow(layer, capacity, like)),
    )
    return grows


def test_appends_and_crops_give_exactly_what_dynamic_cache_gives(fp32_engine):
    config = fp32_engine.model.config
    layers = config.text_config.num_hidden_layers
    growing, plain = GrowingCache(config=config), DynamicCache(config=config)
    for tokens in [40, 64, 64, *[1] * 150, 7]:  # a prompt in pieces, then decode steps
        _append_both(growing, plain, layers, tokens)
    for cache in (growing, plain):
        cache.crop(-30)
    for tokens in [1] * 5 + [64]:  # reuse after a crop writes over the cropped positions
        _append_both(growing, plain, layers, tokens)
    assert growing.get_seq_length() == plain.get_seq_length() == 40 + 128 + 150 + 7 - 30 + 5 + 64


def test_decode_steps_write_into_spare_room_instead_of_copying_the_cache(fp32_engine, monkeypatch):
    config = fp32_engine.model.config
    cache = GrowingCache(
        ddp_cache_data=[(torch.randn(1, 2, 500, 8), torch.randn(1, 2, 500, 8))] * config.text_config.num_hidden_layers,
        config=config,
    )
    grows = recorded_grows(monkeypatch)
    for _ in range(3 * HEADROOM):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    # One copy per HEADROOM steps (DynamicCache copies 500+ tokens at each one).
    assert grows == [500 + 1 + HEADROOM, 500 + HEADROOM + 2 + HEADROOM, 500 + 2 * HEADROOM + 3 + HEADROOM]
    assert cache.get_seq_length() == 500 + 3 * HEADROOM


def test_a_long_context_grows_by_a_sixteenth_of_itself_so_it_copies_less_often(fp32_engine, monkeypatch):
    """Each growth copies the whole cache: at 4,096 tokens it leaves 256 spare positions, not 128."""
    config = fp32_engine.model.config
    layers = config.text_config.num_hidden_layers
    long = (torch.randn(1, 2, 4096, 8), torch.randn(1, 2, 4096, 8))
    cache = GrowingCache(ddp_cache_data=[long] * layers, config=config)
    grows = recorded_grows(monkeypatch)
    for _ in range(531):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    assert grows == [4097 + 256, 4354 + 272, 4627 + 289]
    assert cache.get_seq_length() == 4096 + 531
    assert headroom(2047) == HEADROOM and headroom(100_000) == MAX_HEADROOM == 512  # spare room: 1/16 at most


def test_a_reserved_prompt_fills_one_buffer_in_pieces(fp32_engine, monkeypatch):
    """A prefill reserves its prompt's length: its pieces write into one buffer, no copy per piece."""
    config = fp32_engine.model.config
    layers = config.text_config.num_hidden_layers
    growing, plain = GrowingCache(config=config), DynamicCache(config=config)
    growing.reserve(1000 + HEADROOM)
    grows = recorded_grows(monkeypatch)
    for tokens in [128] * 7 + [104] + [1] * HEADROOM:  # 1,000 prompt tokens, then decode steps
        _append_both(growing, plain, layers, tokens)
    assert grows == [1000 + HEADROOM] * layers
    assert growing.get_seq_length() == plain.get_seq_length() == 1000 + HEADROOM


def test_a_kept_cache_is_compacted_to_its_tokens(fp32_engine):
    config = fp32_engine.model.config
    cache = GrowingCache(
        ddp_cache_data=[(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8))] * config.text_config.num_hidden_layers,
        config=config,
    )
    for layer in range(config.text_config.num_hidden_layers):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), layer)
    exact = 2 * config.text_config.num_hidden_layers * 2 * 11 * 8 * 4
    assert kv_bytes(cache) > exact  # the spare room is real memory, and counted
    assert kv_bytes(compacted(cache)) == exact
