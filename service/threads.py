"""Which threads compute on several cores: one at a time, so libgomp keeps its threads spinning.

A decode step is some 300 short OpenMP parallel regions (every Linear, norm and attention call).
Between two, libgomp keeps a team's threads spinning, so the next region starts at once — but only
while it manages no more threads than there are CPUs; past that it puts them to sleep almost at
once, and every region pays a wake-up. Measured on 2 cores: the same decode step 35–50 ms on a
thread alone, 80–95 ms once another thread kept a team of its own (bench notes in
docs/quantization.md). And torch.set_num_threads(n) sets n not only for the calling thread but as
the default every other thread takes at its first parallel op: a request thread resizing a picture
then keeps a team of its own for good.

So only one long-lived thread computes on THREADS cores — the engine's scheduler — and threads that
compute on several for a while (the loader, the kernel probe) end when done, taking their team with
them; every other thread computes on one. `compute_on(n)` gives the calling thread n and puts the
default for the others back to one; `service/__init__.py` makes one the default from the start
(OMP_NUM_THREADS=1, set before torch loads).
"""

from __future__ import annotations

import threading

import torch


def compute_on(threads: int) -> None:
    """The calling thread's parallel ops run on `threads` threads; every thread that has not yet
    computed keeps the default of one."""
    torch.set_num_threads(threads)
    torch.get_num_threads()  # torch's per-thread setup now, while the default is `threads` (it reads it once)
    if threads != 1:  # torch offers no other way to set the default without setting a thread's own
        reset = threading.Thread(target=torch.set_num_threads, args=(1,), name="thread-default")
        reset.start()
        reset.join()


def in_own_thread(work, threads: int, name: str):
    """`work()` on a thread of its own computing on `threads` threads (its OpenMP team ends with it:
    the caller never holds one; a process that forks afterwards — Gunicorn's preloading master — must
    not have started one on its main thread either). Returns its result or raises its exception."""
    out = {}

    def run():
        try:
            compute_on(threads)
            out["value"] = work()
        except BaseException as exc:  # re-raised in the caller
            out["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
