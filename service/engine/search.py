"""Embeddings and relevance scores (Qwen3-VL-Embedding, Qwen3-VL-Reranker) on the engine's one forward.

A request's inputs — texts, pictures, clips, or a reranker's (query, document) pairs — become prompts as
the official code writes them (service/model/search_prompts.py), checked and tokenized on the request's
thread. The request then takes one place in the batch (admission: priorities, tenants' shares, the queue)
and runs on the scheduler's thread as a `SearchJob`, a forward per scheduler step:

- many inputs in one forward: their rows packed up to SEARCH_BATCH_TOKENS, so each weight is read once for
  all of them; a longer input is computed in pieces (the same bits: every row is computed alone);
- the head the inputs share — the instruction, a rerank's instruction and query — computed once and
  copied into each input's cache, and kept for later requests of the tenant's cache namespace
  (service/caches/prefixes.py);
- pictures and clips through the vision cache, encoded a block per step when not there, each input's
  just before its rows are computed (features are not all held at once).

An embedding is the last token's final-normed hidden state, its first `dimensions` values (Matryoshka)
divided by their L2 norm; a score is sigmoid(logit("yes") − logit("no")) at the last token. Both are
computed from that row alone, in a fixed order, so a vector or a score has the same bits alone, beside
any other inputs, cut in pieces, or with its head from the cache (INT8 and 4-bit weights: fp32 GEMMs
round by the number of rows).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from .. import metrics
from ..caches.prefixes import Head, PrefixCache, head_key
from ..errors import BadRequest, ServiceError
from ..generation import TenantShare
from ..limits import RequestLimits
from ..memory import MemoryGuard, kv_cache_bytes
from ..model.forward import TextForward
from ..model.prompts import PreparedPrompt, prepare_prompt
from ..model.search_prompts import RERANK_TOKENS, SearchPrompt, head_ids
from ..vision.features import VisionFeatures
from .admission import Admission, Ticket
from .prefill import Prefiller, PromptRows
from .sequence import Preemptible, Status

log = logging.getLogger(__name__)

# The fewest leading values a vector may be cut to: the model cards' range (64 to the hidden size).
MIN_DIMENSIONS = 64
TASK_ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "embedding": "/v1/embeddings",
    "rerank": "/v1/rerank",
}


@dataclass(frozen=True)
class SearchRequest:
    """One embeddings or rerank request as the HTTP layer made it: its prompts, in order, and who sent it.
    `item_param` names the body's field the prompts come from (a 4xx names `item_param[i]`)."""

    kind: str  # "embedding" or "rerank"
    prompts: list[SearchPrompt]
    received_at: float
    item_param: str = "input"
    dimensions: int | None = None  # an embedding's leading values kept (None: all)
    priority: int = 0
    tenant: TenantShare = TenantShare()
    cache_namespace: str = ""
    cancelled: threading.Event | None = None  # set: the request ends at the scheduler's next step


@dataclass(frozen=True)
class SearchResult:
    """Each prompt's vector (float32, L2-normalised) or score, in the request's order."""

    vectors: list[torch.Tensor] | None
    scores: list[float] | None
    prompt_tokens: int
    shared_tokens: int  # prompt tokens of a shared head: computed once for the request, or taken from the cache
    seconds: float


def last_token_vector(hidden: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The embedding of one final-normed hidden row: its first `dimensions` values over their L2 norm,
    the squares summed one after another in float64 (an order that depends on nothing else)."""
    values = hidden[:dimensions].double()
    norm = torch.cumsum(values * values, 0)[-1].sqrt().clamp_min(1e-12)
    return (values / norm).float()


def yes_no_score(logits: torch.Tensor, yes: int, no: int) -> float:
    """sigmoid(logit(yes) − logit(no)) of one row, in float64 with libm's exp (torch's takes the CPU's
    own vector path: another instruction set could round it otherwise)."""
    gap = float(logits[yes]) - float(logits[no])
    if gap >= 0:
        return 1.0 / (1.0 + math.exp(-gap))
    small = math.exp(gap)  # never overflows
    return small / (1.0 + small)


def check_count(count: int, max_items: int, param: str) -> None:
    """400 naming `param` for no items, or more than `max_items` (SEARCH_MAX_ITEMS) — checked by the HTTP
    layer before it decodes any item's pictures, and again here."""
    if not count:
        raise BadRequest(f"{param} must not be empty", param=param)
    if count > max_items:
        raise BadRequest(
            f"{count} items; this server takes at most {max_items} a request (SEARCH_MAX_ITEMS)",
            param=param,
            code="too_many_items",
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _whole_spans(prompt: PreparedPrompt, length: int) -> int:
    """`length`, moved back to the start of a picture or clip it would cut."""
    for span in prompt.spans["image"] + prompt.spans["video"]:
        if span.start < length < span.end:
            length = span.start
    return length


def _media_before(prompt: PreparedPrompt, length: int) -> list[str]:
    spans = sorted(prompt.spans["image"] + prompt.spans["video"], key=lambda s: s.start)
    return [s.key for s in spans if s.end <= length]


@dataclass(eq=False)
class _Group:
    """Prompts that share a head: its name, its length, and its keys and values once computed."""

    key: str
    tokens: int
    head: Head | None = None


@dataclass(eq=False)
class _Unit:
    """Rows one forward computes for a prompt: its head (`head` True: computed for its group) or the rest."""

    index: int  # the prompt's in the request
    prompt: PreparedPrompt
    group: _Group
    start: int
    end: int
    head: bool = False
    rows: PromptRows | None = None
    cache: object = None


class _Done:
    """What the scheduler ends a search job's stream with: it has none."""

    def end(self) -> None:
        pass


@dataclass(eq=False)
class SearchJob(Preemptible):
    """A search request on the scheduler's thread: a record with the waiting-request interface the
    scheduler drives (service/engine/scheduler.py) — status, ticket, deadline, steps (`prefill`), pause,
    cancel — whose steps are all its work; their return value is its `result`."""

    ticket: Ticket
    deadline: float
    prefill: Generator = None
    cancelled: threading.Event | None = None  # the caller's own cancel
    status: Status = Status.WAITING
    reading: object = None
    submitted_at: float = field(default_factory=time.perf_counter)
    prefill_started_at: float | None = None
    paused_from: Status | None = None
    result: SearchResult | None = None
    error: BaseException | None = None
    stream: _Done = field(default_factory=_Done)
    done: threading.Event = field(default_factory=threading.Event)
    _cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def in_prefill(self) -> bool:
        return not (self.paused_from or self.status).finished

    def cancel(self) -> None:
        self._cancel.set()

    def ending(self, now: float) -> Status | None:
        if now >= self.deadline:
            return Status.FINISHED_DEADLINE
        asked = self._cancel.is_set() or (self.cancelled is not None and self.cancelled.is_set())
        return Status.FINISHED_CANCELLED if asked else None

    def finish(self, status: Status) -> None:
        if self.status is Status.PAUSED:
            metrics.PAUSED.labels(self.ticket.label).dec()
        if not self.status.finished:
            self.status = status

    @staticmethod
    def on_leave(_job) -> None:
        pass


class Searcher:
    """Runs search requests on one engine's model, scheduler and caches; see the module docstring."""

    def __init__(
        self,
        loaded,
        forward: TextForward,
        prefiller: Prefiller,
        admission: Admission,
        scheduler,
        memory: MemoryGuard,
        limits: RequestLimits,
        kv_dtype: torch.dtype,
        settings,
    ):
        self.task = loaded.task
        self.model, self.processor = loaded.model, loaded.processor
        self.forward, self.prefiller = forward, prefiller
        self.admission, self.scheduler, self.memory = admission, scheduler, memory
        self.prompt_limits, self.max_items, self.kv_dtype = limits.prompt, limits.max_search_items, kv_dtype
        self.batch_tokens = settings.search_batch_tokens
        self.deadline = settings.request_deadline
        self.prefixes = PrefixCache()
        memory.evict_callbacks.append(self.prefixes.entries.shrink)
        self.hidden_size = loaded.model.config.text_config.hidden_size
        self.yes = self.no = None
        if self.task != "chat" and forward.layer_types is not None:
            raise ValueError("embedding and rerank serve Qwen3-VL checkpoints (Qwen3-VL-Embedding, -Reranker) only")
        if self.task == "rerank":
            self.yes, self.no = self._answer_tokens()

    def _answer_tokens(self) -> tuple[int, int]:
        vocab = self.processor.tokenizer.get_vocab()
        missing = [t for t in RERANK_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"a reranker's tokenizer must have the tokens {RERANK_TOKENS}; this one lacks {missing}")
        return vocab["yes"], vocab["no"]

    def refuse_unless(self, kind: str) -> None:
        """400 unless the loaded checkpoint serves `kind` (chat, embedding or rerank), naming what it serves."""
        if kind == self.task:
            return
        names = {"chat": "a chat model", "embedding": "an embedding model", "rerank": "a reranker"}
        raise BadRequest(
            f"this server serves {names[self.task]}, not {names[kind]}: use {TASK_ENDPOINTS[self.task]} "
            "(MODEL_TASK tells a checkpoint's task when its name does not)",
            param="model",
            code="wrong_model_task",
        )

    def run(self, request: SearchRequest) -> SearchResult:
        """Check, prepare and admit the request, run it on the scheduler and return its vectors or scores."""
        self.refuse_unless(request.kind)
        if request.dimensions is not None and not MIN_DIMENSIONS <= request.dimensions <= self.hidden_size:
            raise BadRequest(
                f"dimensions is {request.dimensions}; this model's vectors may be cut to {MIN_DIMENSIONS} to "
                f"{self.hidden_size} values (Matryoshka)",
                param="dimensions",
                code="invalid_dimensions",
            )
        check_count(len(request.prompts), self.max_items, request.item_param)
        prompts = [self._prepared(p, f"{request.item_param}[{i}]") for i, p in enumerate(request.prompts)]
        groups = self._groups(request, prompts)
        longest = max(p.num_tokens for p in prompts)
        self.memory.check(kv_cache_bytes(self.model.config, self.batch_tokens + longest, self.kv_dtype.itemsize))
        ticket = self.admission.acquire(request.priority, request.received_at, tenant=request.tenant)
        try:
            job = SearchJob(ticket, request.received_at + self.deadline, cancelled=request.cancelled)
            job.prefill = self._steps(request, prompts, groups)
            self.scheduler.submit(job)
            job.done.wait()
        finally:
            self.admission.release(ticket)
        if job.error is not None:
            raise job.error
        if job.result is None:
            raise ServiceError(
                f"the request ended ({job.status.value}) before its results", status=503, code=job.status.value
            )
        metrics.SEARCH_ITEMS.labels(request.kind).inc(len(prompts))
        metrics.SEARCH_SECONDS.labels(request.kind).observe(job.result.seconds)
        return job.result

    def _prepared(self, prompt: SearchPrompt, param: str) -> PreparedPrompt:
        try:
            return prepare_prompt(self.processor, prompt.messages, self.prompt_limits)
        except ServiceError as exc:
            exc.param = param if exc.param in (None, "messages") else exc.param
            raise

    def _groups(self, request: SearchRequest, prompts: list[PreparedPrompt]) -> list[_Group]:
        """Each prompt's shared head: its tokens before its item's own (matched against the head's text
        tokens; for pairs, as far as all the request's prompts agree, pictures included), ending before
        the prompt's last token (whose row is the result) and never inside a picture."""
        ids = [p.input_ids[0].tolist() for p in prompts]
        heads: dict[tuple, list[int]] = {}
        lengths = []
        for search_prompt, prompt, tokens in zip(request.prompts, prompts, ids):
            user = search_prompt.messages[-1].parts
            before = user[: len(user) - search_prompt.item_parts]
            name = (repr(search_prompt.messages[:-1]), repr(before))
            if name not in heads:
                heads[name] = head_ids(self.processor, search_prompt)
            lengths.append(_whole_spans(prompt, _common_prefix(tokens, heads[name])))
        if request.kind == "rerank" and len(ids) > 1:  # a query with pictures: shared as far as all agree
            shared = min(_common_prefix(ids[0], other) for other in ids[1:])
            shared = min(_whole_spans(p, shared) for p in prompts)
            if all(_media_before(p, shared) == _media_before(prompts[0], shared) for p in prompts):
                lengths = [max(n, shared) for n in lengths]
        groups: dict[str, _Group] = {}
        out = []
        for prompt, tokens, length in zip(prompts, ids, lengths):
            length = _whole_spans(prompt, min(length, len(tokens) - 1))
            key = head_key(tokens[:length], _media_before(prompt, length))
            out.append(groups.setdefault(key, _Group(key, length)))
        return out

    def _steps(
        self, request: SearchRequest, prompts: list[PreparedPrompt], groups: list[_Group]
    ) -> Generator[None, None, SearchResult]:
        """The job: a forward per step over rows of many prompts, heads first (see the module docstring)."""
        started = time.perf_counter()
        namespace = request.cache_namespace
        units: list[_Unit] = []
        seen: set[int] = set()
        for index, (prompt, group) in enumerate(zip(prompts, groups)):
            if group.head is None and id(group) not in seen and group.tokens:
                group.head = self.prefixes.get(group.key, namespace)
                if group.head is None:
                    units.append(_Unit(index, prompt, group, 0, group.tokens, head=True))
            seen.add(id(group))
            units.append(_Unit(index, prompt, group, group.tokens, prompt.num_tokens))
        results: list = [None] * len(prompts)
        while units:
            taken: list[tuple[_Unit, int, int]] = []
            budget = self.batch_tokens
            while units and budget > 0:
                unit = units[0]
                if not unit.head and unit.group.tokens and unit.group.head is None:
                    break  # its head is computed in this forward: its rows go in the next
                if unit.rows is None:
                    yield from self._start(unit, namespace)
                end = min(unit.end, unit.start + budget)
                taken.append((unit, unit.start, end))
                budget -= end - unit.start
                unit.start = end
                if end == unit.end:
                    units.pop(0)
            yield
            self._compute(request, taken, results, namespace)
        shared = sum(g.tokens for g in groups)
        return SearchResult(
            vectors=results if request.kind == "embedding" else None,
            scores=results if request.kind == "rerank" else None,
            prompt_tokens=sum(p.num_tokens for p in prompts),
            shared_tokens=shared,
            seconds=time.perf_counter() - started,
        )

    def _start(self, unit: _Unit, namespace: str) -> Generator[None, None, None]:
        """A unit's first rows: its pictures' features (from the vision cache, or encoded a block per
        step) and its cache — a head's empty, an input's holding its group's head."""
        features, _ = yield from self.prefiller.features(unit.prompt, unit.start, namespace)
        merged = {m: VisionFeatures.cat([f[i] for i in sorted(f)]) for m, f in features.items() if f}
        unit.rows = PromptRows(self.model, unit.prompt, merged, unit.start)
        unit.cache = self.forward.new_cache(self.kv_dtype)
        unit.cache.reserve(unit.end)
        if not unit.head and unit.group.tokens:
            unit.group.head.into(unit.cache)

    def _compute(self, request: SearchRequest, taken: list[tuple[_Unit, int, int]], results: list, namespace: str):
        """One forward over the units' rows; each unit that ends here hands on its last row's result."""
        ids, positions, rows, last = [], [], [], []
        at = 0
        for unit, start, end in taken:
            piece_ids, piece_positions, piece_rows = unit.rows.piece(unit.cache, start, end)
            ids.append(piece_ids)
            positions.append(piece_positions)
            rows += piece_rows
            at += end - start
            if end == unit.end:
                last.append((unit, at - 1))
        out_rows = torch.tensor([row for _, row in last] or [at - 1])
        embedding = request.kind == "embedding"
        out = self.forward(torch.cat(ids), torch.cat(positions, 1), rows, logits_rows=out_rows, hidden=embedding)
        for (unit, _), values in zip(last, out):
            if unit.head:
                unit.group.head = Head.of(unit.cache, unit.end)
                self.prefixes.put(unit.group.key, unit.group.head, namespace)
            elif embedding:
                results[unit.index] = last_token_vector(values, request.dimensions)
            else:
                results[unit.index] = yes_no_score(values, self.yes, self.no)
            unit.cache = unit.rows = None  # its keys, values and features go now
