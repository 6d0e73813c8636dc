"""The engine: owns one loaded model and turns a chat request into a stream of text deltas.

Up to MAX_BATCH_SIZE requests are decoded together by one scheduler thread (service/batching.py:
continuous batching, prefill interleaved with decoding; service/prefill.py makes each request's
prefill); `Admission` queues the rest. The scheduler writes each request's tokens into its
`TokenStreamer`; the request's generator reads it, and closing that generator (client gone) takes
the request out of the batch within one step. The model is called with explicit M-RoPE positions
per sequence, never through `generate`, so transformers' per-model `rope_deltas` state plays no part.

The HTTP layer uses `submit`, `limits`, `info` and `token_text` only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from transformers import GenerationConfig

from . import metrics, native
from .admission import Admission
from .attention import ExactAttention
from .batching import Sampler, Scheduler, ScoreAdjustments, Sequence
from .caches import ConversationCache, VisionFeatureCache, VisionSpan
from .encoders import make_vision_encoder
from .errors import BadRequest, PromptTooLong
from .forward import TextForward
from .generation import Completion, Generation, GenerationRequest, SamplingParams, TextDelta, Timings
from .kv import HEADROOM
from .limits import RequestLimits
from .loading import LoadedModel
from .logprobs import TokenLogprob, TokenText
from .memory import CONVERSATION_CACHE_SHARE, MIB, VISION_CACHE_SHARE, MemoryGuard, kv_cache_bytes
from .prefill import Prefiller, PrefillMarks, vision_spans
from .prompts import PreparedPrompt, prepare_prompt, renders_tools
from .settings import Settings
from .streaming import StopStringMatcher, TokenStreamer
from .structured import Constraint, GrammarCompiler

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
        self.vocab_size = getattr(loaded.model.config, "text_config", loaded.model.config).vocab_size
        self.token_text = TokenText(self.processor.tokenizer)  # logprobs' token strings and bytes
        self.grammars = GrammarCompiler(self.processor.tokenizer, self.vocab_size, loaded.eos_token_ids)
        self.renders_tools = renders_tools(self.processor)
        self.prefiller = Prefiller(
            loaded.model,
            self.forward,
            self.vision_encoder,
            self.conversation_cache,
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

    # -- request path -------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Generation:
        """Check, tokenize and admit now — so 4xx, 429 and 503 are raised before any byte is sent —
        and return the event stream. The model slot is released when the stream ends or is closed."""
        prompt = self._prepare(request)
        constraint = self.grammars.constraint(request.grammar) if request.grammar else None
        self._check_memory(request, prompt)
        if request.deadline is None:
            request.deadline = request.received_at + self.settings.request_deadline
        waited = self.admission.acquire()
        self._active.add(request)

        def release():
            self._active.discard(request)
            self.admission.release()

        return Generation(self._run(request, prompt, waited, constraint), release)

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

    def _check_memory(self, request: GenerationRequest, prompt: PreparedPrompt) -> None:
        """Unavailable (503) if this request's KV cache would not fit the memory budget, caches evicted first."""
        tokens = prompt.num_tokens + self._max_new_tokens(prompt, request.params) + HEADROOM  # GrowingCache's room
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

    def _keep_cache(
        self, request: GenerationRequest, prompt: PreparedPrompt, media: list[VisionSpan], sequence: Sequence
    ) -> None:
        """Store a finished sequence's KV cache for the next turn (on the scheduler's thread): it
        covers the prompt and the answer except its last token (never fed back to the model)."""
        cache = sequence.cache
        if cache is None or sequence.error is not None:
            return
        covered = torch.tensor(sequence.token_ids[: cache.get_seq_length()])
        self.conversation_cache.put(request.conversation_id, covered, media, prompt.num_tokens, cache)

    def _sequence(
        self,
        request: GenerationRequest,
        prompt: PreparedPrompt,
        max_new_tokens: int,
        marks: PrefillMarks,
        constraint: Constraint | None,
    ) -> Sequence:
        """The request as the scheduler runs it: its prefill steps, sampler, streamer and limits."""
        params = request.params
        spans = vision_spans(prompt)
        media = spans["image"] + spans["video"]
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        request.streamer = TokenStreamer(self.processor.tokenizer)
        return Sequence(
            prompt_ids=prompt.input_ids[0].tolist(),
            prefill=self.prefiller.steps(prompt, spans, request.conversation_id, marks),
            sampler=Sampler(
                self._generation_config(params, max_new_tokens), seed, params.logprobs, self._adjustments(params)
            ),
            constraint=constraint,
            streamer=request.streamer,
            cancel=request.cancel,
            max_new_tokens=max_new_tokens,
            eos_token_ids=frozenset(self.loaded.eos_token_ids),
            deadline=request.deadline,
            on_leave=lambda done: self._keep_cache(request, prompt, media, done),
        )

    def _run(
        self, request: GenerationRequest, prompt: PreparedPrompt, waited: float, constraint: Constraint | None
    ) -> Iterator[TextDelta | Completion]:
        max_new_tokens = self._max_new_tokens(prompt, request.params)
        marks = PrefillMarks()
        sequence = self._sequence(request, prompt, max_new_tokens, marks, constraint)
        self.scheduler.submit(sequence)
        stopper = StopStringMatcher(request.params.stop)
        parts: list[str] = []
        logprobs = _LogprobCursor(sequence.sampler.logprobs, self.loaded.eos_token_ids)
        try:
            for piece, tokens in request.streamer:
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
            rest = [] if stopper.stopped else logprobs.upto(len(request.streamer.token_ids))
            if tail or rest:
                parts.append(tail)
                yield TextDelta(tail, rest)
        finally:
            # Client gone (GeneratorExit) or error: the sequence leaves the batch at the next step.
            request.cancel.set()
            sequence.done.wait()
        yield self._completion(
            request, prompt, sequence, marks, waited, "".join(parts), stopper.stopped, max_new_tokens, logprobs.reported
        )

    def _completion(
        self,
        request: GenerationRequest,
        prompt: PreparedPrompt,
        sequence: Sequence,
        marks: PrefillMarks,
        waited: float,
        text: str,
        stopped: bool,
        max_new_tokens: int,
        logprobs: list[TokenLogprob] | None,
    ) -> Completion:
        ids = request.streamer.token_ids
        end = time.perf_counter()
        if sequence.constraint is not None and stopped and not sequence.constraint.complete:
            finish = "length"  # a stop string cut the grammar's match short
        elif stopped or (ids and ids[-1] in self.loaded.eos_token_ids):
            finish = "stop"
        elif len(ids) >= max_new_tokens:
            finish = "length"
        elif request.deadline is not None and end >= request.deadline:
            finish = "deadline"
        else:
            finish = "cancelled"
        return Completion(
            text=text,
            finish_reason=finish,
            prompt_tokens=prompt.num_tokens,
            completion_tokens=len(ids),
            cached_tokens=marks.reused,
            timings=self._timings(request, sequence, marks, waited, end),
            vision_cache_hits=marks.vision_hits,
            images=len(prompt.pixel_values),
            videos=len(prompt.pixel_values_videos),
            answer_token_ids=self._answer_ids(ids, text),
            logprobs=logprobs,
        )

    @staticmethod
    def _timings(
        request: GenerationRequest, sequence: Sequence, marks: PrefillMarks, waited: float, end: float
    ) -> Timings:
        streamer = request.streamer
        first = streamer.first_token_at or end
        decode = end - first
        tokens = len(streamer.token_ids)
        started = sequence.prefill_started_at or end
        return Timings(
            queue_wait=waited + started - sequence.submitted_at,
            image_decode=request.image_decode_seconds,
            video_decode=request.video_decode_seconds,
            cache_lookup=marks.cache_lookup,
            vision_encode=marks.vision_encode,
            prefill=first - (marks.prefill_start or first),
            time_to_first_token=first - request.received_at,
            decode=decode,
            decode_tokens_per_s=(tokens - 1) / decode if tokens > 1 and decode > 0 else 0.0,
            longest_token_gap=streamer.longest_gap,
            total=end - request.received_at,
        )

    def _answer_ids(self, ids: list[int], text: str) -> tuple[int, ...] | None:
        """The generated ids of an answer whose text they are exactly (no stop string cut it, no
        special token hides in it), without the end-of-turn token the chat template adds back."""
        if ids and ids[-1] in self.loaded.eos_token_ids:
            ids = ids[:-1]
        same = self.processor.tokenizer.decode(ids, skip_special_tokens=False) == text
        return tuple(ids) if ids and same else None


class _LogprobCursor:
    """Hands out the sampler's logprob records of the tokens behind each piece of text, once each;
    end-of-turn tokens are not part of the answer and are left out."""

    def __init__(self, records: list[TokenLogprob] | None, eos_token_ids: list[int]):
        self._records = records
        self._eos = frozenset(eos_token_ids)
        self._given = 0
        self.reported: list[TokenLogprob] | None = [] if records is not None else None

    def upto(self, tokens: int) -> list[TokenLogprob]:
        if self._records is None:
            return []
        new = [r for r in self._records[self._given : tokens] if r.token_id not in self._eos]
        self._given = max(self._given, tokens)
        self.reported.extend(new)
        return new
