"""KV-cache storage that grows in place.

transformers' `DynamicLayer` appends with `torch.cat`, which copies the whole cache at every
decode step: at 3,000 tokens of context that is 0.64 GiB read and written per token on the 2B
model (224 KiB of fp32 keys and values per token). `GrowingLayer` keeps `HEADROOM` spare
positions behind the cached ones (more for a long context: `headroom`) and writes new keys and
values there; only when the room is used up does it copy, once per `HEADROOM` steps or more. What
attention sees — `keys`/`values`, views of the first positions — is the same tensors' values as
before, so answers do not change.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..native import huge_pages

# Spare positions kept when a layer has to grow (per layer: 2 × heads × head_dim × 2 bytes each in
# bf16, 4 KiB on Qwen3-VL-2B, so 128 cost 14 MiB per sequence over its 28 layers) — or, past 2,048
# tokens, a sixteenth of the context, up to MAX_HEADROOM: a growth copies the whole cache into new
# memory (at 8,000 tokens of Qwen3.5-2B, 100 MB allocated, faulted in and copied), so a long context
# copies every 512 tokens instead of every 128, its spare room never over 1/16 of it.
HEADROOM = 128
MAX_HEADROOM = 512


def headroom(length: int) -> int:
    """Spare positions a layer that must hold `length` keeps when it grows."""
    return max(HEADROOM, min(length // 16, MAX_HEADROOM))


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views of buffers with spare room at the end, stored
    in `dtype` (keys and values are rounded to it as they are written)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.store_dtype = dtype
        self.reserved = 0  # positions the first buffer holds at least (GrowingCache.reserve)
        self._keys_buffer: torch.Tensor | None = None
        self._values_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states.to(self.store_dtype), value_states.to(self.store_dtype))
        length, new = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
        if length == 0 and self.reserved <= new:  # the first tokens: a copy of their own, no room (may never grow)
            self.keys, self.values = (
                states.to(self.store_dtype, memory_format=torch.contiguous_format, copy=True)
                for states in (key_states, value_states)
            )
            return self.keys, self.values
        if not self._has_room(length + new):
            self._grow(max(length + new + headroom(length + new), self.reserved), key_states)
        self._keys_buffer[:, :, length : length + new].copy_(key_states)
        self._values_buffer[:, :, length : length + new].copy_(value_states)
        self.keys = self._keys_buffer[:, :, : length + new]
        self.values = self._values_buffer[:, :, : length + new]
        return self.keys, self.values

    def _has_room(self, needed: int) -> bool:
        """Whether `keys` is still the start of our buffer (crop keeps it; anything assigning new
        tensors — batch selection, a compacting clone — does not) and the buffer holds `needed`."""
        buffer = self._keys_buffer
        return (
            buffer is not None
            and buffer.shape[-2] >= needed
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.stride() == buffer.stride()
            and self.values.data_ptr() == self._values_buffer.data_ptr()
            and self.keys.shape[:2] == buffer.shape[:2]
        )

    def _grow(self, capacity: int, like: torch.Tensor) -> None:
        length = self.keys.shape[-2] if self.keys.numel() else 0
        for name in ("keys", "values"):
            old = getattr(self, name)
            buffer = torch.empty((*like.shape[:2], capacity, like.shape[-1]), dtype=self.store_dtype)
            huge_pages(buffer.data_ptr(), buffer.numel() * buffer.element_size())  # a long context's: read every step
            if length:
                buffer[:, :, :length].copy_(old)
            setattr(self, f"_{name}_buffer", buffer)
            setattr(self, name, buffer[:, :, :length])


class GrowingCache(DynamicCache):
    """A DynamicCache made of GrowingLayers (`ddp_cache_data` and `config` as for DynamicCache),
    holding keys and values in `dtype` (default: that of `ddp_cache_data`, else float32)."""

    def __init__(self, ddp_cache_data=None, config=None, dtype: torch.dtype | None = None):
        super().__init__(config=config)
        if not self.layers or any(layer.is_sliding for layer in self.layers):
            raise ValueError("GrowingCache needs the model config of a model with full attention only")
        if dtype is None:
            dtype = ddp_cache_data[0][0].dtype if ddp_cache_data else torch.float32
        self.dtype = dtype
        self.layers = [GrowingLayer(dtype) for _ in self.layers]
        for layer, (keys, values) in zip(self.layers, ddp_cache_data or []):
            layer.update(keys, values)

    @classmethod
    def holding(cls, keys: list[torch.Tensor], values: list[torch.Tensor], length: int, config) -> GrowingCache:
        """A cache over per-layer buffers (1 × heads × capacity × head_dim) whose first `length`
        positions are filled; the rest is its room to grow in place (no copy)."""
        cache = cls(config=config, dtype=keys[0].dtype)
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values, strict=True):
            layer.lazy_initialization(layer_keys[:, :, :0], layer_values[:, :, :0])
            layer._keys_buffer, layer._values_buffer = layer_keys, layer_values
            layer.keys, layer.values = layer_keys[:, :, :length], layer_values[:, :, :length]
        return cache

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` positions at the next growth, at once (a prompt's pieces then fill
        one buffer instead of copying the cache at each piece)."""
        for layer in self.layers:
            layer.reserved = tokens


def compacted(cache: DynamicCache) -> DynamicCache:
    """The cache with no spare room behind any layer (in place): for caches that are kept, not extended."""
    if getattr(cache, "draft", None) is not None:  # a multi-token prediction head's keys and values
        cache.draft.compact()
    for layer in cache.layers:
        if hasattr(layer, "compact"):  # a hybrid model's recurrent layer (service/model/deltanet.py)
            layer.compact()
        elif (
            layer.is_initialized
            and layer.keys.numel()
            and layer.keys.untyped_storage().nbytes() > layer.keys.numel() * layer.keys.element_size()
        ):
            layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    return cache
