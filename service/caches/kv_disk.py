"""The conversation cache's disk tier: the keys and values of every kept conversation, in files under
KV_DISK_DIR that outlive evictions, restarts and crashes, shared by the instances of a machine.

Content-addressed blocks. A conversation's keys and values are cut into blocks of BLOCK_TOKENS
tokens (and a shorter tail at its end); a block's file is named by a hash chained over everything
its keys and values depend on — the store's fingerprint (checkpoint, quantization, vision encoder,
KV layout), every token before and in it, and the picture (pixels and grid) behind each image or
video that starts there — and the request's cache namespace (its tenant and cache_salt, an opaque keyed
hash: service/api/tenants.py), which seeds the chain: one tenant's lookups never find another's files,
and a file name holds a tenant only as a hash keyed with that hash (a header not at all). The name
alone finds a prefix: a lookup hashes the prompt block by block
and stats names until one is missing, so there is no index to rebuild or to keep consistent between
instances, a prefix shared by conversations (a system prompt, a picture) is stored once, and a
second turn writes only its new blocks. Keys and values are the same bits whichever path computed
them (service/model/forward.py), so a block written by any instance serves any other.

A file is written whole or not at all (temporary file, then rename) and read only after its header
(format version, fingerprint, KV layout, its own tokens) and a CRC-32 of all its bytes check out: a
foreign, truncated or corrupted file is removed and counted, never used. Writes run on a writer
thread of low priority, reads on a reader thread, never on the scheduler's; the budget (KV_DISK_MB)
is kept by removing the least recently used files (a hit refreshes a file's time), under a lock
file so that two instances do not both evict.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import metrics
from ..memory import kv_shape
from ..model.kv import GrowingCache
from ..model.prompts import VisionSpan
from ..native import huge_pages
from .conversation import KVReuse

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64  # 7 MiB of bf16 keys and values on Qwen3-VL-2B: a few files per picture
FORMAT_VERSION = 1
MAGIC = b"QVLKV\0\0\1"
_HEAD = struct.Struct("<8sI")  # magic, header length
_TRAILER = struct.Struct("<I")  # CRC-32 of header and payload
EVICT_TO = 0.9  # of the budget, once over it
SCAN_EVERY = 0.05  # of the budget written between two scans of the folder (other instances write too)
STALE_TEMPORARY_SECONDS = 3600.0  # a writer's unfinished file older than this was left by a crash
FLUSH_SECONDS = 10.0  # at exit, waiting for queued writes
MAX_CANDIDATES = 64  # blocks stored after one prefix whose headers a lookup reads, at most


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
    """Tokens [start, end) of a sequence, from the file at `path` (which may hold more: up to `stored`)."""

    path: Path
    start: int
    end: int
    stored: int | None = None


@dataclass(eq=False)
class _Write:
    """A kept cache's keys and values waiting for the writer. `limit` falls when a request takes the
    cache over (it then writes its own tokens from there on, in place); blocks past it are not written."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    token_ids: torch.Tensor
    images: list[VisionSpan]
    limit: int
    owner: weakref.ref  # the cache it was queued from
    namespace: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class Rejected(Exception):
    """A file that must not be used: `reason` is foreign, truncated or corrupt."""

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


def default_budget_bytes(root: Path, held: int = 0) -> int:
    """A quarter of the disk's free space, the store's own files counted as free, at most 64 GiB."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    return min(64 * 1024**3, (shutil.disk_usage(probe).free + held) // 4)


class KVDiskStore:
    """See the module docstring. `stored_blocks`, `read_async`, `save` and `truncate` from any thread."""

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
        self._reader: ThreadPoolExecutor | None = None
        self._written_since_scan = 0
        self._held = 0  # bytes of the files at the last scan, plus this instance's writes since
        self.root.mkdir(parents=True, exist_ok=True)

    # -- names ------------------------------------------------------------------------------------

    def _chain(self, previous: bytes, token_ids: torch.Tensor, start: int, end: int, images: list[VisionSpan]) -> bytes:
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(struct.pack("<qq", start, end))
        digest.update(token_ids[start:end].to(torch.int64).numpy().tobytes())
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

    def _full_blocks(self, token_ids: torch.Tensor, images: list[VisionSpan], length: int, namespace: str = ""):
        """(Block, chain key before it, its own) of each full block within `length` tokens, in order."""
        previous = self._seed_of(namespace)
        for start in range(0, length - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = self._chain(previous, token_ids, start, start + BLOCK_TOKENS, images)
            yield Block(self._path(previous, key), start, start + BLOCK_TOKENS), previous, key
            previous = key

    # -- lookup -----------------------------------------------------------------------------------

    def stored_blocks(
        self, token_ids: torch.Tensor, images: list[VisionSpan], limit: int, namespace: str = ""
    ) -> tuple[list[Block], bytes]:
        """The full blocks of `token_ids`' first `limit` tokens on disk in `namespace`'s chain, up to the
        first missing one, and the chain key after them (what `read` continues from, as its `stored`).
        Hashes and stats only: no file is read."""
        blocks, after = [], self._seed_of(namespace)
        for block, _, key in self._full_blocks(token_ids, images, limit, namespace):
            if not block.path.exists():
                break
            blocks.append(block)
            after = key
        return blocks, after

    def read_async(self, token_ids, images, limit: int, capacity: int, beat: int, stored=None) -> Future:
        """`read` on the reader thread."""
        with self._threads_lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        return self._reader.submit(self.read, token_ids, images, limit, capacity, beat, stored)

    def read(
        self,
        token_ids: torch.Tensor,
        images: list[VisionSpan],
        limit: int,
        capacity: int,
        beat: int = 0,
        stored: tuple[list[Block], bytes] | None = None,
    ) -> KVReuse | None:
        """The keys and values of the longest prefix of `token_ids` the disk holds (at most `limit`
        tokens, no image split), in a cache with room for `capacity` positions — the stored full
        blocks (`stored`: what `stored_blocks` found already), then as much of a block stored after
        them as matches (a re-tokenized answer, a tail) — or None when that is under `min_tokens` or
        not more than `beat` tokens (the memory tier's)."""
        started = time.perf_counter()
        blocks, after = stored or self.stored_blocks(token_ids, images, limit)
        blocks = list(blocks)
        start = blocks[-1].end if blocks else 0
        continuation = self._continuation(after, token_ids, images, start, limit)
        if continuation is not None:
            blocks.append(continuation)
        tokens = whole_images(blocks[-1].end if blocks else 0, images)
        if tokens < self.min_tokens or tokens <= beat:
            metrics.CACHE_MISSES.labels(cache=self.name).inc()
            return None
        reuse = self._load(blocks, tokens, token_ids, images, max(capacity, tokens))
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
        most leading tokens (and pictures) with `token_ids`, as a Block of those tokens."""
        if previous == self._seed:
            return None  # every conversation's first block follows the seed: too many to look through
        prefix, best = previous.hex(), None
        try:
            candidates = [e.path for e in os.scandir(self.root / prefix[:2]) if e.name.startswith(prefix)]
        except FileNotFoundError:
            return None
        del candidates[MAX_CANDIDATES:]  # a prefix many conversations continue (a long system prompt)
        ours = token_ids[start:limit].tolist()
        for path in candidates:
            try:
                with open(path, "rb") as f:
                    header = self._header(f, Path(path))
            except FileNotFoundError:
                continue
            except Rejected as bad:
                self._reject(Path(path), bad)
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
                best = Block(Path(path), start, start + shared, start + len(theirs))
        return best

    def _load(
        self, blocks: list[Block], tokens: int, token_ids: torch.Tensor, images: list[VisionSpan], capacity: int
    ) -> KVReuse | None:
        """A cache of the blocks' keys and values for the first `tokens` tokens; shorter if a block went
        missing or was rejected on the way; None under `min_tokens`."""
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
            if block.start >= tokens:
                break
            payload = self._read(block, token_ids)
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

    def _read(self, block: Block, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The block's keys and values (layers × 2 × heads × stored tokens × head_dim), or None if it is
        gone (evicted meanwhile) or was rejected (then removed)."""
        try:
            f = open(block.path, "rb")
        except FileNotFoundError:
            return None
        try:
            with f:
                header = self._header(f, block.path)
                if (
                    header["start"] != block.start
                    or header["tokens"][: block.end - block.start] != token_ids[block.start : block.end].tolist()
                ):
                    raise Rejected("corrupt", "another block's tokens")
                return self._payload(f, header)
        except Rejected as bad:
            self._reject(block.path, bad)
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
        if not isinstance(header.get("start"), int) or not isinstance(header.get("images"), list):
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
        log.warning("KV disk tier: removed %s (%s: %s); it was not used", path, bad.reason, bad)
        metrics.KV_DISK_REJECTED.labels(reason=bad.reason).inc()
        _remove(path)

    # -- writes -----------------------------------------------------------------------------------

    def save(self, cache, token_ids: torch.Tensor, images: list[VisionSpan], namespace: str = "") -> None:
        """Queue a kept cache's keys and values (covering `token_ids`, in `namespace`'s chain) for the
        writer; returns at once."""
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        if not layers or layers[0][0].dtype != self.layout.dtype or len(token_ids) < self.min_tokens:
            return
        spans = [s for s in images if s.start < len(token_ids)]
        job = _Write(layers, token_ids, spans, len(token_ids), weakref.ref(cache), namespace)
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
        for block, _, key in self._full_blocks(job.token_ids, job.images, length, job.namespace):
            if not self._write_block(job, block.path, block.start, block.end):
                return
            previous, end = key, block.end
        if end < length:  # the tail: what follows the last full block
            key = self._chain(previous, job.token_ids, end, length, job.images)
            self._write_block(job, self._path(previous, key), end, length)

    def _write_block(self, job: _Write, path: Path, start: int, end: int) -> bool:
        """Write tokens [start, end) unless on disk already; False once past the job's limit."""
        if path.exists():
            _touch(path)  # in use again: last to be evicted
            return True
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
                "start": start,
                "tokens": job.token_ids[start:end].tolist(),
                "images": [[s.start, s.end, s.key] for s in job.images if start <= s.start < end],
            }
        ).encode()
        data = payload.view(torch.uint8).numpy()
        path.parent.mkdir(exist_ok=True)
        temporary = path.parent / f".tmp-{path.stem}-{os.getpid()}-{threading.get_native_id()}"
        try:
            with open(temporary, "wb") as f:
                f.write(_HEAD.pack(MAGIC, len(header)))
                f.write(header)
                f.write(data)
                f.write(_TRAILER.pack(zlib.crc32(data, zlib.crc32(header))))
            os.replace(temporary, path)
        except OSError as exc:  # a full disk: the conversation stays in memory only
            _remove(temporary)
            log.warning("KV disk tier: could not write %s: %s", path, exc)
            return False
        written = _HEAD.size + len(header) + data.nbytes + _TRAILER.size
        self._written_since_scan += written
        self._held += written
        metrics.KV_DISK_WRITTEN_BYTES.inc(written)
        return True

    # -- budget -----------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Sum the files; over the budget, remove the least recently used down to EVICT_TO of it, and
        any temporary file a crashed writer left. One instance at a time (the others skip)."""
        self._written_since_scan = 0
        with open(self.root / ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            files, now = [], time.time()
            for folder in self.root.iterdir():
                if not folder.is_dir():
                    continue
                for entry in os.scandir(folder):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith(".tmp-"):
                        if now - stat.st_mtime > STALE_TEMPORARY_SECONDS:
                            _remove(Path(entry.path))
                    elif entry.name.endswith(".kv"):
                        files.append((stat.st_mtime, stat.st_size, entry.path))
            total = sum(size for _, size, _ in files)
            if total > self.budget_bytes:
                files.sort()
                for _, size, path in files:
                    if total <= self.budget_bytes * EVICT_TO:
                        break
                    _remove(Path(path))
                    total -= size
                    metrics.CACHE_EVICTIONS.labels(cache=self.name, reason="bytes").inc()
            self._held = total
            metrics.KV_DISK_BYTES.set(total)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # removed meanwhile (another instance's eviction)
        return 0


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
