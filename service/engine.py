"""The engine: owns one loaded model and turns a chat request into a stream of text deltas.

One generation runs at a time (transformers keeps per-model state such as `rope_deltas` that
concurrent `generate` calls corrupt); `Admission` queues the rest. `generate` runs on a worker
thread writing into a `TokenStreamer`; the request's generator reads it, and closing that
generator (client gone) cancels the thread within one token and joins it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import GenerationConfig

from .admission import Admission
from .errors import BadRequest, PromptTooLong
from .loading import LoadedModel
from .prompts import ChatMessage, PreparedPrompt, PromptLimits, prepare_prompt
from .settings import Settings
from .streaming import CancelOnEvent, StopStringMatcher, TokenStreamer
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
    request_id: str = ""
    conversation_id: str | None = None
    streamer: TokenStreamer | None = None  # set while generating: live token count for callers

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
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict[str, float]
    vision_cache_hits: int = 0
    images: int = 0


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

    # -- request path -------------------------------------------------------------------------

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenize and patchify; raises 4xx errors before the request queues for the model."""
        request.params.validate(self.settings.max_stop_strings)
        return prepare_prompt(self.processor, request.messages, PromptLimits.from_settings(self.settings))

    def generate(self, request: GenerationRequest, prompt: PreparedPrompt | None = None) -> Iterator[TextDelta | Completion]:
        """Yield TextDelta events as tokens arrive, then one Completion. Admission happens on the
        first `next()`; closing the generator cancels generation."""
        prompt = prompt or self.prepare(request)
        with self.admission.slot() as waited:
            yield from self._run(request, prompt, waited)

    def start(self, request: GenerationRequest, prompt: PreparedPrompt | None = None) -> "Generation":
        """Prepare and admit now — so 4xx, 429 and 503 are raised before any byte is sent — and
        return the event stream. The model slot is released when the stream ends or is closed."""
        prompt = prompt or self.prepare(request)
        waited = self.admission.acquire()
        self._active.add(request)

        def release():
            self._active.discard(request)
            self.admission.release()

        return Generation(self._run(request, prompt, waited), release)

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

    def _encode_images(self, prompt: PreparedPrompt) -> dict | None:
        """Vision encoder for the prompt's images → `mm_encoder_outputs` for generate."""
        if not prompt.pixel_values:
            return None
        features = self.vision_encoder(torch.cat(prompt.pixel_values), prompt.image_grid_thw)
        return as_mm_encoder_outputs(features)

    def _run(self, request: GenerationRequest, prompt: PreparedPrompt, waited: float) -> Iterator[TextDelta | Completion]:
        params = request.params
        max_new_tokens = self._max_new_tokens(prompt, params)
        config = self._generation_config(params, max_new_tokens)
        timings = {"queue_wait": waited, "image_decode": request.image_decode_seconds}
        # A stale value from another request gives silently wrong positions (DESIGN.md).
        self.model.model.rope_deltas = None
        t0 = time.perf_counter()
        with torch.inference_mode():
            mm_encoder_outputs = self._encode_images(prompt)
        timings["vision_encode"] = time.perf_counter() - t0
        if request.cancel.is_set():
            return
        streamer = request.streamer = TokenStreamer(self.processor.tokenizer, timeout=None)
        kwargs = dict(
            input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
            mm_token_type_ids=prompt.mm_token_type_ids, generation_config=config, streamer=streamer,
            stopping_criteria=[CancelOnEvent(request.cancel)], return_dict_in_generate=True,
        )
        if prompt.image_grid_thw is not None:
            kwargs["image_grid_thw"] = prompt.image_grid_thw
        if mm_encoder_outputs is not None:
            kwargs["mm_encoder_outputs"] = mm_encoder_outputs
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        outcome: dict = {}
        prefill_start = time.perf_counter()
        thread = threading.Thread(target=self._generate_thread, args=(kwargs, seed, outcome, streamer),
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
        ids = streamer.token_ids
        end = time.perf_counter()
        first = streamer.first_token_at or end
        if stopper.stopped:
            finish = "stop"
        elif ids and ids[-1] in self.loaded.eos_token_ids:
            finish = "stop"
        elif len(ids) >= max_new_tokens:
            finish = "length"
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
                         completion_tokens=len(ids), cached_tokens=0, timings=timings,
                         images=len(prompt.pixel_values))

    def _generate_thread(self, kwargs: dict, seed: int, outcome: dict, streamer: TokenStreamer) -> None:
        try:
            torch.manual_seed(seed)
            with torch.inference_mode():
                outcome["result"] = self.model.generate(**kwargs)
        except Exception as exc:  # re-raised in the request's thread, which logs it with its id
            outcome["error"] = exc
            streamer.end()  # unblock the reader
