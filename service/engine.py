"""The engine: owns one loaded model and turns a chat request into a stream of text deltas.

Up to MAX_BATCH_SIZE requests are decoded together by one scheduler thread (service/batching.py:
continuous batching, prefill interleaved with decoding); `Admission` queues the rest. The
scheduler writes each request's tokens into its `TokenStreamer`; the request's generator reads it,
and closing that generator (client gone) takes the request out of the batch within one step.
The model is called with explicit M-RoPE positions per sequence, never through `generate`, so
transformers' per-model `rope_deltas` state plays no part.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Generator, Iterator

import torch
from transformers import GenerationConfig

from . import metrics
from .admission import Admission
from .batching import Prefilled, Sampler, Scheduler, Sequence
from .caches import ConversationCache, ImageSpan, VisionFeatureCache
from .errors import BadRequest, PromptTooLong
from .kv import HEADROOM, GrowingCache
from .loading import LoadedModel
from .memory import CONVERSATION_CACHE_SHARE, MIB, VISION_CACHE_SHARE, MemoryGuard, kv_cache_bytes
from .prompts import ChatMessage, PreparedPrompt, PromptLimits, prepare_prompt
from .settings import Settings
from .streaming import StopStringMatcher, TokenStreamer
from .video import VideoLimits
from .encoders import make_vision_encoder
from .vision import VisionFeatures, as_mm_encoder_outputs
from .vision_steps import image_steps, video_steps

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """Per-request decoding parameters; None means the checkpoint's generation_config default."""

    max_tokens: int | None = None
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    repetition_penalty: float | None = None

    def validate(self, max_stop_strings: int = 4) -> None:
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature is None or 0 <= self.temperature <= 2, "temperature", "must be between 0 and 2"),
            (len(self.stop) <= max_stop_strings, "stop", f"may hold at most {max_stop_strings} strings"),
            (self.top_p is None or 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k is None or self.top_k >= 0, "top_k", "must be 0 (off) or more"),
            (self.repetition_penalty is None or 0 < self.repetition_penalty <= 10, "repetition_penalty",
             "must be in (0, 10]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be a non-negative 64-bit integer"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise BadRequest(f"{name} {message}", param=name)


@dataclass(eq=False)
class GenerationRequest:
    messages: list[ChatMessage]
    params: SamplingParams = field(default_factory=SamplingParams)
    cancel: threading.Event = field(default_factory=threading.Event)
    received_at: float = field(default_factory=time.perf_counter)
    image_decode_seconds: float = 0.0
    video_decode_seconds: float = 0.0
    request_id: str = ""
    conversation_id: str | None = None
    streamer: TokenStreamer | None = None  # set while generating: live token count for callers
    deadline: float | None = None  # perf_counter time at which generation is ended (REQUEST_DEADLINE)

    @property
    def generated_tokens(self) -> int:
        return len(self.streamer.token_ids) if self.streamer else 0


@dataclass
class TextDelta:
    text: str


@dataclass
class Completion:
    """The last event of every stream: how it ended, token counts and timings (seconds)."""

    text: str
    finish_reason: str  # stop | length | deadline | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict[str, float]
    vision_cache_hits: int = 0
    images: int = 0
    videos: int = 0
    answer_token_ids: tuple[int, ...] | None = None  # the ids behind `text`, when they decode to exactly it


class Generation:
    """An admitted generation: iterate for events; close() (or exhaustion) frees the model."""

    def __init__(self, events: Iterator[TextDelta | Completion], release):
        self._events = events
        self._release = release

    def __iter__(self):
        return self

    def __next__(self) -> TextDelta | Completion:
        try:
            return next(self._events)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Cancel (if running) and free the model slot; safe to call more than once."""
        self._events.close()
        release, self._release = self._release, None
        if release:
            release()


class Engine:
    """One model, a batch of generations at a time; see the module docstring."""

    def __init__(self, loaded: LoadedModel, settings: Settings):
        self.loaded = loaded
        self.settings = settings
        self.model = loaded.model
        self.processor = loaded.processor
        self.admission = Admission(settings.queue_size, settings.queue_timeout, slots=settings.max_batch_size)
        self.scheduler = Scheduler(loaded.model, settings.threads)
        self.kv_dtype = getattr(torch, settings.kv_dtype)
        self._active: set[GenerationRequest] = set()
        self._defaults = loaded.model.generation_config
        self.vision_encoder = make_vision_encoder(loaded, settings)
        # The memory budget: near it the caches give memory back (KV first: the largest), over it requests get 503.
        self.memory = MemoryGuard.from_settings(settings)
        kv_bytes, vision_bytes = self._cache_budgets(settings)
        self.conversation_cache = ConversationCache(
            loaded.model.config, kv_bytes, settings.conversation_cache_max_entries, settings.cache_ttl_seconds)
        self.vision_cache = VisionFeatureCache(vision_bytes, settings.vision_cache_max_entries,
                                               settings.cache_ttl_seconds)
        self.memory.evict_callbacks += [self.conversation_cache.entries.shrink, self.vision_cache.entries.shrink]
        metrics.MEMORY_BUDGET.set(self.memory.budget_bytes or 0)
        metrics.CACHE_BUDGET.labels(cache=self.conversation_cache.name).set(kv_bytes)
        metrics.CACHE_BUDGET.labels(cache=self.vision_cache.name).set(vision_bytes)
        ip = self.processor.image_processor
        self.video_limits = VideoLimits.from_settings(settings, loaded.image_limits, ip.temporal_patch_size)
        # Everything besides the pixels that shapes the encoder's input: part of every vision-cache key.
        self._vision_settings = hashlib.blake2b(repr((
            ip.patch_size, ip.merge_size, ip.temporal_patch_size, list(ip.image_mean), list(ip.image_std),
            dict(ip.size))).encode(), digest_size=8).hexdigest()

    def _cache_budgets(self, settings: Settings) -> tuple[int, int]:
        """The caches' byte budgets: as set, or shares of what the memory budget leaves after loading."""
        if not settings.cache_enabled:
            return 0, 0
        room = self.memory.room_bytes()
        kv = settings.conversation_cache_max_bytes
        vision = settings.vision_cache_max_bytes
        kv = int(room * CONVERSATION_CACHE_SHARE) if kv is None else kv
        vision = int(room * VISION_CACHE_SHARE) if vision is None else vision
        log.info("memory budget %.0f MiB, %.0f MiB used after loading: conversation cache up to %.0f MiB, vision "
                 "cache up to %.0f MiB", self.memory.budget_bytes / MIB, self.memory.used_bytes() / MIB, kv / MIB,
                 vision / MIB)
        return kv, vision

    # -- request path -------------------------------------------------------------------------

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenize and patchify; raises 4xx errors before the request queues for the model."""
        request.params.validate(self.settings.max_stop_strings)
        return prepare_prompt(self.processor, request.messages, PromptLimits.from_settings(self.settings))

    def generate(self, request: GenerationRequest, prompt: PreparedPrompt | None = None) -> Iterator[TextDelta | Completion]:
        """`start` as a plain generator (CLI, tests): admission happens on the first `next()`;
        closing the generator cancels generation."""
        generation = self.start(request, prompt)
        try:
            yield from generation
        finally:
            generation.close()

    def start(self, request: GenerationRequest, prompt: PreparedPrompt | None = None) -> "Generation":
        """Prepare and admit now — so 4xx, 429 and 503 are raised before any byte is sent — and
        return the event stream. The model slot is released when the stream ends or is closed."""
        prompt = prompt or self.prepare(request)
        self._check_memory(request, prompt)
        if request.deadline is None:
            request.deadline = request.received_at + self.settings.request_deadline
        waited = self.admission.acquire()
        self._active.add(request)

        def release():
            self._active.discard(request)
            self.admission.release()

        return Generation(self._run(request, prompt, waited), release)

    def _check_memory(self, request: GenerationRequest, prompt: PreparedPrompt) -> None:
        """Unavailable (503) if this request's KV cache would not fit MAX_MEMORY_MB, caches evicted first."""
        tokens = prompt.num_tokens + self._max_new_tokens(prompt, request.params) + HEADROOM  # GrowingCache's room
        self.memory.check(kv_cache_bytes(self.model.config, tokens, self.kv_dtype.itemsize))

    def cancel_all(self) -> None:
        """Stop every admitted generation at the scheduler's next step (graceful shutdown)."""
        for request in list(self._active):
            request.cancel.set()

    # -- inside the model slot ----------------------------------------------------------------

    def _max_new_tokens(self, prompt: PreparedPrompt, params: SamplingParams) -> int:
        room = self.settings.context_limit - prompt.num_tokens
        if room < 1:
            raise PromptTooLong(f"the prompt is {prompt.num_tokens} tokens; the context limit is "
                                f"{self.settings.context_limit}", param="messages")
        wanted = params.max_tokens or self.settings.default_max_tokens
        return max(1, min(wanted, self.settings.max_new_tokens, room))

    def _generation_config(self, params: SamplingParams, max_new_tokens: int) -> GenerationConfig:
        d = self._defaults
        temperature = params.temperature if params.temperature is not None else (
            (d.temperature if d.do_sample else 0.0) or 0.0)
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, eos_token_id=self.loaded.eos_token_ids,
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

    @staticmethod
    def _image_spans(prompt: PreparedPrompt) -> list[ImageSpan]:
        """Each image's token span, named by its pixels and grid (what the KV cache must match)."""
        spans = []
        grids = prompt.image_grid_thw if prompt.image_grid_thw is not None else []
        for (start, end), digest, grid in zip(prompt.image_spans, prompt.image_digests, grids):
            t, h, w = grid.tolist()
            spans.append(ImageSpan(start, end, f"{digest}:{t}x{h}x{w}"))
        return spans

    @staticmethod
    def _video_spans(prompt: PreparedPrompt) -> list[ImageSpan]:
        """Each video's token span (all its frames and timestamps), named by its frames and grid."""
        grids = prompt.video_grid_thw if prompt.video_grid_thw is not None else []
        return [ImageSpan(start, end, "video:{}:{}x{}x{}".format(digest, *grid.tolist()))
                for (start, end), digest, grid in zip(prompt.video_spans, prompt.video_digests, grids)]

    def _features(self, prompt: PreparedPrompt, spans: dict, reused: int) -> Generator[None, None, tuple[dict, int]]:
        """Features of each image and video after the first `reused` tokens (the rest are in the KV
        cache), by modality and index, from the vision cache or the encoder (run in steps); and how
        many came from the cache.

        One image (one video frame pair) per encoder call: a step stays short, and the features are
        those the cache keys name whatever else is being encoded."""
        encoders = {
            "image": lambda i: image_steps(self.vision_encoder, prompt.pixel_values[i], prompt.image_grid_thw[i:i + 1]),
            "video": lambda i: video_steps(self.vision_encoder, prompt.pixel_values_videos[i],
                                           prompt.video_grid_thw[i:i + 1]),
        }
        features, hits = {"image": {}, "video": {}}, 0
        for modality, encode in encoders.items():
            for i, span in enumerate(spans[modality]):
                if span.start < reused:
                    continue
                key = f"{self.vision_encoder.name}:{self._vision_settings}:{span.key}"
                cached = self.vision_cache.get(key)
                if cached is None:
                    cached = yield from encode(i)
                    self.vision_cache.put(key, cached)
                else:
                    hits += 1
                features[modality][i] = cached
        return features, hits

    def _piece_ends(self, length: int, reused: int) -> list[int]:
        """Where the prefill pieces after a cache of `reused` tokens end: every PREFILL_CHUNK_TOKENS,
        and at the end. (Every INT8 Linear quantizes per token, so where a prompt is cut changes
        nothing but float rounding in attention.)"""
        return [*range(reused + self.settings.prefill_chunk_tokens, length, self.settings.prefill_chunk_tokens), length]

    @staticmethod
    def _pads_before(prompt: PreparedPrompt, modality: str) -> torch.Tensor:
        """For each token index (and the end), how many of the prompt's pads of `modality` precede it."""
        type_id = 1 if modality == "image" else 2
        return torch.cat([torch.zeros(1, dtype=torch.long),
                          (prompt.mm_token_type_ids[0] == type_id).long().cumsum(0)])

    @staticmethod
    def _piece_features(merged: dict, pads_before: dict, reused: int, start: int, end: int) -> dict:
        """mm_encoder_outputs for prompt tokens [start, end): the rows of the features (`merged`:
        all images', or videos', after `reused`, concatenated) whose placeholders lie there — a
        piece may cut through a picture."""
        outputs = {}
        for modality, features in merged.items():
            before = pads_before[modality]
            lo, hi = int(before[start] - before[reused]), int(before[end] - before[reused])
            if hi > lo:
                outputs.update(as_mm_encoder_outputs([features.rows(lo, hi)], modality))
        return outputs

    def _prefill(self, request: GenerationRequest, prompt: PreparedPrompt, spans: dict, marks: dict) -> Generator[None, None, Prefilled]:
        """The request's prefill, run by the scheduler a step at a time between decode steps: KV-cache
        lookup, vision encoding (a block per step), then the prompt in pieces (`_piece_ends`), each
        one forward on the request's own cache. Records cache use and timings in `marks`."""
        t0 = time.perf_counter()
        images = spans["image"] + spans["video"]  # what the KV cache matches: the same for both
        reuse = self.conversation_cache.take(prompt.input_ids[0], images, request.conversation_id)
        reused = reuse.tokens if reuse else 0
        # The request owns the cache: each piece extends it in place.
        cache = reuse.cache if reuse is not None else GrowingCache(config=self.model.config, dtype=self.kv_dtype)
        marks.update(reused=reused, cache_lookup=time.perf_counter() - t0)
        try:
            t1 = time.perf_counter()
            features, marks["vision_hits"] = yield from self._features(prompt, spans, reused)
            marks["prefill_start"] = time.perf_counter()
            marks["vision_encode"] = marks["prefill_start"] - t1
            # M-RoPE positions of the whole prompt, from ALL its images' and videos' grids (a reused
            # prefix included); every token after it is shifted by the same delta.
            positions, deltas = self.model.model.get_rope_index(
                prompt.input_ids, prompt.mm_token_type_ids, prompt.image_grid_thw, prompt.video_grid_thw)
            merged = {m: VisionFeatures.cat([f[i] for i in sorted(f)]) for m, f in features.items() if f}
            pads_before = {m: self._pads_before(prompt, m) for m in merged}
            start = reused
            for end in self._piece_ends(prompt.num_tokens, reused):
                yield
                out = self.model(input_ids=prompt.input_ids[:, start:end], position_ids=positions[:, :, start:end],
                                 cache=cache, logits_to_keep=1,
                                 mm_encoder_outputs=self._piece_features(merged, pads_before, reused, start, end))
                start = end
        except GeneratorExit:  # cancelled while prefilling: hand the reused prefix back for the client's retry
            if reuse is not None:
                cache.crop(reused - cache.get_seq_length())
                self.conversation_cache.put(request.conversation_id, prompt.input_ids[0, :reused], images, reused,
                                            cache)
            raise
        return Prefilled(cache=cache, logits=out.logits[:, -1].float(), rope_delta=int(deltas[0, 0]))

    def _keep_cache(self, request: GenerationRequest, prompt: PreparedPrompt, images: list[ImageSpan],
                    sequence: Sequence) -> None:
        """Store a finished sequence's KV cache for the next turn (on the scheduler's thread): it
        covers the prompt and the answer except its last token (never fed back to the model)."""
        cache = sequence.cache
        if cache is None or sequence.error is not None:
            return
        covered = torch.tensor(sequence.token_ids[:cache.get_seq_length()])
        self.conversation_cache.put(request.conversation_id, covered, images, prompt.num_tokens, cache)

    def _run(self, request: GenerationRequest, prompt: PreparedPrompt, waited: float) -> Iterator[TextDelta | Completion]:
        params = request.params
        max_new_tokens = self._max_new_tokens(prompt, params)
        config = self._generation_config(params, max_new_tokens)
        spans = {"image": self._image_spans(prompt), "video": self._video_spans(prompt)}
        images = spans["image"] + spans["video"]
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        streamer = request.streamer = TokenStreamer(self.processor.tokenizer)
        marks: dict = {}
        sequence = Sequence(
            prompt_ids=prompt.input_ids[0].tolist(), prefill=self._prefill(request, prompt, spans, marks),
            sampler=Sampler(config, seed), streamer=streamer, cancel=request.cancel, max_new_tokens=max_new_tokens,
            eos_token_ids=frozenset(self.loaded.eos_token_ids), deadline=request.deadline,
            on_leave=lambda done: self._keep_cache(request, prompt, images, done))
        self.scheduler.submit(sequence)
        stopper = StopStringMatcher(params.stop)
        parts: list[str] = []
        try:
            for piece in streamer:
                if stopper.stopped:
                    continue  # drain until the scheduler notices the cancel event
                text = stopper.feed(piece)
                if stopper.stopped:
                    request.cancel.set()
                if text:
                    parts.append(text)
                    yield TextDelta(text)
            sequence.done.wait()
            if sequence.error is not None:
                raise sequence.error
            tail = stopper.flush()
            if tail:
                parts.append(tail)
                yield TextDelta(tail)
        finally:
            # Client gone (GeneratorExit) or error: the sequence leaves the batch at the next step.
            request.cancel.set()
            sequence.done.wait()
        ids = streamer.token_ids
        end = time.perf_counter()
        first = streamer.first_token_at or end
        if stopper.stopped:
            finish = "stop"
        elif ids and ids[-1] in self.loaded.eos_token_ids:
            finish = "stop"
        elif len(ids) >= max_new_tokens:
            finish = "length"
        elif request.deadline is not None and end >= request.deadline:
            finish = "deadline"
        else:
            finish = "cancelled"
        decode_seconds = end - first
        started = sequence.prefill_started_at or end
        timings = dict(
            # waiting for the model: for a batch slot, then behind other requests' prefills
            queue_wait=waited + started - sequence.submitted_at,
            image_decode=request.image_decode_seconds, video_decode=request.video_decode_seconds,
            cache_lookup=marks.get("cache_lookup", 0.0), vision_encode=marks.get("vision_encode", 0.0),
            prefill=first - marks.get("prefill_start", first),
            time_to_first_token=first - request.received_at,
            decode=decode_seconds,
            decode_tokens_per_s=(len(ids) - 1) / decode_seconds if len(ids) > 1 and decode_seconds > 0 else 0.0,
            longest_token_gap=streamer.longest_gap,  # e.g. while a neighbour in the batch prefilled
            total=end - request.received_at,
        )
        text = "".join(parts)
        yield Completion(text=text, finish_reason=finish, prompt_tokens=prompt.num_tokens,
                         completion_tokens=len(ids), cached_tokens=marks.get("reused", 0), timings=timings,
                         vision_cache_hits=marks.get("vision_hits", 0), images=len(prompt.pixel_values),
                         videos=len(prompt.pixel_values_videos), answer_token_ids=self._answer_ids(ids, text))

    def _answer_ids(self, ids: list[int], text: str) -> tuple[int, ...] | None:
        """The generated ids of an answer whose text they are exactly (no stop string cut it, no
        special token hides in it), without the end-of-turn token the chat template adds back."""
        if ids and ids[-1] in self.loaded.eos_token_ids:
            ids = ids[:-1]
        same = self.processor.tokenizer.decode(ids, skip_special_tokens=False) == text
        return tuple(ids) if ids and same else None
