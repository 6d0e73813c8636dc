"""Continuous batching: one scheduler thread owns the model and decodes all running sequences together.

A decode step is one forward of the language model over every running sequence (input ids B × 1),
so the weights are read once for B tokens; decoding on these CPUs is memory-bound, so B tokens
cost little more than one. A sequence joins the batch at the first step after its prefill and
leaves the moment it finishes or is cancelled.

Prefill is a generator (`Sequence.prefill`, written by the engine) that yields after each unit of
work — a vision-encoder block, a chunk of prompt tokens. The scheduler interleaves: one unit of
the oldest waiting prefill, then one decode step of the batch, and again. A running stream so
waits at most one unit per token while a neighbour prefills; with nothing to decode, prefill runs
back to back.

Each sequence keeps what makes it independent of its neighbours: its sampling (`Sampler`, with
its own torch.Generator), its M-RoPE offset (`rope_delta`: its decode positions are exactly those
it would get alone) and its own KV cache, which the forward (service/forward.py) attends to
and extends in place: no padding, nothing to re-pack when a sequence joins or leaves, and a
sequence's tokens are the ones it gets alone (INT8 included: its Linears quantize per token).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from . import metrics
from .forward import Rows, TextForward
from .logprobs import TokenLogprob, token_logprob
from .streaming import TokenStreamer
from .structured import Constraint

log = logging.getLogger(__name__)


class Sampler:
    """One sequence's next token: generate's logits processors for its config, then the argmax
    (greedy) or a draw from the sequence's own generator (the same draws `generate` makes after
    `torch.manual_seed(seed)`). OpenAI's penalties and logit_bias (`adjustments`), then a grammar's
    mask, apply after the repetition penalty.

    With `top_logprobs` set (0-20) it records each chosen token's log-probability (and that many
    alternatives') in `logprobs`, from the distribution it drew from: penalties, bias, mask and temperature
    applied (greedy: temperature 1), top-k/top-p truncation not (so no alternative shows -inf)."""

    def __init__(
        self,
        config: GenerationConfig,
        seed: int,
        top_logprobs: int | None = None,
        adjustments: ScoreAdjustments | None = None,
    ):
        self.do_sample = bool(config.do_sample)
        penalty = config.repetition_penalty
        self.penalty = RepetitionPenaltyLogitsProcessor(penalty) if penalty is not None and penalty != 1.0 else None
        self.warpers = LogitsProcessorList()
        if self.do_sample:
            if config.temperature is not None and config.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k:
                self.warpers.append(TopKLogitsWarper(config.top_k))
            if config.top_p is not None and config.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(config.top_p))
        self.generator = torch.Generator().manual_seed(seed)
        self.temperature = config.temperature if self.do_sample and config.temperature else 1.0
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] | None = [] if top_logprobs is not None else None
        self.adjustments = adjustments

    def __call__(self, token_ids: list[int], logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        """The next token after `token_ids` (prompt and answer so far) given its logits (1 × vocab);
        `allowed` (bool, vocab) is a grammar's mask."""
        scores = self.penalty(torch.tensor([token_ids]), logits) if self.penalty else logits
        if self.adjustments is not None:
            scores = self.adjustments(scores)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        token = self._draw(scores)
        if self.adjustments is not None:
            self.adjustments.record(token)
        if self.logprobs is not None:
            distribution = (scores.float() / self.temperature).log_softmax(-1)[0]
            self.logprobs.append(token_logprob(distribution, token, self.top_logprobs))
        return token

    def _draw(self, scores: torch.Tensor) -> int:
        if self.do_sample:
            probs = (self.warpers(None, scores) if self.warpers else scores).softmax(-1)
            if torch.isfinite(probs).all():
                return int(torch.multinomial(probs, 1, generator=self.generator))
            # A temperature (or penalty) so extreme that the scores overflowed: the distribution's
            # limit is all its mass on the most likely token.
        return int(scores.nan_to_num(nan=float("-inf")).argmax(-1))


class ScoreAdjustments:
    """OpenAI's presence and frequency penalties (by how often each token is in the answer so far)
    and logit_bias: one offset per token id, added to a sequence's scores after the repetition
    penalty, and updated by each token chosen."""

    def __init__(self, vocab_size: int, presence: float, frequency: float, bias: dict[int, float]):
        self.presence, self.frequency = presence, frequency
        self.offset = torch.zeros(vocab_size)
        if bias:
            self.offset[list(bias)] = torch.tensor(list(bias.values()))
        self._seen: set[int] = set()

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.offset

    def record(self, token: int) -> None:
        self.offset[token] -= self.frequency + (self.presence if token not in self._seen else 0.0)
        self._seen.add(token)


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
    prefill: Generator[None, None, Prefilled]
    sampler: Sampler
    streamer: TokenStreamer
    cancel: threading.Event
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    on_leave: Callable[[Sequence], None]
    constraint: Constraint | None = None  # its grammar's state (structured output), if any
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

    def accept(self, logits: torch.Tensor) -> None:
        """Choose the next token from its logits (within its grammar) and stream it."""
        if self.constraint is None:
            token = self.sampler(self.token_ids, logits)
        else:
            token = self.sampler(self.token_ids, logits, self.constraint.allowed())
            self.constraint.advance(token)
        self.token_ids.append(token)
        self.streamer.put_token(token)


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
        torch.set_num_threads(self.threads)
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
            next(sequence.prefill)
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
        running = self._running
        ids = torch.tensor([s.token_ids[-1] for s in running])
        # The token fed sits at index len - 1 of its sequence; M-RoPE shifts it by the sequence's delta.
        positions = torch.tensor([len(s.token_ids) - 1 + s.rope_delta for s in running])
        try:
            logits = self.forward(ids, positions, [Rows(s.cache, 1) for s in running])
        except Exception as exc:  # their caches' state is unknown now: fail the sequences (caches not kept)
            log.exception("decode step failed for a batch of %d", len(running))
            self._fail(list(running), exc)
            return
        for i, sequence in enumerate(running):
            try:
                sequence.accept(logits[i : i + 1])
            except Exception as exc:  # this sequence's sampling only: it leaves, its neighbours go on
                log.exception("sampling a token failed")
                sequence.error = exc
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
