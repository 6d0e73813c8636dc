"""Qwen3.5's multi-token prediction head (the checkpoint's `mtp.*` tensors) as a drafter for exact
speculative decoding: what it computes (`MTPHead`) and what it keeps per sequence (`DraftCache`).

Read from vLLM's Qwen3.5 MTP model and its EAGLE-style proposer: at position p the head
takes the hidden state the model's last layer left there, after its final norm, and the input
embedding of token p + 1 — the vision feature where that token is a picture's placeholder, as vLLM
merges them — normalises each (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), maps the embedding
beside the hidden state through `fc` (2·hidden → hidden), runs one full-attention decoder layer of the
model's own kind (keys and values of its own, at the model's M-RoPE position p) and a final `norm`;
the model's lm_head gives token p + 2. A chain of guesses feeds the head its own output as the next
hidden state, with the guessed token's embedding, one position further. The embedding and lm_head are
the model's; the layer, its norms and its MLP (or mixture of experts) are computed by the model's own
forward (service/model/forward.py), so the head is exact by construction as the model is: a row's
bits depend on that row alone, whether it runs alone, in a batch or after a cache hit.

`DraftCache` holds, per sequence, the head's keys and values — an entry for every position whose next
token is known (every prompt position and every accepted token) — and what the model computed that the
head has not read yet: final hidden states of the positions after its entries, the input embeddings of
the tokens after them, their positions. The model's forward hands them over as it computes them; the
drafter (service/engine/mtp_drafts.py) reads them; a crop follows the sequence's cache, and a snapshot
of a hybrid cache (service/model/hybrid.py) keeps the hidden state its position needs.
"""

from __future__ import annotations

import torch
from torch import nn

from .kv import GrowingLayer


class HeadUnavailable(ValueError):
    """The head's part of a cache cannot follow it to the length asked for."""


class DraftCache:
    """A multi-token prediction head's part of one sequence's cache (see the module docstring).

    `layer` holds entries 0 … `entries` − 1 (entry p: the model's hidden state at p with token p + 1);
    `hidden` the model's final hidden states of positions `entries` … `length` − 1 (at `positions`),
    `embedded` the input embeddings of tokens `entries` + 1 … `length` − 1: the head can add an entry
    for each row but the last, whose next token the model has not been fed yet. `kept` holds the hidden
    state at `length` − 1 of each length the sequence's cache may be cut back to (its snapshots)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.layer = GrowingLayer(dtype)
        self.hidden: torch.Tensor | None = None
        self.embedded: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # length → (hidden row, its position)

    @property
    def entries(self) -> int:
        return self.layer.get_seq_length()

    @property
    def pending(self) -> int:
        """Model positions the head has not read yet."""
        return 0 if self.hidden is None else len(self.hidden)

    @property
    def length(self) -> int:
        """The sequence's cache length this part follows."""
        return self.entries + self.pending

    def fed(self, hidden: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor) -> None:
        """The model computed rows for the next positions: their final hidden states, their input
        embeddings and their M-RoPE positions (3 × rows)."""
        if self.hidden is None:
            self.hidden, self.embedded = hidden.new_empty(0, hidden.shape[1]), hidden.new_empty(0, hidden.shape[1])
            self.positions = positions.new_empty(3, 0)
        self.hidden = torch.cat([self.hidden, hidden])
        self.positions = torch.cat([self.positions, positions], 1)
        both = torch.cat([self.embedded, embedded])
        self.embedded = both[len(both) - (len(self.hidden) - 1) :]  # the first row's token has its entry already

    def take(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first `count` unread rows (hidden states, the next tokens' embeddings, positions), read
        now: the head adds their entries. The embeddings run one short when `count` is all the rows."""
        taken = self.hidden[:count], self.embedded[:count], self.positions[:, :count]
        self.hidden, self.embedded = self.hidden[count:], self.embedded[count:]
        self.positions = self.positions[:, count:]
        return taken

    def keep(self) -> None:
        """Keep the hidden state at the present length's last position (a snapshot of the cache)."""
        if self.pending:
            self.kept[self.length] = (self.hidden[-1:].clone(), self.positions[:, -1:].clone())

    def croppable(self, length: int) -> bool:
        return length == 0 or length > self.entries or length in self.kept

    def crop(self, length: int) -> None:
        """Follow the sequence's cache to `length` tokens: unread rows dropped, or, back before the
        entries, the entries of a kept length and its hidden state."""
        if length >= self.length:
            return
        if length > self.entries:
            unread = length - self.entries
            self.hidden, self.positions = self.hidden[:unread], self.positions[:, :unread]
            self.embedded = self.embedded[: unread - 1]
        elif length == 0 or length in self.kept:
            self.layer.crop(max(length - 1, 0) - self.entries)
            self._unread(self.kept.get(length))
        else:
            raise HeadUnavailable(f"no hidden state kept at {length} tokens")
        self.kept = {at: kept for at, kept in self.kept.items() if at <= length}

    def _unread(self, row: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Nothing unread but (`row`) the hidden state at the last position."""
        if row is None:
            self.hidden = self.embedded = self.positions = None
            return
        hidden, position = row
        self.hidden, self.positions = hidden.clone(), position.clone()
        self.embedded = hidden.new_empty(0, hidden.shape[1])

    def prune(self, lengths) -> None:
        """Keep hidden states at `lengths` only (the cache's snapshots)."""
        self.kept = {at: kept for at, kept in self.kept.items() if at in lengths}

    def last_hidden(self) -> torch.Tensor | None:
        """The hidden state at the present length's last position (1 × hidden), if unread."""
        return self.hidden[-1:].clone() if self.pending else None

    def prefix(self, length: int) -> DraftCache:
        """A new part (its own memory) for the cache's first `length` tokens."""
        if not self.croppable(length):
            raise HeadUnavailable(f"no hidden state kept at {length} tokens")
        other = DraftCache(self.dtype)
        if length >= self.length:
            entries, unread = self.entries, None
        elif length > self.entries:
            entries, unread = self.entries, length - self.entries
        else:
            entries, unread = max(length - 1, 0), 0
        if entries:
            other.layer.update(self.layer.keys[..., :entries, :].clone(), self.layer.values[..., :entries, :].clone())
        if unread is None or unread:
            end = self.pending if unread is None else unread
            if end:
                other.hidden, other.positions = self.hidden[:end].clone(), self.positions[:, :end].clone()
                other.embedded = self.embedded[: end - 1].clone()
        else:
            other._unread(self.kept.get(length))
        other.kept = {at: (h.clone(), p.clone()) for at, (h, p) in self.kept.items() if at <= length}
        return other

    def stored(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of entries 0 … `tokens` − 2 as the disk tier lays out a layer of a
        cache of `tokens` tokens: entry p at index p + 1 (it depends on token p + 1), zeros at 0."""
        if self.entries < tokens - 1:
            raise HeadUnavailable(f"the head holds {self.entries} entries, {tokens - 1} asked for")
        out = []
        for states in (self.layer.keys, self.layer.values):
            shifted = states.new_zeros(*states.shape[:2], tokens, states.shape[-1])
            shifted[:, :, 1:] = states[:, :, : tokens - 1]
            out.append(shifted)
        return out[0], out[1]

    @classmethod
    def holding(
        cls, keys: torch.Tensor, values: torch.Tensor, tokens: int, hidden: torch.Tensor, position: torch.Tensor
    ) -> DraftCache:
        """A part over buffers laid out as `stored` lays them (1 × heads × capacity × head_dim, the
        first `tokens` positions filled: room to grow in place), with the hidden state at `tokens` − 1
        (1 × hidden) at its M-RoPE `position` (3 × 1)."""
        part = cls(keys.dtype)
        layer = part.layer
        layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        layer._keys_buffer, layer._values_buffer = keys[:, :, 1:], values[:, :, 1:]
        layer.keys, layer.values = layer._keys_buffer[:, :, : tokens - 1], layer._values_buffer[:, :, : tokens - 1]
        part._unread((hidden, position))
        return part

    def compact(self) -> None:
        """No spare room behind the keys and values (kept, not extended)."""
        if self.entries:
            self.layer.keys, self.layer.values = self.layer.keys.clone(), self.layer.values.clone()

    def nbytes(self) -> int:
        tensors = [self.hidden, self.embedded] + [t for pair in self.kept.values() for t in pair]
        if self.entries:
            tensors += [self.layer.keys, self.layer.values]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class MTPHead:
    """The head's computation over rows of many sequences: `head(hidden, embedded, positions, drafts,
    counts)` → its output rows (after its final norm), `counts[i]` consecutive rows for `drafts[i]`,
    whose keys and values they extend; `logits` of output rows; `embed` of token ids (the model's)."""

    def __init__(self, module: nn.Module, forward):  # forward: the model's TextForward (service/model/forward.py)
        self.forward = forward
        self.fc = module.fc
        self.embedding_scale = forward.norm_scale(module.pre_fc_norm_embedding.weight)
        self.hidden_scale = forward.norm_scale(module.pre_fc_norm_hidden.weight)
        self.final_scale = forward.norm_scale(module.norm.weight)
        self.layer = forward.layer_of(module.layers[0])

    @torch.inference_mode()
    def __call__(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        positions: torch.Tensor,
        drafts: list[DraftCache],
        counts: list[int],
    ) -> torch.Tensor:
        forward = self.forward
        normed = [forward.norm(embedded, self.embedding_scale), forward.norm(hidden, self.hidden_scale)]
        x = self.fc(torch.cat(normed, -1))
        cos, sin = forward.rotary(positions)
        x = forward.decoder_layer(self.layer, x, cos, sin, [d.layer for d in drafts], counts)
        return forward.norm(x, self.final_scale)

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.forward.lm_head(out)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.forward.embed_tokens(token_ids)
