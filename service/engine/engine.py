"""The engine: owns one loaded model and turns a chat request into a stream of text deltas.

Up to MAX_BATCH_SIZE requests are decoded together by one scheduler thread (service/engine/batching.py:
continuous batching, prefill interleaved with decoding; service/engine/prefill.py makes each request's
prefill); `Admission` queues the rest. The scheduler writes each request's tokens into its
`TokenStream`; the request's generator reads it, and closing that generator (client gone) takes
the request out of the batch within one step. The model is called with explicit M-RoPE positions
per sequence, never through `generate`, so transformers' per-model `rope_deltas` state plays no part.

The HTTP layer uses `submit`, `limits` and `info` only; what `submit` returns (`Generation`) holds a
request's live state — its deadline and the tokens generated so far — so the engine never writes
into the caller's request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from transformers import GenerationConfig

from .. import metrics, native
from ..answer.grounding import find_boxes
from ..answer.logprobs import TokenLogprob, TokenText
from ..answer.stops import StopStringMatcher
from ..answer.structured import Constraint, GrammarCompiler
from ..caches.conversation import ConversationCache, VisionSpan
from ..caches.kv import HEADROOM
from ..caches.kv_disk import KVDiskStore, KVLayout, default_budget_bytes, held_bytes
from ..caches.tiers import ConversationTiers
from ..caches.vision_features import VisionFeatureCache
from ..errors import BadRequest, PromptTooLong
from ..generation import Completion, Generation, GenerationRequest, SamplingParams, TextDelta, Timings
from ..limits import RequestLimits
from ..memory import CONVERSATION_CACHE_SHARE, MIB, VISION_CACHE_SHARE, MemoryGuard, kv_cache_bytes
from ..model.attention import ExactAttention
from ..model.forward import TextForward
from ..model.identity import checkpoint_identity
from ..model.loading import LoadedModel
from ..model.prompts import PreparedPrompt, pictures_of, prepare_prompt, renders_tools
from ..settings import Settings
from ..vision.encoders import make_vision_encoder
from .admission import Admission
from .batching import Scheduler, Sequence
from .drafts import DraftBudget
from .prefill import Prefiller, PrefillMarks, vision_settings
from .sampling import Sampler, ScoreAdjustments
from .streaming import TokenStream

log = logging.getLogger(__name__)

__all__ = ["Completion", "Engine", "GenerationRequest", "ModelInfo", "SamplingParams", "TextDelta"]


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/models and /ready show of the loaded model."""

    name: str
    quantization: str
    is_random: bool
    image_max_pixels: int  # clients may downscale pictures to this before uploading
    int8_kernels: dict | None = None  # the KernelChoice serving INT8 weights, as a dict


class Engine:
    """One model, a batch of generations at a time; see the module docstring."""

    def __init__(self, loaded: LoadedModel, settings: Settings):
        self.loaded = loaded
        self.settings = settings
        self.model = loaded.model
        self.processor = loaded.processor
        self.limits = RequestLimits.build(settings, self.processor)
        kernels = loaded.kernels
        self.info = ModelInfo(
            loaded.name,
            loaded.quantization,
            loaded.is_random,
            self.limits.image.max_pixels,
            asdict(kernels) if kernels is not None else None,
        )
        if kernels is not None:
            for part in ("decoder", "vision"):
                metrics.INT8_KERNEL.labels(part=part, kernel=getattr(kernels, part)).set(1)
            for kernel, figures in kernels.measured.items():
                metrics.INT8_KERNEL_MS.labels(kernel=kernel, rows="1").set(figures["decode_ms"])
                metrics.INT8_KERNEL_MS.labels(kernel=kernel, rows=str(figures["rows"])).set(figures["prefill_ms"])
        self.admission = Admission(settings.queue_size, settings.queue_timeout, slots=settings.max_batch_size)
        # One forward for prefill pieces and decode steps: a token's bits never depend on the path.
        native.configure(settings.cache_dir)
        self.forward = TextForward(loaded.model, ExactAttention.load())
        self.scheduler = Scheduler(self.forward, settings.threads)
        self._active: set[GenerationRequest] = set()
        self._defaults = loaded.model.generation_config
        self.vision_encoder = make_vision_encoder(loaded, settings)
        # The memory budget: near it the caches give memory back (KV first: the largest), over it requests get 503.
        self.memory = MemoryGuard.from_settings(settings)
        kv_bytes, vision_bytes = self._cache_budgets(settings)
        self.conversation_cache = ConversationCache(
            loaded.model.config, kv_bytes, settings.conversation_cache_max_entries, settings.cache_ttl_seconds
        )
        self.vision_cache = VisionFeatureCache(
            vision_bytes, settings.vision_cache_max_entries, settings.cache_ttl_seconds
        )
        self.memory.evict_callbacks += [self.conversation_cache.entries.shrink, self.vision_cache.entries.shrink]
        metrics.MEMORY_BUDGET.set(self.memory.budget_bytes or 0)
        metrics.CACHE_BUDGET.labels(cache=self.conversation_cache.name).set(kv_bytes)
        metrics.CACHE_BUDGET.labels(cache=self.vision_cache.name).set(vision_bytes)
        self.kv_dtype = getattr(torch, settings.kv_dtype)
        self.conversations = ConversationTiers(self.conversation_cache, self._kv_disk(settings))
        self.vocab_size = getattr(loaded.model.config, "text_config", loaded.model.config).vocab_size
        self.token_text = TokenText(self.processor.tokenizer)  # logprobs' token strings and bytes
        self.grammars = GrammarCompiler(self.processor.tokenizer, self.vocab_size, loaded.eos_token_ids)
        self.renders_tools = renders_tools(self.processor)
        self.prefiller = Prefiller(
            loaded.model,
            self.forward,
            self.vision_encoder,
            self.conversations,
            self.vision_cache,
            settings.prefill_chunk_tokens,
            self.kv_dtype,
            self.processor.image_processor,
        )

    def _cache_budgets(self, settings: Settings) -> tuple[int, int]:
        """The caches' byte budgets: as set, or shares of what the memory budget leaves after loading."""
        if not settings.cache_enabled:
            return 0, 0
        room = self.memory.room_bytes()
        kv = settings.conversation_cache_max_bytes
        vision = settings.vision_cache_max_bytes
        kv = int(room * CONVERSATION_CACHE_SHARE) if kv is None else kv
        vision = int(room * VISION_CACHE_SHARE) if vision is None else vision
        log.info(
            "memory budget %.0f MiB, %.0f MiB used after loading: conversation cache up to %.0f MiB, vision "
            "cache up to %.0f MiB",
            self.memory.budget_bytes / MIB,
            self.memory.used_bytes() / MIB,
            kv / MIB,
            vision / MIB,
        )
        return kv, vision

    def _kv_disk(self, settings: Settings) -> KVDiskStore | None:
        """The conversation cache's disk tier (KV_DISK_MB; off with the caches), its files named for
        exactly this checkpoint, quantization, vision encoder and KV layout."""
        if not settings.cache_enabled or settings.kv_disk_mb == 0:
            return None
        root = settings.kv_disk_dir or settings.cache_dir / "kv"
        loaded, layout = self.loaded, KVLayout.of(self.model.config, self.kv_dtype)
        parts = [
            checkpoint_identity(loaded.path),
            loaded.quantization,
            loaded.weights_mapped,  # mapped INT8 weights compute prompts another way: other bits
            self.vision_encoder.name,
            vision_settings(self.processor.image_processor),
            layout.described(),
        ]
        fingerprint = hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()
        held = held_bytes(root)
        budget = settings.kv_disk_mb * MIB if settings.kv_disk_mb else default_budget_bytes(root, held)
        store = KVDiskStore(root, budget, fingerprint, layout, self.model.config)
        metrics.CACHE_BUDGET.labels(cache=store.name).set(store.budget_bytes)
        log.info(
            "conversation cache on disk: %s, up to %.0f MiB (%.0f MiB held now)",
            root,
            store.budget_bytes / MIB,
            held / MIB,
        )
        return store

    # -- request path -------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Generation:
        """Check, tokenize and admit now — so 4xx, 429 and 503 are raised before any byte is sent —
        and return the generation: its event stream and live state (deadline, tokens so far). The
        model slot is released when the stream ends or is closed."""
        prompt = self._prepare(request)
        max_new_tokens = self._max_new_tokens(prompt, request.params)
        constraint = self.grammars.constraint(request.grammar) if request.grammar else None
        self._check_memory(prompt, max_new_tokens)
        run = _Run(
            request=request,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            constraint=constraint,
            deadline=request.received_at + self.settings.request_deadline,
            stream=TokenStream(self.processor.tokenizer),
        )
        run.waited = self.admission.acquire()
        self._active.add(request)

        def release():
            self._active.discard(request)
            self.admission.release()

        return Generation(self._events(run), release, run.stream, run.deadline)

    def generate(self, request: GenerationRequest) -> Iterator[TextDelta | Completion]:
        """`submit` as a plain generator (CLI, tests): admission happens on the first `next()`;
        closing the generator cancels generation."""
        generation = self.submit(request)
        try:
            yield from generation
        finally:
            generation.close()

    def cancel_all(self) -> None:
        """Stop every admitted generation at the scheduler's next step (graceful shutdown)."""
        for request in list(self._active):
            request.cancel.set()

    def _prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenize and patchify; raises 4xx errors before the request queues for the model."""
        if len(request.params.stop) > self.limits.max_stop_strings:
            raise BadRequest(f"stop may hold at most {self.limits.max_stop_strings} strings", param="stop")
        if any(not 0 <= token < self.vocab_size for token in request.params.logit_bias or {}):
            raise BadRequest(f"logit_bias keys must be token ids from 0 to {self.vocab_size - 1}", param="logit_bias")
        if request.tools and not self.renders_tools:
            raise BadRequest("this checkpoint's chat template does not render tools", param="tools")
        return prepare_prompt(self.processor, request.messages, self.limits.prompt, request.tools)

    def _check_memory(self, prompt: PreparedPrompt, max_new_tokens: int) -> None:
        """Unavailable (503) if this request's KV cache would not fit the memory budget, caches evicted first."""
        tokens = prompt.num_tokens + max_new_tokens + HEADROOM  # GrowingCache's room
        self.memory.check(kv_cache_bytes(self.model.config, tokens, self.kv_dtype.itemsize))

    def _max_new_tokens(self, prompt: PreparedPrompt, params: SamplingParams) -> int:
        room = self.limits.prompt.context_limit - prompt.num_tokens
        if room < 1:
            raise PromptTooLong(
                f"the prompt is {prompt.num_tokens} tokens; the context limit is {self.limits.prompt.context_limit}",
                param="messages",
            )
        wanted = params.max_tokens or self.limits.default_max_tokens
        return max(1, min(wanted, self.limits.max_new_tokens, room))

    def _adjustments(self, params: SamplingParams) -> ScoreAdjustments | None:
        if not (params.presence_penalty or params.frequency_penalty or params.logit_bias):
            return None
        return ScoreAdjustments(
            self.vocab_size, params.presence_penalty or 0.0, params.frequency_penalty or 0.0, params.logit_bias or {}
        )

    def _generation_config(self, params: SamplingParams, max_new_tokens: int) -> GenerationConfig:
        d = self._defaults
        temperature = (
            params.temperature if params.temperature is not None else ((d.temperature if d.do_sample else 0.0) or 0.0)
        )
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            eos_token_id=self.loaded.eos_token_ids,
            pad_token_id=d.pad_token_id if d.pad_token_id is not None else self.loaded.eos_token_ids[0],
            repetition_penalty=params.repetition_penalty or d.repetition_penalty or 1.0,
        )
        if temperature > 0:
            config.do_sample = True
            config.temperature = temperature
            config.top_p = params.top_p if params.top_p is not None else (d.top_p or 1.0)
            top_k = params.top_k if params.top_k is not None else (d.top_k or 0)
            config.top_k = top_k  # 0 = off, as generate reads it too (None means its default, 50)
        else:
            config.do_sample = False
            config.temperature = config.top_p = config.top_k = None
        return config

    # -- inside the model slot ----------------------------------------------------------------

    def _keep_cache(self, run: _Run, media: list[VisionSpan], sequence: Sequence) -> None:
        """Store a finished sequence's KV cache for the next turn (on the scheduler's thread): it
        covers the prompt and the answer except its last token (never fed back to the model)."""
        cache = sequence.cache
        if cache is None or sequence.error is not None:
            return
        covered = torch.tensor(sequence.token_ids[: cache.get_seq_length()])
        self.conversations.keep(run.request.conversation_id, covered, media, run.prompt.num_tokens, cache)

    def _sequence(self, run: _Run) -> Sequence:
        """The request as the scheduler runs it: its prefill steps, sampler, stream and limits."""
        params, spans = run.request.params, run.prompt.spans
        media = spans["image"] + spans["video"]
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        return Sequence(
            prompt_ids=run.prompt.input_ids[0].tolist(),
            prefill=self.prefiller.steps(run.prompt, run.request.conversation_id, run.marks),
            sampler=Sampler(
                self._generation_config(params, run.max_new_tokens), seed, params.logprobs, self._adjustments(params)
            ),
            constraint=run.constraint,
            drafts=DraftBudget(self.settings.speculative_tokens) if self._speculates(run.request) else None,
            streamer=run.stream,
            cancel=run.request.cancel,
            max_new_tokens=run.max_new_tokens,
            eos_token_ids=frozenset(self.loaded.eos_token_ids),
            deadline=run.deadline,
            on_leave=lambda done: self._keep_cache(run, media, done),
        )

    def _speculates(self, request: GenerationRequest) -> bool:
        """Guessed tokens for this request: SPECULATIVE on, the request not against, INT8 or 4-bit weights in
        memory (fp32 GEMMs compute up to 4 rows one at a time here: verifying k guesses costs k steps;
        mapped INT8 weights take another path past a few rows, so a verify pass would not be exact)."""
        return (
            self.settings.speculative == "on"
            and request.speculative
            and self.loaded.quantization in ("int8", "int4")
            and not self.loaded.weights_mapped
        )

    def _events(self, run: _Run) -> Iterator[TextDelta | Completion]:
        request = run.request
        sequence = self._sequence(run)
        self.scheduler.submit(sequence)
        stopper = StopStringMatcher(request.params.stop)
        parts: list[str] = []
        logprobs = _LogprobCursor(sequence.sampler.logprobs, self.loaded.eos_token_ids, self.token_text)
        try:
            for piece, tokens in run.stream:
                if stopper.stopped:
                    continue  # drain until the scheduler notices the cancel event
                text = stopper.feed(piece)
                if stopper.stopped:
                    request.cancel.set()
                if text:
                    parts.append(text)
                    yield TextDelta(text, logprobs.upto(tokens))
            sequence.done.wait()
            if sequence.error is not None:
                raise sequence.error
            tail = stopper.flush()
            # the records of tokens no text showed yet (a held-back character, tokens that render as
            # nothing), unless a stop string ended the answer before them
            rest = [] if stopper.stopped else logprobs.upto(len(run.stream.token_ids))
            if tail or rest:
                parts.append(tail)
                yield TextDelta(tail, rest)
        finally:
            # Client gone (GeneratorExit) or error: the sequence leaves the batch at the next step.
            request.cancel.set()
            sequence.done.wait()
        yield self._completion(run, sequence, "".join(parts), stopper.stopped, logprobs.reported)

    def _completion(
        self, run: _Run, sequence: Sequence, text: str, stopped: bool, logprobs: list[TokenLogprob] | None
    ) -> Completion:
        ids, prompt = run.stream.token_ids, run.prompt
        end = time.perf_counter()
        if sequence.constraint is not None and stopped and not sequence.constraint.complete:
            finish = "length"  # a stop string cut the grammar's match short
        elif stopped or (ids and ids[-1] in self.loaded.eos_token_ids):
            finish = "stop"
        elif len(ids) >= run.max_new_tokens:
            finish = "length"
        elif end >= run.deadline:
            finish = "deadline"
        else:
            finish = "cancelled"
        return Completion(
            text=text,
            finish_reason=finish,
            prompt_tokens=prompt.num_tokens,
            completion_tokens=len(ids),
            cached_tokens=run.marks.reused,
            cached_from=run.marks.reused_from,
            timings=self._timings(run, sequence, end),
            vision_cache_hits=run.marks.vision_hits,
            images=len(prompt.pixel_values),
            videos=len(prompt.pixel_values_videos),
            answer_token_ids=self._answer_ids(ids, text),
            token_ids=tuple(ids),
            drafted_tokens=sequence.drafts.drafted if sequence.drafts else 0,
            accepted_tokens=sequence.drafts.accepted if sequence.drafts else 0,
            logprobs=logprobs,
            boxes=find_boxes(text, pictures_of(run.request.messages)) if "_2d" in text else [],
        )

    @staticmethod
    def _timings(run: _Run, sequence: Sequence, end: float) -> Timings:
        request, stream, marks = run.request, run.stream, run.marks
        first = stream.first_token_at or end
        decode = end - first
        tokens = len(stream.token_ids)
        started = sequence.prefill_started_at or end
        return Timings(
            queue_wait=run.waited + started - sequence.submitted_at,
            image_decode=request.image_decode_seconds,
            video_decode=request.video_decode_seconds,
            cache_lookup=marks.cache_lookup,
            vision_encode=marks.vision_encode,
            prefill=first - (marks.prefill_start or first),
            time_to_first_token=first - request.received_at,
            decode=decode,
            decode_tokens_per_s=(tokens - 1) / decode if tokens > 1 and decode > 0 else 0.0,
            longest_token_gap=stream.longest_gap,
            total=end - request.received_at,
        )

    def _answer_ids(self, ids: list[int], text: str) -> tuple[int, ...] | None:
        """The generated ids of an answer whose text they are exactly (no stop string cut it, no
        special token hides in it), without the end-of-turn token the chat template adds back."""
        if ids and ids[-1] in self.loaded.eos_token_ids:
            ids = ids[:-1]
        same = self.processor.tokenizer.decode(ids, skip_special_tokens=False) == text
        return tuple(ids) if ids and same else None


@dataclass(eq=False)
class _Run:
    """One admitted request inside the engine: what `submit` worked out once, and its live state."""

    request: GenerationRequest
    prompt: PreparedPrompt
    max_new_tokens: int
    constraint: Constraint | None
    deadline: float  # perf_counter time at which the generation is ended (REQUEST_DEADLINE)
    stream: TokenStream
    waited: float = 0.0  # seconds in the admission queue
    marks: PrefillMarks = field(default_factory=PrefillMarks)


class _LogprobCursor:
    """Hands out the sampler's logprob records of the tokens behind each piece of text, once each,
    with each token's bytes filled in (on the request's thread, not the scheduler's); end-of-turn
    tokens are not part of the answer and are left out."""

    def __init__(self, records: list[TokenLogprob] | None, eos_token_ids: list[int], text: TokenText):
        self._records = records
        self._eos = frozenset(eos_token_ids)
        self._text = text
        self._given = 0
        self.reported: list[TokenLogprob] | None = [] if records is not None else None

    def upto(self, tokens: int) -> list[TokenLogprob]:
        if self._records is None:
            return []
        new = [self._text.rendered(r) for r in self._records[self._given : tokens] if r.token_id not in self._eos]
        self._given = max(self._given, tokens)
        self.reported.extend(new)
        return new
