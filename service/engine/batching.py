"""Continuous batching: one scheduler thread owns the model and decodes all running sequences together.

A decode step is one forward of the language model over every running sequence (input ids B × 1),
so the weights are read once for B tokens; decoding on these CPUs is memory-bound, so B tokens
cost little more than one. A sequence joins the batch at the first step after its prefill and
leaves the moment it finishes or is cancelled.

Prefill is a generator (`Sequence.prefill`, written by the engine) that yields after each unit of
work — a vision-encoder block, a chunk of prompt tokens — or, while the disk tier reads its cached
prefix on a thread of its own, the read in progress. The scheduler interleaves: one unit of
the oldest waiting prefill, then one decode step of the batch, and again. A running stream so
waits at most one unit per token while a neighbour prefills; with nothing to decode, prefill runs
back to back.

Each sequence keeps what makes it independent of its neighbours: its sampling (`Sampler`, with
its own torch.Generator), its M-RoPE offset (`rope_delta`: its decode positions are exactly those
it would get alone) and its own KV cache, which the forward (service/model/forward.py) attends to
and extends in place: no padding, nothing to re-pack when a sequence joins or leaves, and a
sequence's tokens are the ones it gets alone (INT8 included: its Linears quantize per token).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .. import metrics
from ..answer.structured import Constraint
from ..model.forward import Rows, TextForward
from ..threads import compute_on
from .drafts import DraftBudget
from .sampling import Sampler
from .streaming import TokenStream

log = logging.getLogger(__name__)

# Guessed tokens verified in one decode step, all sequences together: a step's rows stay few enough
# that reading each weight once still bounds its time (measured: bench_speculative).
VERIFY_ROWS = 12
# Seconds an idle scheduler waits at a time for a prefill's read from the disk tier (new requests
# are looked at between waits).
READ_WAIT = 0.05


@dataclass
class Prefilled:
    """What a finished prefill hands the scheduler."""

    cache: DynamicCache  # the whole prompt's keys and values
    logits: torch.Tensor  # 1 × vocab, after the prompt's last token
    rope_delta: int  # M-RoPE position minus token index, for every token after the prompt


@dataclass(eq=False)
class Sequence:
    """One request inside the scheduler. The engine fills the first fields; the scheduler the rest
    and calls `on_leave(sequence)` on its thread when the sequence leaves (the KV cache is then
    in `cache`, or None if it never finished prefill), then sets `done`."""

    prompt_ids: list[int]
    prefill: Generator[object, None, Prefilled]  # yields None, or a Future it waits for
    sampler: Sampler
    streamer: TokenStream
    cancel: threading.Event
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    on_leave: Callable[[Sequence], None]
    constraint: Constraint | None = None  # its grammar's state (structured output), if any
    drafts: DraftBudget | None = None  # its guesses for speculative decoding (service/engine/drafts.py), if on
    deadline: float | None = None  # perf_counter time at which it is ended like a cancelled one
    submitted_at: float = field(default_factory=time.perf_counter)
    prefill_started_at: float | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt and answer, once prefilled
    rope_delta: int = 0
    cache: DynamicCache | None = None  # its KV cache once prefilled (the decode step extends it)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        generated = len(self.token_ids) - len(self.prompt_ids)
        return generated >= self.max_new_tokens or (generated > 0 and self.token_ids[-1] in self.eos_token_ids)

    def stopped(self, now: float) -> bool:
        """Cancelled (client gone, stop string, shutdown) or past its deadline (which cancels it)."""
        if self.deadline is not None and now >= self.deadline:
            self.cancel.set()
        return self.cancel.is_set()

    def accept(self, logits: torch.Tensor) -> int:
        """Choose the next token from its logits (within its grammar) and stream it."""
        if self.constraint is None:
            token = self.sampler(self.token_ids, logits)
        else:
            token = self.sampler(self.token_ids, logits, self.constraint.allowed())
            self.constraint.advance(token)
        self.token_ids.append(token)
        self.streamer.put_token(token)
        return token

    def guesses(self, room: int) -> tuple[list[int], bool]:
        """This step's guessed tokens (at most `room`, and never past its token limit), and
        whether they came from prompt lookup."""
        if self.drafts is None:
            return [], False
        left = self.max_new_tokens - (len(self.token_ids) - len(self.prompt_ids)) - 1
        return self.drafts.drafts(self.token_ids, self.constraint, min(room, left))

    def verify(self, logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
        """Choose a token from each row of `logits` (the rows fed: the last token, then `drafts`)
        while the model makes the guessed one: the guesses it made and its own next token are the
        step's tokens; the rows of the others leave the KV cache. Returns how many guesses were
        compared with the model's token (not those after the end of the answer) and how many it made."""
        compared = accepted = 0
        for i, row in enumerate(logits):
            token = self.accept(row[None])
            if i == len(drafts):
                break
            compared += 1
            if token != drafts[i]:
                break
            accepted += 1
            if self.finished:
                break
        # The cache holds every token but the last made (the next step feeds it), as without guesses.
        surplus = self.cache.get_seq_length() - (len(self.token_ids) - 1)
        if surplus > 0:
            self.cache.crop(-surplus)
        return compared, accepted


class Scheduler:
    """Runs sequences on one model; see the module docstring. `submit` from any thread."""

    def __init__(self, forward: TextForward, threads: int):
        self.forward = forward
        self.threads = threads
        self._wake = threading.Condition()
        self._inbox: list[Sequence] = []
        self._waiting: deque[Sequence] = deque()  # prefilling, oldest first
        self._running: list[Sequence] = []
        self._thread: threading.Thread | None = None

    @property
    def batch_size(self) -> int:
        return len(self._running)

    def submit(self, sequence: Sequence) -> None:
        with self._wake:
            self._inbox.append(sequence)
            # Started on first use, i.e. in the process that serves (threads do not survive a fork).
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="batch-scheduler", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _loop(self) -> None:
        # This thread's own OpenMP setting (each thread has one) and torch's: the model may have been
        # loaded on one thread, to fork safely after it (gunicorn.conf.py's preload).
        compute_on(self.threads)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._inbox or self._waiting or self._running):
                        self._wake.wait()
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                in_hand = [*self._running, *self._waiting]
                try:
                    self._drop_cancelled()
                    if self._waiting:
                        self._prefill_step(self._waiting[0])
                    if self._running:
                        self._decode_step()
                except Exception as exc:  # a bug here must not leave requests waiting forever
                    log.exception("batch scheduler step failed")
                    self._fail([*in_hand, *self._running, *self._waiting], exc)
                metrics.BATCH_SIZE.set(len(self._running))

    def _drop_cancelled(self) -> None:
        now = time.perf_counter()
        for sequence in [s for s in self._waiting if s.stopped(now)]:
            self._waiting.remove(sequence)
            try:
                sequence.prefill.close()  # lets the engine hand back a reused KV prefix
            except Exception as exc:
                sequence.error = exc
            self._leave_alone(sequence)
        self._leave([s for s in self._running if s.stopped(now)])

    def _prefill_step(self, sequence: Sequence) -> None:
        if sequence.prefill_started_at is None:
            sequence.prefill_started_at = time.perf_counter()
            metrics.PREFILL_WAIT.observe(sequence.prefill_started_at - sequence.submitted_at)
        try:
            reading = next(sequence.prefill)
            if reading is not None and not self._running:  # a read from disk: wait a moment, no other work
                concurrent.futures.wait([reading], timeout=READ_WAIT)
            return
        except StopIteration as end:
            prefilled: Prefilled = end.value
        except Exception as exc:  # this request's failure only; re-raised in its own thread
            self._waiting.remove(sequence)
            sequence.error = exc
            self._leave_alone(sequence)
            return
        self._waiting.remove(sequence)
        sequence.token_ids = list(sequence.prompt_ids)
        sequence.rope_delta = prefilled.rope_delta
        sequence.cache = prefilled.cache
        try:
            sequence.accept(prefilled.logits)
        except Exception as exc:
            log.exception("sampling the first token failed")
            sequence.error = exc
            self._leave_alone(sequence)
            return
        metrics.FIRST_TOKEN_WAIT.observe(time.perf_counter() - sequence.submitted_at)
        if sequence.finished:
            self._leave_alone(sequence)
        else:
            self._running.append(sequence)

    def _decode_step(self) -> None:
        """One forward over every running sequence: its last token, then its guesses (exact
        speculative decoding: each row gets the bits it would get alone, so the guesses the model
        makes cost no exactness; rejected rows leave the KV cache as if never written)."""
        running = self._running
        room, ids, positions, rows, plans = VERIFY_ROWS, [], [], [], []
        for sequence in running:
            drafts, looked_up = sequence.guesses(room)
            room -= len(drafts)
            fed = [sequence.token_ids[-1], *drafts]
            # The last token sits at index len - 1; M-RoPE shifts every index by the sequence's delta.
            start = len(sequence.token_ids) - 1 + sequence.rope_delta
            ids += fed
            positions += range(start, start + len(fed))
            rows.append(Rows(sequence.cache, len(fed)))
            plans.append((drafts, looked_up))
        try:
            logits = self.forward(torch.tensor(ids), torch.tensor(positions), rows)
        except Exception as exc:  # their caches' state is unknown now: fail the sequences (caches not kept)
            log.exception("decode step failed for a batch of %d", len(running))
            self._fail(list(running), exc)
            return
        at = 0
        for sequence, row, (drafts, looked_up) in zip(running, rows, plans):
            try:
                compared, accepted = sequence.verify(logits[at : at + row.count], drafts)
                rejected = compared - accepted
                if compared:
                    sequence.drafts.record(compared, accepted, looked_up)
                    source = "lookup" if looked_up else "grammar"
                    metrics.DRAFT_TOKENS.labels(source=source, result="accepted").inc(accepted)
                    metrics.DRAFT_TOKENS.labels(source=source, result="rejected").inc(rejected)
            except Exception as exc:  # this sequence's sampling only: it leaves, its neighbours go on
                log.exception("sampling a token failed")
                sequence.error = exc
            at += row.count
        self._leave([s for s in running if s.finished or s.error is not None])

    def _fail(self, sequences: list[Sequence], exc: Exception) -> None:
        """End `sequences` with `exc` (re-raised in their request threads); their caches are not kept."""
        for sequence in sequences:
            if sequence.done.is_set():
                continue
            if sequence in self._waiting:
                self._waiting.remove(sequence)
                with contextlib.suppress(Exception):
                    sequence.prefill.close()
            sequence.error = exc
            if sequence in self._running:
                self._running.remove(sequence)
            self._leave_alone(sequence)

    def _leave(self, sequences: list[Sequence]) -> None:
        if not sequences:
            return
        for sequence in sequences:
            self._running.remove(sequence)
            self._leave_alone(sequence)

    @staticmethod
    def _leave_alone(sequence: Sequence) -> None:
        try:
            sequence.on_leave(sequence)
        except Exception as exc:
            log.exception("storing a finished sequence failed")
            sequence.error = sequence.error or exc
        finally:
            sequence.streamer.end()
            sequence.done.set()
