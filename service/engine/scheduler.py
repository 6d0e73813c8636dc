"""Continuous batching: one scheduler thread owns the model and decodes all running sequences together.

A decode step is one forward of the language model over every running sequence (input ids B × 1),
so the weights are read once for B tokens; decoding on these CPUs is memory-bound, so B tokens
cost little more than one. A sequence joins the batch at the first step after its prefill and
leaves the moment it finishes or is cancelled.

Prefill is a generator (`Sequence.prefill`, written by the engine) that yields after each unit of
work — a vision-encoder block, a chunk of prompt tokens — or, while the disk tier reads its cached
prefix on a thread of its own, the read in progress. The scheduler interleaves: one unit of
the most urgent waiting prefill (the oldest among equals), then one decode step of the batch, and
again. A running stream so waits at most one unit per token while a neighbour prefills; with
nothing to decode, prefill runs back to back — and so it does while the prefill is more urgent than
every running sequence (a lower `priority`): interactive requests reach their first token as on an
idle server while background work waits. A prefill waiting for its disk read is parked (READING)
until the read is done: the prefills behind it go on meanwhile, so a slow read holds up no one else.

Preemption (service/engine/admission.py decides): a sequence whose place went to a more urgent
request is PAUSED at the next step — taken out of the steps, its state untouched — and resumed when
admission gives it a place back; nothing it computes depends on when, so its answer is the same.

A search request (embeddings, relevance scores: service/engine/search.py) is a waiting record of the
same kind whose prefill steps are all its work — a forward over many inputs' rows each — and which
leaves with their result instead of joining the decode batch.

Every transition of a sequence's status (service/engine/sequence.py) is made here, on this thread,
where it happens — but one: a stop string, which the request's thread finds in the text.

Each sequence keeps what makes it independent of its neighbours: its sampling (`Sampler`, with
its own torch.Generator), its M-RoPE offset (`rope_delta`: its decode positions are exactly those
it would get alone) and its own KV cache, which the forward (service/model/forward.py) attends to
and extends in place: no padding, nothing to re-pack when a sequence joins or leaves, and a
sequence's tokens are the ones it gets alone (INT8 included: its Linears quantize per token).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from .. import metrics
from ..model.forward import Rows, TextForward
from ..threads import compute_on
from .drafts import Guesses
from .mtp_drafts import HeadDrafts
from .sequence import Prefilled, Sequence, Status

log = logging.getLogger(__name__)

# Guessed tokens verified in one decode step, all sequences together: a step's rows stay few enough
# that reading each weight once still bounds its time (measured: bench_speculative).
VERIFY_ROWS = 12
# Seconds an idle scheduler waits at a time while prefills wait for disk reads (a finished read
# wakes it at once; new requests and cancellations are looked at between waits).
READ_WAIT = 0.05


class Scheduler:
    """Runs sequences on one model; see the module docstring. `submit` and `cancel_all` from any thread."""

    def __init__(self, forward: TextForward, threads: int, head: HeadDrafts | None = None):
        self.forward = forward
        self.threads = threads
        self.head = head  # the multi-token prediction head's guesses (service/engine/mtp_drafts.py), if it drafts
        self._wake = threading.Condition()
        self._inbox: list[Sequence] = []
        self._waiting: list[Sequence] = []  # WAITING, READING or PREFILLING, oldest first
        self._running: list[Sequence] = []
        self._paused: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

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

    def cancel_all(self) -> None:
        """End every sequence at the next step (graceful shutdown)."""
        with self._wake:
            for sequence in [*self._inbox, *self._waiting, *self._running, *self._paused]:
                sequence.cancel()
            self._wake.notify()

    def stop(self, timeout: float) -> bool:
        """End every sequence and let the thread finish its step and return (at most `timeout`
        seconds); whether it did. A process that exits while this thread is inside torch aborts
        ("terminate called without an active exception"): the interpreter ends a daemon thread that
        wants the GIL back by unwinding it through C++ frames that may not unwind."""
        with self._wake:
            self._stopping = True
            thread = self._thread
        self.cancel_all()
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def wake(self, _=None) -> None:
        """Look at the sequences now (a read finished; admission paused or resumed one)."""
        with self._wake:
            self._wake.notify()

    def _next_prefill(self) -> Sequence | None:
        """The most urgent prefill (the oldest among equals) not parked on a disk read."""
        ready, now = [s for s in self._waiting if s.reading is None or s.reading.done()], time.perf_counter()
        return min(ready, key=lambda s: s.ticket.rank(now), default=None)

    def _resumable(self) -> bool:
        return any(not s.ticket.paused for s in self._paused)

    def _follow_admission(self) -> None:
        """Sequences whose place went to a more urgent request pause; those given one back resume."""
        for queue in (self._running, self._waiting):
            for sequence in [s for s in queue if s.ticket.paused]:
                queue.remove(sequence)
                sequence.pause()
                self._paused.append(sequence)
        for sequence in [s for s in self._paused if not s.ticket.paused]:
            self._paused.remove(sequence)
            (self._running if sequence.resume() is Status.RUNNING else self._waiting).append(sequence)
        self._waiting.sort(key=lambda s: s.ticket.order)  # a resumed prefill takes its old turn back

    def _loop(self) -> None:
        # This thread's own OpenMP setting (each thread has one) and torch's: the model may have been
        # loaded on one thread, to fork safely after it (gunicorn.conf.py's preload).
        compute_on(self.threads)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._inbox or self._running or self._next_prefill() or self._resumable()):
                        if self._stopping and not (self._waiting or self._paused):
                            return
                        # Only parked reads left (a finished read wakes us), or nothing at all.
                        self._wake.wait(READ_WAIT if self._waiting else None)
                        if self._waiting:
                            break  # look at cancellations and deadlines
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                in_hand = [*self._running, *self._waiting, *self._paused]
                try:
                    self._follow_admission()
                    self._drop_ended()
                    ready = self._next_prefill()
                    if ready is not None:
                        self._prefill_step(ready)
                    if self._running and not (ready is not None and self._outranks(ready)):
                        self._decode_step()
                except Exception as exc:  # a bug here must not leave requests waiting forever
                    log.exception("batch scheduler step failed")
                    self._fail([*in_hand, *self._running, *self._waiting, *self._paused], exc)
                metrics.BATCH_SIZE.set(len(self._running))

    def _outranks(self, prefilling: Sequence) -> bool:
        """Whether a prefill is more urgent than every running sequence (they wait for it)."""
        now = time.perf_counter()
        return all(prefilling.ticket.urgency(now) < s.ticket.urgency(now) for s in self._running)

    def _drop_ended(self) -> None:
        """Sequences asked to end (client gone, stop string, shutdown) or past their deadline leave."""
        now = time.perf_counter()
        for queue in (self._waiting, self._running, self._paused):
            for sequence in list(queue):
                status = sequence.ending(now)
                if status is None:
                    continue
                queue.remove(sequence)
                prefilling = sequence.in_prefill
                sequence.finish(status)
                if prefilling:
                    try:
                        sequence.prefill.close()  # lets the engine hand back a reused KV prefix
                    except Exception as exc:
                        sequence.error = exc
                self._leave_alone(sequence)

    def _prefill_step(self, sequence: Sequence) -> None:
        if sequence.status is Status.WAITING:
            sequence.prefill_started_at = time.perf_counter()
            metrics.PREFILL_WAIT.observe(sequence.prefill_started_at - sequence.submitted_at)
        sequence.status, sequence.reading = Status.PREFILLING, None
        try:
            reading = next(sequence.prefill)
            if reading is not None:  # a read from disk: parked until it is done
                sequence.status, sequence.reading = Status.READING, reading
                reading.add_done_callback(self.wake)
            return
        except StopIteration as end:
            prefilled: Prefilled = end.value
        except Exception as exc:  # this request's failure only; re-raised in its own thread
            self._waiting.remove(sequence)
            self._end_with_error(sequence, exc)
            return
        self._waiting.remove(sequence)
        if not isinstance(prefilled, Prefilled):  # a search job's result (service/engine/search.py): all its work
            sequence.result = prefilled
            sequence.finish(Status.FINISHED_STOP)
            self._leave_alone(sequence)
            return
        try:
            sequence.start_decoding(prefilled)
        except Exception as exc:
            log.exception("sampling the first token failed")
            self._end_with_error(sequence, exc)
            return
        metrics.FIRST_TOKEN_WAIT.observe(time.perf_counter() - sequence.submitted_at)
        end = sequence.reached_end()
        if end is not None:
            sequence.finish(end)
            self._leave_alone(sequence)
        else:
            self._running.append(sequence)

    def _decode_step(self) -> None:
        """One forward over every running sequence: its last token, then its guesses (exact
        speculative decoding: each row gets the bits it would get alone, so the guesses the model
        makes cost no exactness; rejected rows leave the KV cache as if never written)."""
        running = self._running
        room, guesses = VERIFY_ROWS, []
        for sequence in running:
            guess = sequence.guesses(room)
            room -= len(guess.tokens) + guess.wanted
            guesses.append(guess)
        ids, positions, rows = [], [], []
        try:
            self._head_guesses(running, guesses)
            for sequence, guess in zip(running, guesses):
                fed = [sequence.token_ids[-1], *guess.tokens]
                # The last token sits at index len - 1; M-RoPE shifts every index by the sequence's delta.
                start = len(sequence.token_ids) - 1 + sequence.rope_delta
                ids += fed
                positions += range(start, start + len(fed))
                rows.append(Rows(sequence.cache, len(fed), undoable=len(fed) > 1))  # a hybrid state can drop guesses
            logits = self.forward(torch.tensor(ids), torch.tensor(positions), rows)
        except Exception as exc:  # their caches' state is unknown now: fail the sequences (caches not kept)
            log.exception("decode step failed for a batch of %d", len(running))
            self._fail(list(running), exc)
            return
        at = 0
        for sequence, row, guess in zip(list(running), rows, guesses):
            try:
                compared, accepted = sequence.verify(logits[at : at + row.count], guess.tokens)
                rejected = compared - accepted
                if compared:
                    sequence.drafts.record(compared, accepted, not guess.certain)
                    metrics.DRAFT_TOKENS.labels(source=guess.source, result="accepted").inc(accepted)
                    metrics.DRAFT_TOKENS.labels(source=guess.source, result="rejected").inc(rejected)
                end = sequence.reached_end()
                if end is not None:
                    sequence.finish(end)
                    self._leave(sequence)
            except Exception as exc:  # this sequence's sampling only: it leaves, its neighbours go on
                log.exception("sampling a token failed")
                self._running.remove(sequence)
                self._end_with_error(sequence, exc)
            at += row.count

    def _head_guesses(self, running: list[Sequence], guesses: list[Guesses]) -> None:
        """The multi-token prediction head's guesses for the sequences that draft with it, made for all
        of them at once (and its unread rows read: service/engine/mtp_drafts.py)."""
        drafting = [(s, g) for s, g in zip(running, guesses) if s.head_cache is not None]
        if self.head is None or not drafting:
            return
        made = self.head.propose(
            [s.head_cache for s, _ in drafting], [s.token_ids[-1] for s, _ in drafting], [g.wanted for _, g in drafting]
        )
        for (_, guess), tokens in zip(drafting, made):
            if guess.source == "mtp":
                guess.tokens = tokens

    def _end_with_error(self, sequence: Sequence, exc: Exception) -> None:
        sequence.finish(Status.FINISHED_ERROR)
        sequence.error = exc
        self._leave_alone(sequence)

    def _fail(self, sequences: list[Sequence], exc: Exception) -> None:
        """End `sequences` with `exc` (re-raised in their request threads); their caches are not kept."""
        for sequence in sequences:
            if sequence.done.is_set():
                continue
            for queue in (self._waiting, self._running, self._paused):
                if sequence in queue:
                    queue.remove(sequence)
            if sequence.in_prefill:
                with contextlib.suppress(Exception):
                    sequence.prefill.close()
            self._end_with_error(sequence, exc)

    def _leave(self, sequence: Sequence) -> None:
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
            sequence.stream.end()
            sequence.done.set()
