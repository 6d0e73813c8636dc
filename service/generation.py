"""What goes into the engine and what comes out: sampling parameters (their bounds defined once,
here, for the HTTP schemas too), a request (read-only), its events, its timings, the admitted
generation (the caller's handle: events, cancel, live state)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from .answer.grounding import Box
from .answer.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from .answer.structured import OutputGrammar
from .metrics import PRIORITY_CLASSES
from .model.prompts import ChatMessage

# Bounds of each sampling parameter: the engine's and the HTTP schemas' (service/api/schemas.py).
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0, le=2, description="0 = greedy")]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=0, description="0 = off")]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
StopString = Annotated[str, StringConstraints(max_length=256)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=10)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2, le=2, description="OpenAI's: per token of the answer so far")]
LogitBias = dict[int, Annotated[float, Field(ge=-100, le=100)]]
Priority = Annotated[
    int,
    Field(
        ge=-1000,
        le=1000,
        description="lower is served first (vLLM's field; default 0): a more urgent request pauses a less "
        "urgent one when the batch is full (docs/engine.md)",
    ),
]


def priority_class(priority: int) -> str:
    """A bounded label for metrics: urgent (< 0), default (0), background (> 0)."""
    return PRIORITY_CLASSES[0 if priority < 0 else 1 if priority == 0 else 2]


class SamplingParams(BaseModel):
    """Per-request decoding parameters, validated on construction; None means the checkpoint's
    generation_config default. How many stop strings a request may have is a setting (the engine
    checks it)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: list[StopString] = Field(default_factory=list)
    repetition_penalty: RepetitionPenalty | None = None
    logprobs: TopLogprobs | None = None  # report each token's log-probability and this many alternatives
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None  # token id -> added to its logit


# The SamplingParams fields the HTTP endpoints take as they are (service/api/schemas.py derives its
# schema from them; `stop` and `logprobs` it takes in OpenAI's forms).
SHARED_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)


@dataclass(frozen=True)
class TenantShare:
    """Whose a request is, as the engine's admission sees it: the tenant's name (its metrics label too),
    and the most batch places its requests may hold while another tenant's wait (`slots`) and queue
    places they may take (`queue`); None: no bound (one tenant, or none: service/api/access/tenants.py)."""

    name: str = ""
    slots: int | None = None
    queue: int | None = None


@dataclass(frozen=True, eq=False)
class GenerationRequest:
    """A chat request as the HTTP layer or the CLI made it; the engine never writes into it."""

    messages: list[ChatMessage]
    params: SamplingParams = field(default_factory=SamplingParams)
    received_at: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    conversation_id: str | None = None
    remembered: int = 0  # leading messages from the server's memory (native endpoint), decoded by earlier requests
    grammar: OutputGrammar | None = None  # what the answer must match (structured output, forced tool calls)
    tools: list[dict] | None = None  # OpenAI tool objects the chat template shows the model
    speculative: bool = True  # False: no guessed tokens for this request (SPECULATIVE=off: none for any)
    # A thinking checkpoint's switches (service/model/thinking.py; nothing on other models): reasoning
    # off, and how many tokens it may take before the service closes it (None: as many as max_tokens leaves).
    enable_thinking: bool = True
    max_thinking_tokens: int | None = None
    priority: int = 0  # lower first (service/engine/admission.py)
    tenant: TenantShare = field(default_factory=TenantShare)  # fair share in admission
    # The caches' namespace: a request reuses only what requests of the same namespace left (an opaque
    # keyed hash of its tenant and cache_salt, service/api/access/tenants.py; "" = the one of no keys and no salt).
    cache_namespace: str = ""

    @property
    def image_decode_seconds(self) -> float:
        """Decoding the images this request brought (not those of a remembered history)."""
        return sum(i.decode_seconds for m in self.messages[self.remembered :] for i in m.images)

    @property
    def video_decode_seconds(self) -> float:
        return sum(v.decode_seconds for m in self.messages[self.remembered :] for v in m.videos)


@dataclass
class Timings:
    """Where a request's time went, in seconds (tokens/s for decode_tokens_per_s)."""

    queue_wait: float = 0.0  # waiting for the model: for a batch slot, then behind other prefills
    paused: float = 0.0  # paused for more urgent requests (its state kept: the answer is the same)
    image_decode: float = 0.0
    video_decode: float = 0.0
    cache_lookup: float = 0.0
    vision_encode: float = 0.0
    prefill: float = 0.0
    time_to_first_token: float = 0.0  # from the request's arrival
    decode: float = 0.0
    decode_tokens_per_s: float = 0.0
    longest_token_gap: float = 0.0  # e.g. while a neighbour in the batch prefilled
    total: float = 0.0


@dataclass
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens behind `text`, if asked
    reasoning: bool = False  # a piece of a thinking model's reasoning, not of the answer


@dataclass
class Completion:
    """The last event of every stream: how it ended, token counts and timings."""

    text: str
    finish_reason: str  # stop | length (a grammar's match cut short too) | deadline | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: Timings
    cached_from: str | None = None  # the conversation cache's tier the cached tokens came from: memory or disk
    vision_cache_hits: int = 0
    images: int = 0
    videos: int = 0
    answer_token_ids: tuple[int, ...] | None = None  # the ids behind `text`, when they decode to exactly it
    token_ids: tuple[int, ...] = ()  # every token generated (an end of turn included)
    drafted_tokens: int = 0  # guessed tokens verified (speculative decoding)
    accepted_tokens: int = 0  # of them, the ones the model made
    logprobs: list[TokenLogprob] | None = None  # every reported token's, if the request asked
    boxes: list[Box] = field(default_factory=list)  # boxes and points the answer names (answer/grounding.py)
    reasoning: str | None = None  # a thinking model's reasoning (None: the model does not think)
    image_tokens: tuple[int, ...] = ()  # the visual tokens each picture in the prompt got
    video_tokens: tuple[int, ...] = ()  # and each clip (its frames' tokens, timestamps apart)
    reasoning_tokens: int = 0  # of completion_tokens, those before the answer (tags and separator included)
    preempted: int = 0  # times it was paused for a more urgent request
    stop_string: str | None = None  # the request's stop string that ended the answer, if one did
    answer_digest: str = ""  # its tokens and their logprob bits, digested (service/answer/digest.py)


class Tracked(Protocol):
    """What a Generation reads of its request inside the engine (service/engine/sequence.py)."""

    @property
    def answer_ids(self) -> list[int]: ...

    @property
    def prompt(self): ...  # its PreparedPrompt (num_tokens)

    @property
    def status(self) -> Enum: ...

    def cancel(self) -> None: ...


class Generation:
    """An admitted generation: iterate for events; cancel() ends it at the engine's next step;
    close() (or exhaustion) cancels it if still running and frees the model. It shows the request's
    live state: its status and the tokens generated so far."""

    def __init__(self, events: Iterator[TextDelta | Completion], tracked: Tracked, release: Callable[[], None]):
        self._events = events
        self._tracked = tracked
        self._release = release

    @property
    def status(self) -> str:
        """waiting, reading, prefilling, running, paused; once ended its finish reason (stop, length,
        deadline, cancelled) or error."""
        return self._tracked.status.value

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated so far (all of them once the stream has ended)."""
        return self._tracked.answer_ids

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens, known once submitted (before any is computed)."""
        return self._tracked.prompt.num_tokens

    @property
    def generated_tokens(self) -> int:
        return len(self._tracked.answer_ids)

    def cancel(self) -> None:
        """End the generation at the engine's next step (from any thread); the stream then ends with
        a Completion whose finish_reason is `cancelled` (unless it had ended already)."""
        self._tracked.cancel()

    def __iter__(self):
        return self

    def __next__(self) -> TextDelta | Completion:
        try:
            return next(self._events)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Cancel (if running) and free the model slot once the engine has let go; safe to call more
        than once."""
        self._events.close()
        release, self._release = self._release, None
        if release:
            release()
