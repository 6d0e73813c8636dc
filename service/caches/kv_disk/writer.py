"""The disk tier's writer: kept caches queued from any thread, written block by block on one thread
of low priority behind the decode loop. A file is written whole or not at all (a temporary file,
then a rename); a block already on disk is only touched. A cache a request takes over stops its
queued writes where the request starts extending it in place (`truncate`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ... import metrics
from ...model.prompts import VisionSpan
from .block_files import entry_kind, remove_entry, touch
from .block_format import BlockFormat
from .names import Block, BlockNames, chain
from .states import StateFormat, state_block
from .sweep import Sweeper

log = logging.getLogger(__package__)  # the tier's one logger, named as its package

FLUSH_SECONDS = 10.0  # at exit, waiting for queued writes


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
    # a hybrid model's: (tokens, each layer's state, the multi-token prediction head's hidden state there)
    states: list[tuple[int, list, torch.Tensor | None]] = field(default_factory=list)


class BlockWriter:
    """Writes the store's blocks (named by `names`, in `block_format`) on its own thread while `usable()`
    says the folder is; `sweeper` keeps the budget between writes; `failed(what, exc)` hears of a write that failed.
    `queue`, `truncate` and `flush` from any thread."""

    def __init__(
        self,
        names: BlockNames,
        block_format: BlockFormat,
        sweeper: Sweeper,
        usable: Callable[[], bool],
        failed: Callable[[str, OSError], None],
        state_format: StateFormat | None = None,
    ):
        self.names, self.format, self.sweeper, self.state_format = names, block_format, sweeper, state_format
        self.usable, self.failed = usable, failed
        self._jobs: queue.Queue[_Write] = queue.Queue()
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache → its queued _Writes
        self._pending_lock = threading.Lock()
        self._unfinished = 0
        self._idle = threading.Condition()
        self._threads_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def queue(
        self,
        cache,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        namespace: str,
        states: list[tuple[int, list, torch.Tensor | None]] = (),
    ) -> None:
        """Queue `cache`'s keys and values (`layers`, covering `token_ids`) for the writer thread, and a
        hybrid model's recurrent `states` ((tokens, each linear layer's (conv, state), the head's hidden
        state or None): copies, unchanging)."""
        job = _Write(
            layers, token_ids, positions, images, len(token_ids), weakref.ref(cache), namespace, states=list(states)
        )
        with self._pending_lock:
            self._pending.setdefault(cache, []).append(job)
        with self._idle:
            self._unfinished += 1
        metrics.KV_DISK_PENDING.inc()
        self._start()
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

    def _start(self) -> None:
        # Started on first use, i.e. in the process that serves (threads do not survive a fork).
        with self._threads_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kv-disk-write", daemon=True)
                self._thread.start()
                atexit.register(self._flush_at_exit)

    def _flush_at_exit(self) -> None:
        if not self.flush(FLUSH_SECONDS):
            log.warning("KV disk tier: %d conversations not written at exit", self._unfinished)

    def _loop(self) -> None:
        try:  # behind the decode loop: a writer never takes a core from it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
        self.sweeper.scan()
        while True:
            job = self._jobs.get()
            try:
                if self.usable():
                    self._write(job)
                if self.sweeper.due():
                    self.sweeper.scan()  # before the job counts as done: a flush returns within the budget
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
        job.layers, job.states = [], []

    def _write(self, job: _Write) -> None:
        length, previous, end = len(job.token_ids), self.names.seed_of(job.namespace), 0
        for block, key in self.names.full_blocks(job.token_ids, job.positions, job.images, length, job.namespace):
            if not self._write_block(job, block):
                return
            previous, end = key, block.end
        if end < length:  # the tail: what follows the last full block
            key = chain(previous, job.token_ids, job.positions, end, length, job.images)
            if not self._write_block(job, Block(self.names.path(previous, key), end, length, previous)):
                return
        for tokens, states, hidden in job.states:
            if tokens <= job.limit:
                self._write_state(job, tokens, states, hidden)

    def _write_state(self, job: _Write, tokens: int, states: list, hidden) -> None:
        """A hybrid model's recurrent state at `tokens` (and the head's `hidden` state there, if it
        drafts with one), unless on disk already (states.py)."""
        block = state_block(self.names, job.token_ids, job.positions, job.images, tokens, job.namespace)
        kind = entry_kind(block.path)
        if kind == "file":
            touch(block.path)
            return
        if kind is not None and not remove_entry(block.path):
            return
        try:
            written = self.state_format.write(
                block.path, block, job.token_ids, job.positions, job.images, states, hidden
            )
        except OSError as exc:
            self.failed("writing a recurrent state", exc)
            return
        self.sweeper.wrote(written)
        metrics.KV_DISK_WRITTEN_BYTES.inc(written)

    def _write_block(self, job: _Write, block: Block) -> bool:
        """Write the block's tokens unless on disk already; False once past the job's limit or when
        it cannot be written."""
        path, start, end = block.path, block.start, block.end
        kind = entry_kind(path)
        if kind == "file":
            touch(path)  # in use again: last to be evicted
            return True
        if kind is not None and not remove_entry(path):
            log.warning("KV disk tier: %s is a %s holding files, not a block; not written there", path, kind)
            return False
        layout = self.format.layout
        with job.lock:
            if end > job.limit:
                return False
            shape = (layout.stored_layers, 2, layout.kv_heads, end - start, layout.head_dim)
            payload = torch.empty(shape, dtype=layout.dtype)
            for (keys, values), out in zip(job.layers, payload):
                out[0].copy_(keys[0, :, start:end])
                out[1].copy_(values[0, :, start:end])
        header = self.format.header(block, job.token_ids, job.positions, job.images)
        temporary = path.parent / f".tmp-{path.stem}-{os.getpid()}-{threading.get_native_id()}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # the folder too, if someone removed it
            remove_entry(temporary)  # a crashed writer's, with this thread's id: never opened as it is
            with os.fdopen(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644), "wb") as f:
                written = self.format.write(f, header, payload)
            os.replace(temporary, path)
        except OSError as exc:  # a full disk: the conversation stays in memory only
            remove_entry(temporary)
            self.failed("writing a block", exc)
            return False
        self.sweeper.wrote(written)
        metrics.KV_DISK_WRITTEN_BYTES.inc(written)
        return True
