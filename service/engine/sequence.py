"""One admitted request as the engine runs it: a single record with an explicit status.

The engine makes a `Sequence` when it admits a request (what was worked out once: the prompt, the
token limit, the deadline, the sampler, the grammar's state, the guess budget) and hands it to the
scheduler, which owns it from then on: each transition sets `status` where it happens —

    WAITING → [READING ⇄] PREFILLING → RUNNING [⇄ PAUSED] → FINISHED_* (stop, length, deadline,
    cancelled, error)

READING is a prefill parked while the disk tier reads its cached prefix (other prefills go on);
PAUSED is a sequence whose place in the batch went to a more urgent request (service/engine/
admission.py): left alone whole — its tokens, KV cache, sampler and RNG, grammar, guess budget and
stream as they were — and resumed where it was, so its answer has the bits it would have had.
The request's own thread only reads the record (the output side, service/engine/output.py), asks
for it to end (`cancel`), and — once the scheduler has let go — ends it at a stop string
(`end_at_stop_string`): the one transition made off the scheduler's thread, since only the text
shows where a stop string falls.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .. import metrics
from ..answer.structured import Constraint
from ..generation import GenerationRequest
from ..model.prompts import PreparedPrompt
from .admission import Ticket
from .drafts import DraftBudget, Guesses
from .reasoning import ReasoningPhase
from .sampling import Sampler
from .streaming import TokenStream


class Status(enum.Enum):
    WAITING = "waiting"  # admitted, its prefill not begun
    READING = "reading"  # its prefill parked while the disk tier reads its cached prefix
    PREFILLING = "prefilling"
    RUNNING = "running"  # in the decode batch
    PAUSED = "paused"  # preempted: out of the batch, its state kept to resume
    FINISHED_STOP = "stop"  # an end of turn, or a stop string
    FINISHED_LENGTH = "length"  # its token limit (or a stop string cut its grammar's match short)
    FINISHED_DEADLINE = "deadline"  # REQUEST_DEADLINE passed
    FINISHED_CANCELLED = "cancelled"  # the client left, or the server is shutting down
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        """The Completion's finish_reason (None while it runs)."""
        return self.value if self.finished else None


@dataclass
class Prefilled:
    """What a finished prefill hands the scheduler."""

    cache: DynamicCache  # the whole prompt's keys and values
    logits: torch.Tensor  # 1 × vocab, after the prompt's last token
    rope_delta: int  # M-RoPE position minus token index, for every token after the prompt


@dataclass
class PrefillMarks:
    """What a prefill did and when, for the request's Completion."""

    reused: int = 0  # prompt tokens taken from the conversation cache
    reused_from: str | None = None  # its tier: memory or disk
    vision_hits: int = 0  # images and videos whose features came from the vision cache
    cache_lookup: float = 0.0  # seconds
    vision_encode: float = 0.0  # seconds
    prefill_start: float | None = None  # perf_counter time the prompt's first piece began


class Preemptible:
    """Pausing and resuming a record the scheduler runs (a Sequence; a search job, service/engine/search.py),
    which has a `status`, a `paused_from` and a `ticket`."""

    def pause(self) -> None:
        """Its place went to a more urgent request: out of the scheduler's steps, everything kept."""
        self.paused_from, self.status = self.status, Status.PAUSED
        metrics.PAUSED.labels(self.ticket.label).inc()

    def resume(self) -> Status:
        """Back where it was; returns that status (RUNNING: the decode batch; else its prefill)."""
        self.status, self.paused_from = self.paused_from, None
        metrics.PAUSED.labels(self.ticket.label).dec()
        return self.status


@dataclass(eq=False)
class Sequence(Preemptible):
    """One admitted request inside the engine; see the module docstring. The engine fills the
    fields up to `marks`; the scheduler the rest, and calls `on_leave(sequence)` on its thread
    when the sequence leaves (its KV cache then in `cache`, or None if it never finished prefill),
    then sets `done`."""

    request: GenerationRequest  # read-only
    prompt: PreparedPrompt
    max_new_tokens: int
    deadline: float  # perf_counter time at which it is ended (REQUEST_DEADLINE)
    prefill: Generator[Future | None, None, Prefilled]  # a step per yield; yields a disk read it waits for
    sampler: Sampler
    stream: TokenStream
    eos_token_ids: frozenset[int]
    on_leave: Callable[[Sequence], None]
    ticket: Ticket  # its place in the batch (or its wait for one): service/engine/admission.py
    constraint: Constraint | None = None  # its grammar's state (structured output), if any
    drafts: DraftBudget | None = None  # its guesses for speculative decoding (service/engine/drafts.py), if on
    reasoning: ReasoningPhase | None = None  # a thinking model's reasoning, then its answer (engine/reasoning.py)
    queue_wait: float = 0.0  # seconds in the admission queue
    marks: PrefillMarks = field(default_factory=PrefillMarks)
    status: Status = Status.WAITING
    reading: Future | None = None  # the disk read it is parked on (READING)
    submitted_at: float = field(default_factory=time.perf_counter)
    prefill_started_at: float | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt and answer, once prefilled
    rope_delta: int = 0
    cache: DynamicCache | None = None  # its KV cache once prefilled (the decode step extends it)
    paused_from: Status | None = None  # while PAUSED: the status it resumes with
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.input_ids[0].tolist()

    @property
    def answer_ids(self) -> list[int]:
        """The tokens generated so far, as streamed (all of them once it has ended)."""
        return self.stream.token_ids

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt.num_tokens if self.token_ids else 0

    # -- transitions ----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Ask for it to end (from any thread): the scheduler ends it at its next step."""
        self._cancel.set()

    def finish(self, status: Status) -> None:
        """End it with `status`, unless it has ended already (the first end wins)."""
        with self._lock:
            if self.status is Status.PAUSED:
                metrics.PAUSED.labels(self.ticket.label).dec()
            if not self.status.finished:
                self.status = status

    def end_at_stop_string(self) -> None:
        """The answer's text reached a stop string: that is where it ended, whatever the scheduler
        made after it — `length` if the stop cut a grammar's match short. Called on the request's
        thread once the scheduler has let go of it (`done`), which it asked with `cancel`."""
        complete = self.constraint is None or self.constraint.complete
        with self._lock:
            self.status = Status.FINISHED_STOP if complete else Status.FINISHED_LENGTH

    @property
    def in_prefill(self) -> bool:
        """Its prefill has not finished (paused or not)."""
        return (self.paused_from or self.status) in (Status.WAITING, Status.READING, Status.PREFILLING)

    def ending(self, now: float) -> Status | None:
        """The status it ends with now, if it must: asked to end, or past its deadline."""
        if now >= self.deadline:
            return Status.FINISHED_DEADLINE
        return Status.FINISHED_CANCELLED if self._cancel.is_set() else None

    def reached_end(self) -> Status | None:
        """After a token: an end of turn, or its token limit."""
        if self.generated > 0 and self.token_ids[-1] in self.eos_token_ids:
            return Status.FINISHED_STOP
        return Status.FINISHED_LENGTH if self.generated >= self.max_new_tokens else None

    # -- tokens -----------------------------------------------------------------------------------

    def start_decoding(self, prefilled: Prefilled) -> None:
        """Its prompt is in its KV cache: take the cache, then choose its first token."""
        self.token_ids = list(self.prompt_ids)
        self.rope_delta = prefilled.rope_delta
        self.cache = prefilled.cache
        self.status = Status.RUNNING
        self.accept(prefilled.logits)

    def accept(self, logits: torch.Tensor) -> int:
        """Choose the next token from its logits (within its grammar, or forced while a thinking
        model's reasoning closes) and stream it."""
        phase, constraint = self.reasoning, self.constraint
        if phase is None:
            allowed = constraint.allowed() if constraint is not None else None
        else:  # the grammar waits for the answer
            wants_grammar = constraint is not None and not phase.forced and (phase.answering or phase.undecided)
            allowed = phase.allowed(logits.shape[-1], constraint.allowed() if wants_grammar else None)
        token = self.sampler(self.token_ids, logits, allowed)
        in_answer = phase is None or phase.advance(token, self.generated)
        if constraint is not None and in_answer:
            constraint.advance(token)
        self.token_ids.append(token)
        self.stream.put_token(token)
        return token

    @property
    def head_cache(self):
        """Its cache's part for the multi-token prediction head (service/model/mtp.py), if it drafts with one."""
        return getattr(self.cache, "draft", None) if self.drafts is not None else None

    def guesses(self, room: int) -> Guesses:
        """This step's guesses (at most `room`, and never past its token limit): certain ones, prompt
        lookup's, or how many the multi-token prediction head is to make (service/engine/drafts.py)."""
        if self.drafts is None:
            return Guesses([])
        room = min(room, self.max_new_tokens - self.generated - 1)
        phase = self.reasoning
        if phase is not None and phase.forced:  # certain, as a grammar's forced tokens
            return Guesses(phase.forced[: max(0, min(room, self.drafts.max_tokens))])
        constraint = self.constraint if phase is None or phase.answering else None
        if self.head_cache is not None:
            forced, wanted = self.drafts.head_drafts(constraint, room)
            return Guesses(forced) if forced else Guesses([], "mtp", wanted)
        tokens, looked_up = self.drafts.drafts(self.token_ids, constraint, room)
        return Guesses(tokens, "lookup" if looked_up else "grammar")

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
            if self.reached_end():
                break
        # The cache holds every token but the last made (the next step feeds it), as without guesses.
        surplus = self.cache.get_seq_length() - (len(self.token_ids) - 1)
        if surplus > 0:
            self.cache.crop(-surplus)
        return compared, accepted
