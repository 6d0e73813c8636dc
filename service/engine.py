"""The engine: owns one loaded model and turns a chat request into a stream of text deltas.

One generation runs at a time (transformers keeps per-model state such as `rope_deltas` that
concurrent `generate` calls corrupt); `Admission` queues the rest. `generate` runs on a worker
thread writing into a `TokenStreamer`; the request's generator reads it, and closing that
generator (client gone) cancels the thread within one token and joins it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache, GenerationConfig

from .admission import Admission
from .caches import ConversationCache, ImageSpan, VisionFeatureCache
from .errors import BadRequest, PromptTooLong
from .loading import LoadedModel
from .memory import MemoryGuard, kv_cache_bytes, lru_evictor
from .prompts import ChatMessage, PreparedPrompt, PromptLimits, prepare_prompt
from .settings import Settings
from .streaming import CancelOnEvent, StopStringMatcher, TokenStreamer
from .turns import assistant_header_ids, cut_points
from .video import VideoLimits, encode_video
from .vision import as_mm_encoder_outputs, make_vision_encoder

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
    """One model, one generation at a time; see the module docstring."""

    def __init__(self, loaded: LoadedModel, settings: Settings):
        self.loaded = loaded
        self.settings = settings
        self.model = loaded.model
        self.processor = loaded.processor
        self.admission = Admission(settings.queue_size, settings.queue_timeout)
        self._active: set[GenerationRequest] = set()
        self._defaults = loaded.model.generation_config
        self.vision_encoder = make_vision_encoder(loaded, settings)
        on = settings.cache_enabled
        self.conversation_cache = ConversationCache(
            loaded.model.config, settings.conversation_cache_max_bytes if on else 0,
            settings.conversation_cache_max_entries, settings.cache_ttl_seconds)
        self.vision_cache = VisionFeatureCache(settings.vision_cache_max_bytes if on else 0,
                                               settings.vision_cache_max_entries, settings.cache_ttl_seconds)
        # MAX_MEMORY_MB: near it the caches give memory back (KV first: the largest), over it requests get 503.
        self.memory = MemoryGuard.from_settings(settings, [lru_evictor(self.conversation_cache.entries),
                                                           lru_evictor(self.vision_cache.entries)])
        ip = self.processor.image_processor
        self.video_limits = VideoLimits.from_settings(settings, loaded.image_limits, ip.temporal_patch_size)
        # Everything besides the pixels that shapes the encoder's input: part of every vision-cache key.
        self._vision_settings = hashlib.blake2b(repr((
            ip.patch_size, ip.merge_size, ip.temporal_patch_size, list(ip.image_mean), list(ip.image_std),
            dict(ip.size))).encode(), digest_size=8).hexdigest()
        # INT8 scales activations per forward call, so a token's keys and values depend on the tokens
        # computed with it. There a prompt is prefilled piece by piece, cut after each earlier turn
        # and each image, and a KV cache is reused only up to such a cut: then reuse computes
        # exactly what a cache-free engine computes.
        self._turn_header = assistant_header_ids(self.processor) if loaded.quantization == "int8" else None

    # -- request path -------------------------------------------------------------------------

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenize and patchify; raises 4xx errors before the request queues for the model."""
        request.params.validate(self.settings.max_stop_strings)
        return prepare_prompt(self.processor, request.messages, PromptLimits.from_settings(self.settings))

    def generate(self, request: GenerationRequest, prompt: PreparedPrompt | None = None) -> Iterator[TextDelta | Completion]:
        """Yield TextDelta events as tokens arrive, then one Completion. Admission happens on the
        first `next()`; closing the generator cancels generation."""
        prompt = prompt or self.prepare(request)
        self._check_memory(request, prompt)
        with self.admission.slot() as waited:
            yield from self._run(request, prompt, waited)

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
        tokens = prompt.num_tokens + self._max_new_tokens(prompt, request.params)
        self.memory.check(kv_cache_bytes(self.model.config, tokens))

    def cancel_all(self) -> None:
        """Stop every admitted generation at its next token (graceful shutdown)."""
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
            config.top_k = top_k or None
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

    def _encode_images(self, prompt: PreparedPrompt, images: list[ImageSpan], reused: int) -> tuple[dict, int]:
        """Features of each image after the first `reused` tokens (the rest are in the KV cache), by
        image index, from the vision cache or the encoder; and how many came from the cache.

        One image per encoder call, so an image's features never depend on what it was batched with
        (INT8 quantizes activations per batch) and a cached result equals a fresh one."""
        return self._cached_features(images, reused, lambda i: self.vision_encoder(
            prompt.pixel_values[i], prompt.image_grid_thw[i:i + 1])[0])

    def _encode_videos(self, prompt: PreparedPrompt, videos: list[ImageSpan], reused: int) -> tuple[dict, int]:
        """The same for videos, each encoded a frame pair at a time (service/video.py)."""
        return self._cached_features(videos, reused, lambda i: encode_video(
            self.vision_encoder, prompt.pixel_values_videos[i], prompt.video_grid_thw[i:i + 1]))

    def _cached_features(self, spans: list[ImageSpan], reused: int, encode) -> tuple[dict, int]:
        features, hits = {}, 0
        for i, span in enumerate(spans):
            if span.start < reused:
                continue
            key = f"{self.vision_encoder.name}:{self._vision_settings}:{span.key}"
            cached = self.vision_cache.get(key)
            if cached is None:
                cached = encode(i)
                self.vision_cache.put(key, cached)
            else:
                hits += 1
            features[i] = cached
        return features, hits

    def _model_inputs(self, prompt: PreparedPrompt, spans: dict, features: dict, start: int, end: int) -> dict:
        """generate's inputs for computing tokens [start, end) of the prompt after a KV cache of
        `start` tokens: ids, token types and ALL image and video grids up to `end` (positions need
        them), and the features of the images and videos in [start, end) only. `spans` and
        `features` are by modality ("image", "video")."""
        kwargs = dict(input_ids=prompt.input_ids[:, :end], attention_mask=torch.ones_like(prompt.input_ids[:, :end]),
                      mm_token_type_ids=prompt.mm_token_type_ids[:, :end])
        encoder_outputs = {}
        for modality, grids in (("image", prompt.image_grid_thw), ("video", prompt.video_grid_thw)):
            inside = [i for i, span in enumerate(spans[modality]) if span.end <= end]
            if inside:
                kwargs[f"{modality}_grid_thw"] = grids[: len(inside)]
            new = [features[modality][i] for i in inside if spans[modality][i].start >= start]
            if new:
                encoder_outputs.update(as_mm_encoder_outputs(new, modality))
        if encoder_outputs:
            kwargs["mm_encoder_outputs"] = encoder_outputs
        return kwargs

    def _prefill_plan(self, prompt: PreparedPrompt, spans: dict, features: dict, reused: int,
                      cuts: list[int] | None, cache: DynamicCache) -> tuple[list[dict], dict]:
        """generate's inputs after a cache of `reused` tokens: the pieces to prefill first (under INT8
        one forward per piece between cuts), then the rest of the prompt."""
        ends = [c for c in cuts or [] if c > reused] + [prompt.num_tokens]
        starts = [reused, *ends[:-1]]
        one_forward = self._generation_config(SamplingParams(temperature=0), 1)
        prefills = [dict(self._model_inputs(prompt, spans, features, start, end), cache=cache,
                         generation_config=one_forward) for start, end in zip(starts[:-1], ends[:-1])]
        return prefills, dict(self._model_inputs(prompt, spans, features, starts[-1], ends[-1]), cache=cache)

    def _keep_cache(self, request: GenerationRequest, prompt: PreparedPrompt, images: list[ImageSpan],
                    result) -> None:
        """Store the generation's KV cache for the next turn: it covers the prompt and the answer
        except its last token (never fed back to the model)."""
        cache = getattr(result, "cache", None)
        if cache is None:
            return
        if self._turn_header is not None:  # INT8 reuses up to cuts only: the answer's KV is no use
            cache.crop(prompt.num_tokens - cache.get_seq_length())
        covered = result.sequences[0, :cache.get_seq_length()]
        self.conversation_cache.put(request.conversation_id, covered, images, prompt.num_tokens, cache)

    def _run(self, request: GenerationRequest, prompt: PreparedPrompt, waited: float) -> Iterator[TextDelta | Completion]:
        params = request.params
        max_new_tokens = self._max_new_tokens(prompt, params)
        config = self._generation_config(params, max_new_tokens)
        timings = {"queue_wait": waited, "image_decode": request.image_decode_seconds,
                   "video_decode": request.video_decode_seconds}
        # A stale value from another request gives silently wrong positions (DESIGN.md); with None,
        # generate recomputes them from the full ids and ALL images' grids, cached prefix included.
        self.model.model.rope_deltas = None
        t0 = time.perf_counter()
        spans = {"image": self._image_spans(prompt), "video": self._video_spans(prompt)}
        images = spans["image"] + spans["video"]  # what the KV cache matches: the same for both
        cuts = None if self._turn_header is None else cut_points(prompt.input_ids[0], self._turn_header,
                                                                 [span.end for span in images])
        reuse = self.conversation_cache.take(prompt.input_ids[0], images, request.conversation_id, cuts)
        reused = reuse.tokens if reuse else 0
        t1 = time.perf_counter()
        with torch.inference_mode():
            image_features, image_hits = self._encode_images(prompt, spans["image"], reused)
            video_features, video_hits = self._encode_videos(prompt, spans["video"], reused)
        features, vision_hits = {"image": image_features, "video": video_features}, image_hits + video_hits
        timings["cache_lookup"] = t1 - t0
        timings["vision_encode"] = time.perf_counter() - t1
        if request.cancel.is_set():
            if reuse is not None:  # hand the reused prefix back for the client's retry
                self.conversation_cache.put(request.conversation_id, prompt.input_ids[0, :reused], images, reused,
                                            reuse.cache)
            return
        streamer = request.streamer = TokenStreamer(self.processor.tokenizer, timeout=None)
        # The request owns the cache: generate extends it in place.
        cache = reuse.cache if reuse is not None else DynamicCache(config=self.model.config)
        prefills, kwargs = self._prefill_plan(prompt, spans, features, reused, cuts, cache)
        kwargs.update(generation_config=config, streamer=streamer, stopping_criteria=[CancelOnEvent(request.cancel, request.deadline)],
                      return_dict_in_generate=True)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        outcome: dict = {}
        prefill_start = time.perf_counter()
        thread = threading.Thread(target=self._generate_thread, args=(prefills, kwargs, seed, outcome, streamer),
                                  name=f"generate-{request.request_id or id(request)}", daemon=True)
        thread.start()
        stopper = StopStringMatcher(params.stop)
        parts: list[str] = []
        try:
            for piece in streamer:
                if stopper.stopped:
                    continue  # drain until the thread notices the cancel event
                text = stopper.feed(piece)
                if stopper.stopped:
                    request.cancel.set()
                if text:
                    parts.append(text)
                    yield TextDelta(text)
            thread.join()
            if "error" in outcome:
                raise outcome["error"]
            tail = stopper.flush()
            if tail:
                parts.append(tail)
                yield TextDelta(tail)
        finally:
            # Client gone (GeneratorExit) or error: stop the thread within a token and wait for it.
            request.cancel.set()
            thread.join()
            if "result" in outcome:
                self._keep_cache(request, prompt, images, outcome["result"])
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
        timings.update(
            prefill=first - prefill_start,
            time_to_first_token=first - request.received_at,
            decode=decode_seconds,
            decode_tokens_per_s=(len(ids) - 1) / decode_seconds if len(ids) > 1 and decode_seconds > 0 else 0.0,
            total=end - request.received_at,
        )
        yield Completion(text="".join(parts), finish_reason=finish, prompt_tokens=prompt.num_tokens,
                         completion_tokens=len(ids), cached_tokens=reused, timings=timings,
                         vision_cache_hits=vision_hits, images=len(prompt.pixel_values),
                         videos=len(prompt.pixel_values_videos))

    def _generate_thread(self, prefills: list[dict], kwargs: dict, seed: int, outcome: dict,
                         streamer: TokenStreamer) -> None:
        try:
            torch.manual_seed(seed)
            with torch.inference_mode():
                for prefill in prefills:  # fills the cache with a piece of the prompt; its token is dropped
                    self.model.model.rope_deltas = None
                    self.model.generate(**prefill)
                self.model.model.rope_deltas = None
                outcome["result"] = self.model.generate(**kwargs)
        except Exception as exc:  # re-raised in the request's thread, which logs it with its id
            outcome["error"] = exc
            streamer.end()  # unblock the reader
