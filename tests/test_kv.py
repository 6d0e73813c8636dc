"""GrowingCache: the same keys and values as transformers' DynamicCache, without copying the whole
cache at every decode step."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from conftest import make_settings
from service.caches import kv_bytes
from service.kv import HEADROOM, GrowingCache, compacted
from service.loading import load_model


def _config(cache_dir):
    return load_model(make_settings(cache_dir, quantization="fp32")).model.config


def _append_both(growing, plain, layers, tokens):
    k, v = torch.randn(2, 2, tokens, 8), torch.randn(2, 2, tokens, 8)
    for i in range(layers):
        a, b = growing.update(k + i, v - i, i), plain.update(k + i, v - i, i)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_appends_and_crops_give_exactly_what_dynamic_cache_gives(cache_dir, tiny_dir):
    config = _config(cache_dir)
    layers = config.text_config.num_hidden_layers
    growing, plain = GrowingCache(config=config), DynamicCache(config=config)
    for tokens in [40, 64, 64, *[1] * 150, 7]:  # a prompt in pieces, then decode steps
        _append_both(growing, plain, layers, tokens)
    for cache in (growing, plain):
        cache.crop(-30)
    for tokens in [1] * 5 + [64]:  # reuse after a crop writes over the cropped positions
        _append_both(growing, plain, layers, tokens)
    assert growing.get_seq_length() == plain.get_seq_length() == 40 + 128 + 150 + 7 - 30 + 5 + 64


def test_decode_steps_write_into_spare_room_instead_of_copying_the_cache(cache_dir, tiny_dir):
    config = _config(cache_dir)
    cache = GrowingCache(ddp_cache_data=[(torch.randn(1, 2, 500, 8), torch.randn(1, 2, 500, 8))]
                         * config.text_config.num_hidden_layers, config=config)
    buffers = set()
    for _ in range(3 * HEADROOM):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
        buffers.add(cache.layers[0]._keys_buffer.data_ptr())
    assert len(buffers) <= 3  # one copy per HEADROOM steps; DynamicCache copies 500+ tokens at each one
    assert cache.get_seq_length() == 500 + 3 * HEADROOM


def test_a_kept_cache_is_compacted_to_its_tokens(cache_dir, tiny_dir):
    config = _config(cache_dir)
    cache = GrowingCache(ddp_cache_data=[(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8))]
                         * config.text_config.num_hidden_layers, config=config)
    for layer in range(config.text_config.num_hidden_layers):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), layer)
    exact = 2 * config.text_config.num_hidden_layers * 2 * 11 * 8 * 4
    assert kv_bytes(cache) > exact  # the spare room is real memory, and counted
    assert kv_bytes(compacted(cache)) == exact
