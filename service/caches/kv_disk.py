"""The conversation cache's disk tier: the keys and values of every kept conversation, in files under
KV_DISK_DIR that outlive evictions, restarts and crashes, shared by the instances of a machine.

Content-addressed blocks. A conversation's keys and values are cut into blocks of BLOCK_TOKENS
tokens (and a shorter tail at its end); a block's file is named by a hash chained over everything
its keys and values depend on — the store's fingerprint (checkpoint, quantization, vision encoder,
KV layout), every token before and in it, and the picture (pixels and grid) behind each image or
video that starts there, the M-RoPE positions of its tokens — and the request's cache namespace (its
tenant and cache_salt, an opaque keyed hash: service/api/access/tenants.py), which seeds the chain: one tenant's
lookups never find another's files, and a file name holds a tenant only as a hash keyed with that hash
(a header not at all). The name alone finds a prefix: a lookup hashes the prompt block by block and
stats names until one is missing, so there is no index to rebuild or to keep consistent between
instances, a prefix shared by conversations (a system prompt, a picture) is stored once, and a second
turn writes only its new blocks. Keys and values are the same bits whichever path computed them
(service/model/forward.py), so a block written by any instance serves any other.

A file is written whole or not at all (temporary file, then rename) and read only after its header
shows everything its name stands for as the request needs it (format version, fingerprint, KV layout,
the chain key before it, its tokens, their positions, its pictures and clips) and a CRC-32 of all its
bytes checks out: a foreign, truncated, corrupted or misplaced file is removed and counted, never
used. Only regular files are opened (service/caches/block_files.py). Writes run on a writer thread of
low priority, reads on a few reader threads with a deadline (service/caches/readers.py), never on the
scheduler's; the budget (KV_DISK_MB) is kept by removing the least recently used files (a hit
refreshes a file's time), under a lock file so that two instances do not both evict. A folder that
cannot be written (not a folder, read-only, not ours, out of inodes) turns the tier off, at the start
or when a write meets it.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import weakref
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import metrics
from ..memory import kv_shape
from ..model.kv import GrowingCache
from ..model.prompts import VisionSpan
from ..native import huge_pages
from .block_files import NotABlock, entry_kind, kind_of, open_block, remove_entry
from .conversation import KVReuse
from .readers import Readers

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64  # 7 MiB of bf16 keys and values on Qwen3-VL-2B: a few files per picture
FORMAT_VERSION = 2
MAGIC = b"QVLKV\0\0\2"
_HEAD = struct.Struct("<8sI")  # magic, header length
_TRAILER = struct.Struct("<I")  # CRC-32 of header and payload
EVICT_TO = 0.9  # of the budget, once over it
SCAN_EVERY = 0.05  # of the budget written between two scans of the folder (other instances write too)
STALE_TEMPORARY_SECONDS = 3600.0  # a writer's unfinished file older than this was left by a crash
FLUSH_SECONDS = 10.0  # at exit, waiting for queued writes
MAX_CANDIDATES = 64  # blocks stored after one prefix whose headers a lookup reads, at most
READERS = 4  # reads at once: one stuck on a hung device leaves the others free


@dataclass(frozen=True)
class KVLayout:
    """How keys and values lie in a block's payload: per layer, keys then values, each
    kv_heads × tokens × head_dim values of `dtype`."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> KVLayout:
        return cls(*kv_shape(config), dtype)

    def described(self) -> dict:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": str(self.dtype)}

    def payload_bytes(self, tokens: int) -> int:
        return self.layers * 2 * self.kv_heads * tokens * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class Block:
    """Tokens [start, end) of a sequence, from the file at `path` (which may hold more: up to `stored`),
    the block after the chain key `previous`."""

    path: Path
    start: int
    end: int
    previous: bytes
    stored: int | None = None


@dataclass(eq=False)
class _Write:
    """A kept cache's keys and values waiting for the writer. `limit` falls when a request takes the
    cache over (it then writes its own tokens from there on, in place); blocks past it are not written."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    token_ids: torch.Tensor
    positions: torch.Tensor  # 3 × tokens: M-RoPE positions
    images: list[VisionSpan]
    limit: int
    owner: weakref.ref  # the cache it was queued from
    namespace: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class Rejected(Exception):
    """A file that must not be used: `reason` is foreign, truncated, corrupt (another block's content
    included), not_a_file or unreadable."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def whole_images(tokens: int, images: list[VisionSpan]) -> int:
    """`tokens`, cut back to the start of an image or video it would split (its features are needed whole)."""
    for span in images:
        if span.start < tokens < span.end:
            tokens = min(tokens, span.start)
    return tokens


def held_bytes(root: Path) -> int:
    """Bytes of the block files under `root` now."""
    return sum(_size(p) for p in Path(root).glob("*/*.kv"))


def check_writable(root: Path) -> None:
    """Raise OSError unless `root` is a folder this process can make files in (not a file, not
    read-only, inodes left)."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".probe-{os.getpid()}-{threading.get_native_id()}"
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    os.unlink(probe)


def default_budget_bytes(root: Path, held: int = 0) -> int:
    """A quarter of the disk's free space, the store's own files counted as free, at most 64 GiB."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    return min(64 * 1024**3, (shutil.disk_usage(probe).free + held) // 4)


class KVDiskStore:
    """See the module docstring. `stored_blocks`, `read_async`, `save` and `truncate` from any thread.
    Raises OSError when `root` cannot be used (check_writable)."""

    name = "kv_disk"

    def __init__(self, root: Path, budget_bytes: int, fingerprint: str, layout: KVLayout, config, min_tokens: int = 16):
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.layout = layout
        self.config = config
        self.min_tokens = min_tokens
        self._seed = hashlib.blake2b(f"{FORMAT_VERSION}:{fingerprint}".encode(), digest_size=16).digest()
        self._jobs: queue.Queue[_Write] = queue.Queue()
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache → its queued _Writes
        self._pending_lock = threading.Lock()
        self._unfinished = 0
        self._idle = threading.Condition()
        self._threads_lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._readers = Readers(READERS, "kv-disk-read")
        self._written_since_scan = 0
        self._held = 0  # bytes of the files at the last scan, plus this instance's writes since
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

    # -- names ------------------------------------------------------------------------------------

    def _chain(
        self,
        previous: bytes,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        end: int,
        images: list[VisionSpan],
    ) -> bytes:
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(struct.pack("<qq", start, end))
        digest.update(token_ids[start:end].to(torch.int64).numpy().tobytes())
        digest.update(positions[:, start:end].to(torch.int64).contiguous().numpy().tobytes())
        for span in images:
            if start <= span.start < end:
                digest.update(f"{span.start}-{span.end}:{span.key};".encode())
        return digest.digest()

    def _seed_of(self, namespace: str) -> bytes:
        """The chain's first key: the store's seed, keyed with a request's cache namespace if it has one
        ("" keeps the store's own: the files of before namespaces)."""
        if not namespace:
            return self._seed
        return hashlib.blake2b(namespace.encode(), digest_size=16, key=self._seed).digest()

    def _path(self, previous: bytes, key: bytes) -> Path:
        """A block's file: named by the chain before it, then its own key (the blocks that continue one
        prefix sit side by side, found by that first half)."""
        return self.root / previous.hex()[:2] / f"{previous.hex()}-{key.hex()}.kv"

    def _full_blocks(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        length: int,
        namespace: str = "",
    ):
        """(Block, its own chain key) of each full block within `length` tokens, in order, in `namespace`'s chain."""
        previous = self._seed_of(namespace)
        for start in range(0, length - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = self._chain(previous, token_ids, positions, start, start + BLOCK_TOKENS, images)
            yield Block(self._path(previous, key), start, start + BLOCK_TOKENS, previous), key
            previous = key

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
        blocks, after = [], self._seed_of(namespace)
        for block, key in self._full_blocks(token_ids, positions, images, limit, namespace):
            kind = entry_kind(block.path)
            if kind != "file":
                if kind is not None:
                    self._reject(block.path, Rejected("not_a_file", f"a {kind}"))
                break
            blocks.append(block)
            after = key
        return blocks, after

    def read_async(
        self, token_ids, positions, images, limit: int, capacity: int, beat: int, stored, timeout: float
    ) -> Future:
        """`read` on a reader thread; the Future fails with TimeoutError after `timeout` seconds (the
        read, given up, stops at its next block)."""
        return self._readers.submit(timeout, self.read, token_ids, positions, images, limit, capacity, beat, stored)

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
    ) -> KVReuse | None:
        """The keys and values of the longest prefix of `token_ids` (at M-RoPE `positions`, 3 × tokens)
        the disk holds (at most `limit` tokens, no image split), in a cache with room for `capacity`
        positions — the stored full blocks (`stored`: what `stored_blocks` found already), then as much
        of a block stored after them as matches (a re-tokenized answer, a tail) — or None when that is
        under `min_tokens` or not more than `beat` tokens (the memory tier's), or once past `deadline`
        (time.monotonic(): the lookup gave up and counted its miss)."""
        started = time.perf_counter()
        blocks, after = stored or self.stored_blocks(token_ids, positions, images, limit)
        blocks = list(blocks)
        start = blocks[-1].end if blocks else 0
        continuation = self._continuation(after, token_ids, images, start, limit)
        if continuation is not None:
            blocks.append(continuation)
        tokens = whole_images(blocks[-1].end if blocks else 0, images)
        if tokens < self.min_tokens or tokens <= beat:
            metrics.CACHE_MISSES.labels(cache=self.name).inc()
            return None
        reuse = self._load(blocks, tokens, token_ids, positions, images, max(capacity, tokens), deadline)
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
        if previous == self._seed:
            return None  # every conversation's first block follows the seed: too many to look through
        prefix, best = previous.hex(), None
        try:
            candidates = [
                Path(e.path)
                for e in os.scandir(self.root / prefix[:2])
                if e.name.startswith(prefix) and e.is_file(follow_symlinks=False)
            ]
        except (FileNotFoundError, NotADirectoryError):
            return None
        del candidates[MAX_CANDIDATES:]  # a prefix many conversations continue (a long system prompt)
        ours = token_ids[start:limit].tolist()
        for path in candidates:
            try:
                with open_block(path) as f:
                    header = self._header(f, path)
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
    ) -> KVReuse | None:
        """A cache of the blocks' keys and values for the first `tokens` tokens; shorter if a block went
        missing or was rejected on the way, or the deadline passed; None under `min_tokens`."""
        layout = self.layout
        buffers = []
        for _ in range(layout.layers):
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
            _touch(block.path)
        metrics.KV_DISK_READ_BYTES.inc(read)
        tokens = whole_images(done, images)
        if tokens < self.min_tokens:
            return None
        cache = GrowingCache.holding([k for k, _ in buffers], [v for _, v in buffers], tokens, self.config)
        return KVReuse(cache=cache, tokens=tokens, source="disk")

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
                header = self._header(f, block.path)
                wrong = _differs(header, block, token_ids, positions, images)
                if wrong:
                    raise Rejected("corrupt", f"another block's content: {wrong}")
                return self._payload(f, header)
        except Rejected as bad:
            self._reject(block.path, bad)
        except OSError as exc:
            self._reject(block.path, Rejected("unreadable", str(exc)))
        return None

    def _header(self, f, path: Path) -> dict:
        """The file's header, checked: this format, this fingerprint and layout, a size that fits."""
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise Rejected("truncated", f"{size} bytes")
        magic, header_size = _HEAD.unpack(head)
        if magic != MAGIC:
            raise Rejected("foreign" if magic[:5] == MAGIC[:5] else "corrupt", "not a KV block of this format")
        if header_size > size:
            raise Rejected("truncated", f"{size} bytes")
        header_bytes = f.read(header_size)
        if len(header_bytes) < header_size:
            raise Rejected("truncated", f"{size} bytes")
        try:
            header = json.loads(header_bytes)
            tokens = len(header["tokens"])
        except (ValueError, KeyError, TypeError):
            raise Rejected("corrupt", "unreadable header") from None
        if header.get("fingerprint") != self.fingerprint or header.get("layout") != self.layout.described():
            raise Rejected("foreign", "made by another checkpoint, quantization or KV layout")
        if size != _HEAD.size + header_size + self.layout.payload_bytes(tokens) + _TRAILER.size:
            raise Rejected("truncated", f"{size} bytes")
        if not _well_formed(header, tokens):
            raise Rejected("corrupt", "unreadable header")
        header["_bytes"] = header_bytes
        return header

    def _payload(self, f, header: dict) -> torch.Tensor:
        """The keys and values after a checked header, their checksum checked."""
        layout, tokens = self.layout, len(header["tokens"])
        size = layout.payload_bytes(tokens)
        payload = torch.empty(size, dtype=torch.uint8)
        if f.readinto(memoryview(payload.numpy())) != size:
            raise Rejected("truncated", "payload")
        (crc,) = _TRAILER.unpack(f.read(_TRAILER.size))
        if zlib.crc32(payload.numpy(), zlib.crc32(header["_bytes"])) != crc:
            raise Rejected("corrupt", "checksum")
        return payload.view(layout.dtype).view(layout.layers, 2, layout.kv_heads, tokens, layout.head_dim)

    def _reject(self, path: Path, bad: Rejected) -> None:
        done = "removed" if remove_entry(path) else "left in place (a directory holding files)"
        log.warning("KV disk tier: %s %s (%s: %s); it was not used", done, path, bad.reason, bad)
        metrics.KV_DISK_REJECTED.labels(reason=bad.reason).inc()

    # -- writes -----------------------------------------------------------------------------------

    def save(
        self, cache, token_ids: torch.Tensor, positions: torch.Tensor, images: list[VisionSpan], namespace: str = ""
    ) -> None:
        """Queue a kept cache's keys and values (covering `token_ids`, at M-RoPE `positions`, in `namespace`'s
        chain) for the
        writer; returns at once."""
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        if not self.usable or not layers or layers[0][0].dtype != self.layout.dtype or len(token_ids) < self.min_tokens:
            return
        spans = [s for s in images if s.start < len(token_ids)]
        job = _Write(layers, token_ids, positions, spans, len(token_ids), weakref.ref(cache), namespace)
        with self._pending_lock:
            self._pending.setdefault(cache, []).append(job)
        with self._idle:
            self._unfinished += 1
        metrics.KV_DISK_PENDING.inc()
        self._start_writer()
        self._jobs.put(job)

    def truncate(self, cache, tokens: int) -> None:
        """`cache` is being extended in place from `tokens` on: its queued writes stop there."""
        with self._pending_lock:
            jobs = list(self._pending.get(cache, ()))
        for job in jobs:
            with job.lock:  # waits for a block being copied out right now
                job.limit = min(job.limit, tokens)

    def flush(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every queued write is on disk; whether they all are."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._unfinished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _start_writer(self) -> None:
        # Started on first use, i.e. in the process that serves (threads do not survive a fork).
        with self._threads_lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="kv-disk-write", daemon=True)
                self._writer.start()
                atexit.register(self._flush_at_exit)

    def _flush_at_exit(self) -> None:
        if not self.flush(FLUSH_SECONDS):
            log.warning("KV disk tier: %d conversations not written at exit", self._unfinished)

    def _write_loop(self) -> None:
        try:  # behind the decode loop: a writer never takes a core from it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
        self._scan()
        while True:
            job = self._jobs.get()
            try:
                if self.usable:
                    self._write(job)
                if self._held > self.budget_bytes or self._written_since_scan > self.budget_bytes * SCAN_EVERY:
                    self._scan()  # before the job counts as done: a flush returns within the budget
            except Exception:
                log.exception("KV disk tier: writing a conversation failed")
            finally:
                self._done(job)
                with self._idle:
                    self._unfinished -= 1
                    self._idle.notify_all()
                metrics.KV_DISK_PENDING.dec()

    def _done(self, job: _Write) -> None:
        """Forget a written job (and its tensors: an evicted cache's memory goes back now)."""
        with self._pending_lock:
            cache = job.owner()
            jobs = self._pending.get(cache) if cache is not None else None
            if jobs and job in jobs:
                jobs.remove(job)
                if not jobs:
                    del self._pending[cache]
        job.layers = []

    def _write(self, job: _Write) -> None:
        length, previous, end = len(job.token_ids), self._seed_of(job.namespace), 0
        for block, key in self._full_blocks(job.token_ids, job.positions, job.images, length, job.namespace):
            if not self._write_block(job, block):
                return
            previous, end = key, block.end
        if end < length:  # the tail: what follows the last full block
            key = self._chain(previous, job.token_ids, job.positions, end, length, job.images)
            self._write_block(job, Block(self._path(previous, key), end, length, previous))

    def _write_block(self, job: _Write, block: Block) -> bool:
        """Write the block's tokens unless on disk already; False once past the job's limit or when
        it cannot be written."""
        path, start, end = block.path, block.start, block.end
        kind = entry_kind(path)
        if kind == "file":
            _touch(path)  # in use again: last to be evicted
            return True
        if kind is not None and not remove_entry(path):
            log.warning("KV disk tier: %s is a %s holding files, not a block; not written there", path, kind)
            return False
        layout = self.layout
        with job.lock:
            if end > job.limit:
                return False
            payload = torch.empty((layout.layers, 2, layout.kv_heads, end - start, layout.head_dim), dtype=layout.dtype)
            for (keys, values), out in zip(job.layers, payload):
                out[0].copy_(keys[0, :, start:end])
                out[1].copy_(values[0, :, start:end])
        header = json.dumps(
            {
                "version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "layout": layout.described(),
                "previous": block.previous.hex(),
                "start": start,
                "tokens": job.token_ids[start:end].tolist(),
                "positions": job.positions[:, start:end].tolist(),
                "images": _spans_in(job.images, start, end),
            }
        ).encode()
        data = payload.view(torch.uint8).numpy()
        temporary = path.parent / f".tmp-{path.stem}-{os.getpid()}-{threading.get_native_id()}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # the folder too, if someone removed it
            remove_entry(temporary)  # a crashed writer's, with this thread's id: never opened as it is
            with os.fdopen(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644), "wb") as f:
                f.write(_HEAD.pack(MAGIC, len(header)))
                f.write(header)
                f.write(data)
                f.write(_TRAILER.pack(zlib.crc32(data, zlib.crc32(header))))
            os.replace(temporary, path)
        except OSError as exc:  # a full disk: the conversation stays in memory only
            remove_entry(temporary)
            self._failed("writing a block", exc)
            return False
        written = _HEAD.size + len(header) + data.nbytes + _TRAILER.size
        self._written_since_scan += written
        self._held += written
        metrics.KV_DISK_WRITTEN_BYTES.inc(written)
        return True

    # -- budget -----------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Sum the files; over the budget, remove the least recently used down to EVICT_TO of it, and
        any temporary file a crashed writer left. One instance at a time (the others skip). Under a
        block's name, what is not a regular file is removed when that touches nothing else; what is
        not named like a block or a temporary is left alone."""
        self._written_since_scan = 0
        try:
            lock = os.open(self.root / ".lock", os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self._failed("its lock file (files not counted)", exc)
            return
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            total = self._evict(self._block_files())
            self._held = total
            metrics.KV_DISK_BYTES.set(total)
        finally:
            os.close(lock)

    def _block_files(self) -> list[tuple[float, int, str]]:
        """(time, size, path) of each block file; stale temporaries and non-files under block names go."""
        files, now = [], time.time()
        try:
            folders = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.warning("KV disk tier: cannot list %s: %s", self.root, exc)
            return files
        for folder in folders:
            try:
                entries = list(os.scandir(folder.path))
            except OSError:
                continue
            for entry in entries:
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                kind = kind_of(stat.st_mode)
                if entry.name.startswith(".tmp-"):
                    if now - stat.st_mtime > STALE_TEMPORARY_SECONDS:
                        remove_entry(Path(entry.path))
                elif not entry.name.endswith(".kv"):
                    continue
                elif kind is None:
                    files.append((stat.st_mtime, stat.st_size, entry.path))
                elif remove_entry(Path(entry.path)):
                    log.warning("KV disk tier: removed %s (a %s, not a block)", entry.path, kind)
        return files

    def _evict(self, files: list[tuple[float, int, str]]) -> int:
        """Over the budget, remove the least recently used files down to EVICT_TO of it; the bytes left."""
        total = sum(size for _, size, _ in files)
        if total > self.budget_bytes:
            files.sort()
            for _, size, path in files:
                if total <= self.budget_bytes * EVICT_TO:
                    break
                remove_entry(Path(path))
                total -= size
                metrics.CACHE_EVICTIONS.labels(cache=self.name, reason="bytes").inc()
        return total


def _spans_in(images: list[VisionSpan], start: int, end: int) -> list[list]:
    """[start, end, key] of each picture and clip starting in tokens [start, end), in token order."""
    return sorted([s.start, s.end, s.key] for s in images if start <= s.start < end)


def _well_formed(header: dict, tokens: int) -> bool:
    """Whether a header has every field a read compares, of the right types and lengths."""
    positions = header.get("positions")
    return (
        isinstance(header.get("start"), int)
        and isinstance(header.get("previous"), str)
        and isinstance(header.get("images"), list)
        and all(
            isinstance(s, list) and len(s) == 3 and isinstance(s[0], int) and isinstance(s[1], int)
            for s in header["images"]
        )
        and isinstance(positions, list)
        and len(positions) == 3
        and all(isinstance(axis, list) and len(axis) == tokens for axis in positions)
    )


def _differs(
    header: dict, block: Block, token_ids: torch.Tensor, positions: torch.Tensor, images: list[VisionSpan]
) -> str | None:
    """What in a block's header differs from what the request needs of tokens [block.start, block.end)
    — everything its name stands for —, or None: the chain key before it (the fingerprint and every
    token, position and picture before it), its start, tokens, M-RoPE positions, and each picture's
    and clip's content key and span."""
    start, end = block.start, block.end
    used = end - start
    if header["previous"] != block.previous.hex():
        return "it follows another prefix"
    if header["start"] != start:
        return f"it starts at token {header['start']}"
    if header["tokens"][:used] != token_ids[start:end].tolist():
        return "other tokens"
    if [axis[:used] for axis in header["positions"]] != positions[:, start:end].tolist():
        return "other M-RoPE positions"
    if sorted(s for s in header["images"] if s[0] < end) != _spans_in(images, start, end):
        return "other pictures or clips"
    return None


def _touch(path: Path) -> None:
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass


def _size(path: Path) -> int:
    """A block file's size; 0 if it is gone (another instance's eviction) or not a regular file."""
    try:
        status = path.lstat()
    except FileNotFoundError:
        return 0
    return status.st_size if kind_of(status.st_mode) is None else 0
