"""The disk tier's store: lookups by name, reads checked block by block into a new KV cache on
reader threads with a deadline, writes queued for the writer thread, and the tier turned off when
its folder cannot be used. The package's docstring says how it all fits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from ... import metrics
from ...model.deltanet import Shape, is_hybrid
from ...model.hybrid import HybridCache
from ...model.kv import GrowingCache
from ...model.mtp import DraftCache
from ...model.prompts import VisionSpan
from ...native import huge_pages
from ..conversation import KVReuse
from .block_files import NotABlock, entry_kind, open_block, remove_entry, touch
from .block_format import BlockFormat, KVLayout, Rejected, differs
from .names import Block, BlockNames
from .readers import Readers
from .states import StateFormat, StateLayout, points_within, state_block
from .sweep import Sweeper
from .writer import BlockWriter

log = logging.getLogger(__package__)  # the tier's one logger, named as its package

MAX_CANDIDATES = 64  # blocks stored after one prefix whose headers a lookup reads, at most
READERS = 4  # reads at once: one stuck on a hung device leaves the others free


def whole_images(tokens: int, images: list[VisionSpan]) -> int:
    """`tokens`, cut back to the start of an image or video it would split (its features are needed whole)."""
    for span in images:
        if span.start < tokens < span.end:
            tokens = min(tokens, span.start)
    return tokens


def check_writable(root: Path) -> None:
    """Raise OSError unless `root` is a folder this process can make files in (not a file, not
    read-only, inodes left)."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".probe-{os.getpid()}-{threading.get_native_id()}"
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    os.unlink(probe)


class KVDiskStore:
    """See the package docstring. `stored_blocks`, `read_async`, `save` and `truncate` from any thread.
    Raises OSError when `root` cannot be used (check_writable)."""

    name = "kv_disk"

    def __init__(self, root: Path, budget_bytes: int, fingerprint: str, layout: KVLayout, config, min_tokens: int = 16):
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.layout = layout
        self.config = config
        self.min_tokens = min_tokens
        self.names = BlockNames(self.root, fingerprint)
        self.format = BlockFormat(fingerprint, layout)
        # a hybrid model's (Qwen3.5) recurrent states, beside its attention layers' keys and values (states.py)
        self.states = StateFormat(fingerprint) if is_hybrid(getattr(config, "text_config", config)) else None
        self._readers = Readers(READERS, "kv-disk-read")
        sweeper = Sweeper(self.root, budget_bytes, self.name, self._failed)
        self._writer = BlockWriter(
            self.names, self.format, sweeper, lambda: self.usable, self._failed, state_format=self.states
        )
        check_writable(self.root)
        self.usable = True  # False once the folder turned out unusable while serving: the tier is off
        metrics.KV_DISK_USABLE.set(1)

    @property
    def readable(self) -> bool:
        """Whether a lookup may read: the store is usable and not every reader is stuck on the device."""
        return self.usable and not self._readers.all_stuck

    def _turn_off(self, why: str) -> None:
        if self.usable:
            self.usable = False
            metrics.KV_DISK_USABLE.set(0)
            log.warning("KV disk tier off: %s is unusable (%s); conversations are kept in memory only", self.root, why)

    def _failed(self, what: str, exc: OSError) -> None:
        """A write that failed turns the tier off only if the folder itself is unusable (read-only,
        gone, replaced by a file); a full disk, a stray entry in one subfolder or another user's file
        is logged, and the tier stays on."""
        try:
            check_writable(self.root)
        except OSError:
            self._turn_off(f"{what}: {exc.strerror}")
        else:
            log.warning("KV disk tier: %s: %s", what, exc)

    # -- lookup -----------------------------------------------------------------------------------

    def stored_blocks(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        limit: int,
        namespace: str = "",
    ) -> tuple[list[Block], bytes]:
        """The full blocks of `token_ids`' first `limit` tokens on disk in `namespace`'s chain, up to the
        first missing one, and the chain key after them (what `read` continues from, as its `stored`).
        Hashes and stats only: no file is opened. Something other than a regular file under a block's
        name is no block (removed when that touches nothing else)."""
        blocks, after = [], self.names.seed_of(namespace)
        for block, key in self.names.full_blocks(token_ids, positions, images, limit, namespace):
            kind = entry_kind(block.path)
            if kind != "file":
                if kind is not None:
                    self._reject(block.path, Rejected("not_a_file", f"a {kind}"))
                break
            blocks.append(block)
            after = key
        return blocks, after

    def read_async(
        self,
        token_ids,
        positions,
        images,
        limit: int,
        capacity: int,
        beat: int,
        stored,
        timeout: float,
        points=(),
        namespace: str = "",
    ) -> Future:
        """`read` on a reader thread; the Future fails with TimeoutError after `timeout` seconds (the
        read, given up, stops at its next block)."""
        return self._readers.submit(
            timeout,
            self.read,
            token_ids,
            positions,
            images,
            limit,
            capacity,
            beat,
            stored,
            points=points,
            namespace=namespace,
        )

    def read(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        limit: int,
        capacity: int,
        beat: int = 0,
        stored: tuple[list[Block], bytes] | None = None,
        deadline: float | None = None,
        points: list[int] = (),
        namespace: str = "",
    ) -> KVReuse | None:
        """The keys and values of the longest prefix of `token_ids` (at M-RoPE `positions`, 3 × tokens)
        the disk holds (at most `limit` tokens, no image split), in a cache with room for `capacity`
        positions — the stored full blocks (`stored`: what `stored_blocks` found already), then as much
        of a block stored after them as matches (a re-tokenized answer, a tail) — or None when that is
        under `min_tokens` or not more than `beat` tokens (the memory tier's), or once past `deadline`
        (time.monotonic(): the lookup gave up and counted its miss). A hybrid model's prefix ends at one of
        `points` (the request's snapshot positions) whose recurrent state is on disk too."""
        started = time.perf_counter()
        blocks, after = stored or self.stored_blocks(token_ids, positions, images, limit)
        blocks = list(blocks)
        start = blocks[-1].end if blocks else 0
        continuation = self._continuation(after, token_ids, images, start, limit)
        if continuation is not None:
            blocks.append(continuation)
        tokens = whole_images(blocks[-1].end if blocks else 0, images)
        state = None
        if self.states is not None:
            tokens, state = self._state(token_ids, positions, images, points, tokens, beat, namespace)
        if tokens < self.min_tokens or tokens <= beat:
            metrics.CACHE_MISSES.labels(cache=self.name).inc()
            return None
        reuse = self._load(blocks, tokens, token_ids, positions, images, max(capacity, tokens), deadline, state)
        if deadline is not None and time.monotonic() > deadline:
            return None
        if reuse is None or reuse.tokens <= beat:
            metrics.CACHE_MISSES.labels(cache=self.name).inc()
            return None
        metrics.CACHE_HITS.labels(cache=self.name).inc()
        metrics.KV_DISK_LOAD_SECONDS.observe(time.perf_counter() - started)
        return reuse

    def _continuation(
        self, previous: bytes, token_ids: torch.Tensor, images: list[VisionSpan], start: int, limit: int
    ) -> Block | None:
        """Of the blocks stored after the chain key `previous` (at token `start`), the one sharing the
        most leading tokens (and pictures) with `token_ids`, as a Block of those tokens (checked in
        full, positions too, when read)."""
        if previous == self.names.seed:
            return None  # every conversation's first block follows the seed: too many to look through
        prefix, best = previous.hex(), None
        try:
            candidates = [
                Path(e.path)
                for e in os.scandir(self.root / prefix[:2])
                if e.name.startswith(prefix) and e.name.endswith(".kv") and e.is_file(follow_symlinks=False)
            ]
        except (FileNotFoundError, NotADirectoryError):
            return None
        del candidates[MAX_CANDIDATES:]  # a prefix many conversations continue (a long system prompt)
        ours = token_ids[start:limit].tolist()
        for path in candidates:
            try:
                with open_block(path) as f:
                    header = self.format.read_header(f)
            except (FileNotFoundError, NotABlock):
                continue  # gone, or replaced since the listing
            except OSError as exc:
                self._reject(path, Rejected("unreadable", str(exc)))
                continue
            except Rejected as bad:
                self._reject(path, bad)
                continue
            if header["start"] != start:
                continue
            theirs = header["tokens"]
            shared = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            mine = {(s.start, s.end, s.key) for s in images if start <= s.start < start + shared}
            for span_start, span_end, key in header["images"]:
                if span_start < start + shared and (span_start, span_end, key) not in mine:
                    shared = span_start - start  # another picture there: its keys and values differ from it on
            if shared > 0 and (best is None or shared > best.end - start):
                best = Block(path, start, start + shared, previous, start + len(theirs))
        return best

    def _load(
        self,
        blocks: list[Block],
        tokens: int,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        capacity: int,
        deadline: float | None,
        state: list | None = None,
    ) -> KVReuse | None:
        """A cache of the blocks' keys and values for the first `tokens` tokens; shorter if a block went
        missing or was rejected on the way, or the deadline passed; None under `min_tokens` (a hybrid
        model's: exactly `tokens`, with the recurrent `state` there, or None)."""
        layout = self.layout
        buffers = []
        for _ in range(layout.stored_layers):
            pair = []
            for _ in range(2):
                buffer = torch.empty((1, layout.kv_heads, capacity, layout.head_dim), dtype=layout.dtype)
                huge_pages(buffer.data_ptr(), buffer.numel() * buffer.element_size())
                pair.append(buffer)
            buffers.append(pair)
        read, done = 0, 0
        for block in blocks:
            if block.start >= tokens or (deadline is not None and time.monotonic() > deadline):
                break
            payload = self._read(block, token_ids, positions, images)
            if payload is None:
                break
            read += payload.numel() * payload.element_size()
            upto = min(block.end, tokens)
            for (keys, values), (block_keys, block_values) in zip(buffers, payload):
                keys[0, :, block.start : upto].copy_(block_keys[:, : upto - block.start])
                values[0, :, block.start : upto].copy_(block_values[:, : upto - block.start])
            done = upto
            touch(block.path)
        metrics.KV_DISK_READ_BYTES.inc(read)
        if state is not None:
            if done < tokens:
                return None
            text = self.config.text_config
            (states, hidden), model = state, buffers[: layout.layers]
            draft = None
            if layout.head:  # the head's keys and values, after the model's, and its hidden state at the end
                (keys, values), position = buffers[layout.layers], positions[:, tokens - 1 : tokens]
                draft = DraftCache.holding(keys, values, tokens, hidden, position)
            cache = HybridCache.holding(
                text.layer_types, Shape.of(text), [k for k, _ in model], [v for _, v in model], tokens, states, draft
            )
            return KVReuse(cache=cache, tokens=tokens, source="disk")
        tokens = whole_images(done, images)
        if tokens < self.min_tokens:
            return None
        cache = GrowingCache.holding([k for k, _ in buffers], [v for _, v in buffers], tokens, self.config)
        return KVReuse(cache=cache, tokens=tokens, source="disk")

    def _state(self, token_ids, positions, images, points, tokens: int, beat: int, namespace: str):
        """(the longest of `points` within `tokens`, past `beat`, whose recurrent state is on disk and
        reads back whole; (its state, the head's hidden state there)), or (0, None)."""
        text = self.config.text_config
        layout = StateLayout.of_shape(Shape.of(text), text.layer_types, text.hidden_size if self.layout.head else 0)
        for at in points_within(points, tokens):
            if at <= beat:
                break
            block = state_block(self.names, token_ids, positions, images, at, namespace)
            try:
                with open_block(block.path) as f:
                    return at, self.states.read(f, block, token_ids, positions, images, layout)
            except (FileNotFoundError, NotABlock):
                continue
            except OSError as exc:
                self._reject(block.path, Rejected("unreadable", str(exc)))
            except Rejected as bad:
                self._reject(block.path, bad)
        return 0, None

    def _read(
        self, block: Block, token_ids: torch.Tensor, positions: torch.Tensor, images: list[VisionSpan]
    ) -> torch.Tensor | None:
        """The block's keys and values (layers × 2 × heads × stored tokens × head_dim), or None if it is
        gone (evicted meanwhile) or was rejected (then removed): not a regular file, unreadable, or a
        header that differs from what the request needs there (checked before the payload is read)."""
        try:
            f = open_block(block.path)
        except FileNotFoundError:
            return None
        except NotABlock as exc:
            self._reject(block.path, Rejected("not_a_file", str(exc)))
            return None
        except OSError as exc:
            self._reject(block.path, Rejected("unreadable", str(exc)))
            return None
        try:
            with f:
                header = self.format.read_header(f)
                wrong = differs(header, block, token_ids, positions, images)
                if wrong:
                    raise Rejected("corrupt", f"another block's content: {wrong}")
                return self.format.read_payload(f, header)
        except Rejected as bad:
            self._reject(block.path, bad)
        except OSError as exc:
            self._reject(block.path, Rejected("unreadable", str(exc)))
        return None

    def _reject(self, path: Path, bad: Rejected) -> None:
        done = "removed" if remove_entry(path) else "left in place (a directory holding files)"
        log.warning("KV disk tier: %s %s (%s: %s); it was not used", done, path, bad.reason, bad)
        metrics.KV_DISK_REJECTED.labels(reason=bad.reason).inc()

    # -- writes -----------------------------------------------------------------------------------

    def save(
        self, cache, token_ids: torch.Tensor, positions: torch.Tensor, images: list[VisionSpan], namespace: str = ""
    ) -> None:
        """Queue a kept cache's keys and values (covering `token_ids`, at M-RoPE `positions`, in `namespace`'s
        chain) for the writer; returns at once."""
        hybrid = isinstance(cache, HybridCache)
        attention = [cache.layers[i] for i in cache.attention] if hybrid else cache.layers
        layers = [(layer.keys, layer.values) for layer in attention]
        if not self.usable or not layers or layers[0][0].dtype != self.layout.dtype or len(token_ids) < self.min_tokens:
            return
        states = cache.states_to_keep(len(token_ids)) if hybrid else ()
        if self.layout.head:  # blocks hold the head's keys and values too: a cache without them stays in memory
            draft = cache.draft if hybrid else None
            if draft is None or draft.entries < len(token_ids) - 1:
                return
            layers.append(draft.stored(len(token_ids)))
            states = [kept for kept in states if kept[2] is not None]
        spans = [s for s in images if s.start < len(token_ids)]
        self._writer.queue(cache, layers, token_ids, positions, spans, namespace, states)

    def truncate(self, cache, tokens: int) -> None:
        """`cache` is being extended in place from `tokens` on: its queued writes stop there."""
        self._writer.truncate(cache, tokens)

    def flush(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every queued write is on disk; whether they all are."""
        return self._writer.flush(timeout)
