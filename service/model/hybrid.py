"""One sequence's cache for a hybrid model (Qwen3.5): keys and values for its full-attention layers,
a fixed-size recurrent state for its linear-attention ones (service/model/deltanet.py).

Keys and values can be cut back to any length; a recurrent state cannot — it holds its tokens mixed
together. So `HybridCache` keeps **snapshots**: copies of every linear layer's state at chosen
lengths (where a later request may resume: a prompt's end, the start of its last turn, every
`snapshot_every` tokens of a prefill). `crop(length)` works to a snapshot's length, to the present
one, or back over the guesses of the last decode step (their state recomputed without them); any
other length raises `StateUnavailable`, and a caller reusing a prefix asks `resumable(length)`
first: the longest snapshot at or below it.

A snapshot costs its state's bytes (`HybridCache.state_bytes`: 19.3 MiB for Qwen3.5-2B's 18 linear
layers), counted with the keys and values wherever the cache is kept.

A sequence that drafts with the checkpoint's multi-token prediction head carries the head's part too
(`draft`, service/model/mtp.py): it follows every crop and prefix, and a snapshot keeps the hidden state
the head needs to resume there.
"""

from __future__ import annotations

import torch

from .deltanet import DeltaNetMixer, RecurrentLayer, Shape
from .kv import GrowingLayer
from .mtp import DraftCache

MAX_SNAPSHOTS = 8  # kept per cache: the first (a shared system prompt's end, say) and the latest


class StateUnavailable(ValueError):
    """A recurrent state was asked for at a length the cache holds no snapshot of."""


class HybridCache:
    """Per decoder layer a `GrowingLayer` (full attention) or a `RecurrentLayer` (linear attention)."""

    def __init__(self, layer_types: list[str], shape: Shape, dtype: torch.dtype = torch.float32):
        self.layer_types = list(layer_types)
        self.shape = shape
        self.dtype = dtype
        self.layers = [
            GrowingLayer(dtype) if kind == "full_attention" else RecurrentLayer(shape) for kind in layer_types
        ]
        self.attention = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        self.recurrent = [layer for layer in self.layers if isinstance(layer, RecurrentLayer)]
        self.snapshots: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.mixers: list[DeltaNetMixer] = []  # set by the forward: what a rewind recomputes with
        self.draft: DraftCache | None = None  # a multi-token prediction head's part, when it drafts

    # -- what the forward and the engine ask of any cache -----------------------------------------

    def get_seq_length(self) -> int:
        layer = self.layers[self.attention[0]]
        return layer.keys.shape[-2] if layer.is_initialized and layer.keys.numel() else 0

    def reserve(self, tokens: int) -> None:
        for i in self.attention:
            self.layers[i].reserved = tokens

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -`tokens_to_remove` tokens (a negative count, as DynamicCache.crop takes it)
        — where the recurrent state can follow (see the module docstring)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of tokens to remove")
        length = self.get_seq_length()
        target = length + tokens_to_remove
        if target >= length:
            return
        if self.draft is not None and not self.draft.croppable(target):
            self.draft = None  # the head cannot follow there: the sequence guesses without it
        if target == 0 or target in self.snapshots:
            fresh = [(torch.zeros_like(layer.conv), torch.zeros_like(layer.state)) for layer in self.recurrent]
            for layer, (conv, state) in zip(self.recurrent, self.snapshots.get(target, fresh)):
                layer.conv, layer.state = conv.clone(), state.clone()
                layer.length, layer._before, layer._inputs = target, None, None
        elif all(layer._inputs is not None for layer in self.recurrent) and self._undoable(length - target):
            for layer, mixer in zip(self.recurrent, self.mixers):
                layer.rewind(length - target, mixer)
        else:
            raise StateUnavailable(f"no recurrent state at {target} tokens (snapshots at {sorted(self.snapshots)})")
        for i in self.attention:
            self.layers[i].crop(target - length)
        self.snapshots = {at: s for at, s in self.snapshots.items() if at <= target}
        if self.draft is not None:
            self.draft.crop(target)

    def _undoable(self, tokens: int) -> bool:
        return all(len(layer._inputs[0]) >= tokens for layer in self.recurrent)

    # -- snapshots ---------------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Keep a copy of every linear layer's state at the present length (at most MAX_SNAPSHOTS: the
        first one and the latest, where a later request most likely resumes)."""
        self.snapshots[self.get_seq_length()] = [(layer.conv.clone(), layer.state.clone()) for layer in self.recurrent]
        while len(self.snapshots) > MAX_SNAPSHOTS:
            del self.snapshots[sorted(self.snapshots)[1]]
        if self.draft is not None:
            self.draft.keep()
            self.draft.prune(self.snapshots)

    def states_to_keep(self, tokens: int) -> list[tuple[int, list, torch.Tensor | None]]:
        """(length, each linear layer's (conv, state), the head's hidden state there or None) of every
        snapshot within `tokens` and of the present state if the cache holds `tokens` — copies: what a
        store may keep while this cache goes on."""
        draft = self.draft
        kept = [
            (at, states, draft.kept[at][0] if draft is not None and at in draft.kept else None)
            for at, states in sorted(self.snapshots.items())
            if at <= tokens
        ]
        if self.get_seq_length() == tokens and tokens not in self.snapshots:
            present = [(layer.conv.clone(), layer.state.clone()) for layer in self.recurrent]
            kept.append((tokens, present, draft.last_hidden() if draft is not None else None))
        return kept

    @classmethod
    def holding(
        cls,
        layer_types: list[str],
        shape: Shape,
        keys: list,
        values: list,
        length: int,
        states: list,
        draft: DraftCache | None = None,
    ) -> HybridCache:
        """A cache over its attention layers' buffers (1 × heads × capacity × head_dim, the first `length`
        positions filled: room to grow in place) and its linear layers' states at `length` (and the
        head's part, `draft`)."""
        cache = cls(layer_types, shape, keys[0].dtype)
        cache.draft = draft
        for i, layer_keys, layer_values in zip(cache.attention, keys, values, strict=True):
            layer = cache.layers[i]
            layer.lazy_initialization(layer_keys[:, :, :0], layer_values[:, :, :0])
            layer._keys_buffer, layer._values_buffer = layer_keys, layer_values
            layer.keys, layer.values = layer_keys[:, :, :length], layer_values[:, :, :length]
        for layer, (conv, state) in zip(cache.recurrent, states, strict=True):
            layer.conv, layer.state, layer.length = conv.clone(), state.clone(), length
        return cache

    def resumable(self, length: int) -> int:
        """The longest length at or below `length` whose recurrent state this cache can give back."""
        if length >= self.get_seq_length():
            return self.get_seq_length()
        return max((at for at in self.snapshots if at <= length), default=0)

    @property
    def state_bytes(self) -> int:
        """One snapshot's bytes: every linear layer's state."""
        return self.shape.state_bytes * len(self.recurrent)

    def nbytes(self) -> int:
        kv = sum(
            t.numel() * t.element_size()
            for i in self.attention
            if self.layers[i].is_initialized
            for t in (self.layers[i].keys, self.layers[i].values)
        )
        live = sum(layer.nbytes() for layer in self.recurrent)
        head = self.draft.nbytes() if self.draft is not None else 0
        return kv + live + head + self.state_bytes * len(self.snapshots)

    def prefix(self, length: int) -> HybridCache:
        """A new cache of the first `length` tokens (its own memory): `length` must be resumable."""
        if self.resumable(length) != length:
            raise StateUnavailable(f"no recurrent state at {length} tokens")
        other = HybridCache(self.layer_types, self.shape, self.dtype)
        other.mixers = self.mixers
        for i in self.attention:
            source = self.layers[i]
            if length:
                other.layers[i].update(source.keys[..., :length, :].clone(), source.values[..., :length, :].clone())
        if length == self.get_seq_length():
            for mine, theirs in zip(other.recurrent, self.recurrent):
                mine.conv, mine.state = theirs.conv.clone(), theirs.state.clone()
                mine.length = length
        elif length:
            for mine, (conv, state) in zip(other.recurrent, self.snapshots[length]):
                mine.conv, mine.state, mine.length = conv.clone(), state.clone(), length
        other.snapshots = {
            at: [(c.clone(), s.clone()) for c, s in snap] for at, snap in self.snapshots.items() if at <= length
        }
        other.draft = self.draft.prefix(length) if self.draft is not None and self.draft.croppable(length) else None
        return other
