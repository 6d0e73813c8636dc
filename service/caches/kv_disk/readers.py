"""Reads with a deadline on a few daemon threads: the disk tier's reader (service/caches/kv_disk/store.py).

A read past its deadline is given up: its Future fails with TimeoutError and the request recomputes.
Python cannot interrupt a thread stuck in the kernel (a hung device), so the read itself runs on; it
holds up neither the other readers nor the process's exit (daemon threads, never joined), and once
every reader is stuck the store says so (`all_stuck`) and lookups skip the disk.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future


class Readers:
    """`size` daemon threads named `name`-N, started on first use (threads do not survive a fork)."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stuck: set[Future] = set()  # given up on, still running

    def submit(self, timeout: float, read: Callable, *args, **kwargs) -> Future:
        """A Future of `read(*args, deadline=..., **kwargs)` (`deadline`: time.monotonic() when it is given
        up, so that it can stop early), or of TimeoutError once `timeout` seconds have passed first."""
        running, waited = Future(), Future()
        deadline = time.monotonic() + timeout
        self._start()
        self._work.put((running, read, args, {**kwargs, "deadline": deadline}))
        timer = threading.Timer(timeout, self._give_up, (running, waited, timeout))
        timer.daemon = True
        timer.start()
        running.add_done_callback(lambda done: (timer.cancel(), _settle(waited, done)))
        return waited

    @property
    def all_stuck(self) -> bool:
        """Every reader is busy with a read given up on: a new one would only wait for its deadline."""
        with self._lock:
            return len(self._stuck) >= self.size

    def _give_up(self, running: Future, waited: Future, timeout: float) -> None:
        if running.cancel():  # still queued behind stuck reads: never runs
            return
        with self._lock:
            if not running.done():
                self._stuck.add(running)
        failed = Future()
        failed.set_exception(TimeoutError(f"no answer from the disk within {timeout:.2f} s"))
        _settle(waited, failed)

    def _start(self) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < self.size:
                thread = threading.Thread(target=self._loop, name=f"{self.name}-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _loop(self) -> None:
        while True:
            future, read, args, kwargs = self._work.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(read(*args, **kwargs))
            except BaseException as exc:  # handed to whoever waits
                future.set_exception(exc)
            with self._lock:
                self._stuck.discard(future)


_settling = threading.Lock()


def _settle(waited: Future, done: Future) -> None:
    """`waited` takes `done`'s outcome unless it has one already (the read and its deadline race)."""
    with _settling:
        if waited.done():
            return
        if done.cancelled():
            waited.set_exception(TimeoutError("given up before it started"))
        elif done.exception() is not None:
            waited.set_exception(done.exception())
        else:
            waited.set_result(done.result())
