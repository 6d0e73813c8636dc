"""Admission to the model: up to `slots` generations at once (the engine's batch), a bounded FIFO of
waiters (the `qwen3vl_queue_depth` gauge), a wait timeout."""

from __future__ import annotations

import threading
import time
from collections import deque

from .. import metrics
from ..errors import QueueFull, Unavailable


class Admission:
    """`acquire()` … `release()` holds one of `slots` places; when all are taken, at most
    `queue_size` more requests wait.

    A request beyond the queue is refused at once (429, Retry-After); one that waits longer than
    `timeout` seconds gets a 503. Waiters are served first come, first served.
    """

    def __init__(self, queue_size: int, timeout: float, retry_after: int = 2, slots: int = 1):
        self.slots = slots
        self.queue_size = queue_size
        self.timeout = timeout
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._in_use = 0
        self._waiters: deque[threading.Event] = deque()

    @property
    def busy(self) -> bool:
        return self._in_use > 0

    def acquire(self, timeout: float | None = None) -> float:
        """Wait for the model; returns the seconds waited. Pair with release()."""
        start = time.perf_counter()
        self._acquire(self.timeout if timeout is None else timeout)
        return time.perf_counter() - start

    def _acquire(self, timeout: float) -> None:
        with self._lock:
            if self._in_use < self.slots and not self._waiters:
                self._in_use += 1
                return
            if len(self._waiters) >= self.queue_size:
                raise QueueFull(
                    f"the server is busy: {len(self._waiters)} requests are already waiting; retry shortly",
                    headers={"Retry-After": str(self.retry_after)},
                )
            turn = threading.Event()
            self._waiters.append(turn)
        metrics.QUEUE_DEPTH.inc()
        try:
            if turn.wait(timeout):
                return  # release() handed the model to us
            with self._lock:
                if turn.is_set():  # handed over just as we timed out
                    return
                self._waiters.remove(turn)
        finally:
            metrics.QUEUE_DEPTH.dec()
        raise Unavailable(
            f"timed out after {timeout:.0f} s waiting for the model; retry later",
            code="queue_timeout",
            headers={"Retry-After": str(self.retry_after)},
        )

    def release(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()  # the slot passes directly: _in_use stays
            else:
                self._in_use -= 1
