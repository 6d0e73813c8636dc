"""The engine: owns one loaded model and schedules requests on it.

`submit` runs a request through the input side (service/engine/input.py: checks, prompt, token
limit, grammar, memory), the admission queue (`admission`), and hands it to the scheduler as one
record with a status (service/engine/sequence.py): its prefill in steps (service/engine/prefill.py:
cache lookup, vision encoder, prompt pieces), then decode steps shared with the batch
(service/engine/scheduler.py). The output side (service/engine/output.py) turns its tokens into
events on the request's own thread. The model is called with explicit M-RoPE positions per
sequence, never through `generate`, so transformers' per-model `rope_deltas` state plays no part.

The HTTP layer uses `submit`, `count_tokens`, `run_search` (embeddings and relevance scores:
service/engine/search.py), `limits` and `info` only; what `submit` returns (`Generation`) is the caller's
handle on the request: its events, `cancel`, and its live state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from .. import metrics, native
from ..caches.setup import Caches
from ..generation import Completion, Generation, GenerationRequest, SamplingParams, TextDelta
from ..limits import RequestLimits
from ..memory import MemoryGuard
from ..model.attention import ExactAttention
from ..model.deltanet import is_hybrid
from ..model.forward import TextForward
from ..model.identity import numerics_identity, serving_fingerprint
from ..model.loading import LoadedModel
from ..model.mtp import MTPHead
from ..model.thinking import detect_thinking
from ..settings import Settings
from ..vision.encoders import make_vision_encoder
from .admission import Admission, Ticket
from .drafts import DraftBudget
from .input import InputProcessor, Prepared
from .mtp_drafts import HeadDrafts
from .output import OutputProcessor
from .prefill import Prefiller, StateSnapshots, covered_positions
from .reasoning import ReasoningPhase
from .sampling import Sampler, Sampling
from .scheduler import Scheduler
from .search import Searcher, SearchRequest, SearchResult
from .sequence import PrefillMarks, Sequence
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
    thinking: bool = False  # a thinking checkpoint: its reasoning comes apart from its answer
    fingerprint: str = ""  # OpenAI's system_fingerprint: the checkpoint and what computes with it
    task: str = "chat"  # chat, embedding or rerank (service/model/task.py)


class Engine:
    """One model, a batch of generations at a time; see the module docstring."""

    def __init__(self, loaded: LoadedModel, settings: Settings):
        self.loaded, self.settings = loaded, settings
        self.model, self.processor = loaded.model, loaded.processor
        thinking = detect_thinking(self.processor)  # None: not a thinking checkpoint
        self.limits = RequestLimits.build(settings, self.processor, thinking is not None)
        kernels = asdict(loaded.kernels) if loaded.kernels is not None else None
        metrics.record_int8_kernels(kernels)
        metrics.show_priority_classes()
        # One forward for prefill pieces and decode steps: a token's bits never depend on the path.
        native.configure(settings.cache_dir)
        self.forward = TextForward(loaded.model, ExactAttention.load())
        # the checkpoint's multi-token prediction head guesses, where it has one and speculation runs
        self.head = HeadDrafts(MTPHead(loaded.model.mtp, self.forward)) if self._head_drafts(loaded, settings) else None
        self.scheduler = Scheduler(self.forward, settings.threads, self.head)
        self.admission = Admission(
            settings.queue_size,
            settings.queue_timeout,
            slots=settings.max_batch_size,
            aging=settings.priority_aging_seconds,
            on_change=self.scheduler.wake,
        )
        self.vision_encoder = make_vision_encoder(loaded, settings)
        # The memory budget: near it the caches give memory back, over it requests get 503.
        self.memory = MemoryGuard.from_settings(settings)
        kv_dtype = getattr(torch, settings.kv_dtype)
        self.caches = Caches.from_settings(
            settings, loaded, self.memory, self.vision_encoder.name, kv_dtype, head=self.head is not None
        )
        self.inputs = InputProcessor(
            loaded, self.limits, self.memory, kv_dtype.itemsize, thinking, head_layers=int(self.head is not None)
        )
        serving_kernels = kernels and {part: kernels[part] for part in ("decoder", "vision")}  # not their timings
        fingerprint = serving_fingerprint(loaded.path, loaded.quantization, serving_kernels, settings.kv_dtype)
        self.info = ModelInfo(
            loaded.name,
            loaded.quantization,
            loaded.is_random,
            self.limits.image.max_pixels,
            kernels,
            thinking is not None,
            fingerprint,
            loaded.task,
        )
        if thinking is not None:
            log.info("%s is a thinking checkpoint: its reasoning is reported apart from its answer", loaded.name)
        numerics = numerics_identity(
            loaded.path, loaded.quantization, settings.kv_dtype, self.vision_encoder.name, loaded.weights_mapped
        )
        self.outputs = OutputProcessor(self.processor.tokenizer, loaded.eos_token_ids, numerics)
        self.prefiller = Prefiller(
            loaded.model,
            self.forward,
            self.vision_encoder,
            self.caches.kv,
            self.caches.vision,
            settings.prefill_chunk_tokens,
            kv_dtype,
            self._snapshots(loaded, settings),
            self.head,
        )
        self.search = Searcher(
            loaded,
            self.forward,
            self.prefiller,
            self.admission,
            self.scheduler,
            self.memory,
            self.limits,
            kv_dtype,
            settings,
        )

    def submit(self, request: GenerationRequest) -> Generation:
        """Check, tokenize and admit now — so 4xx, 429 and 503 are raised before any byte is sent —
        and hand the request to the scheduler; returns its Generation. The model slot is released
        once the stream has ended or been closed and the scheduler has let go of it."""
        self.search.refuse_unless("chat")  # an embedding model or a reranker does not chat
        prepared = self.inputs.prepare(request)
        asked = time.perf_counter()
        ticket = self.admission.acquire(request.priority, request.received_at, tenant=request.tenant)
        try:
            sequence = self._sequence(request, prepared, ticket, time.perf_counter() - asked)
        except BaseException:
            self.admission.release(ticket)
            raise
        self.scheduler.submit(sequence)

        def release():
            sequence.cancel()  # a generation closed before its end (or never iterated)
            sequence.done.wait()
            self.admission.release(ticket)

        return Generation(self.outputs.events(sequence), sequence, release)

    def run_search(self, request: SearchRequest) -> SearchResult:
        """An embeddings or rerank request's vectors or scores (service/engine/search.py), on the model
        beside the chat requests; 4xx before it waits, 429 and 503 as for chat."""
        return self.search.run(request)

    def count_tokens(self, request: GenerationRequest) -> int:
        """The tokens of the request's prompt, as `submit` would compute them (checked the same way);
        nothing is generated."""
        return self.inputs.prompt(request).num_tokens

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
        self.scheduler.cancel_all()

    def close(self, timeout: float = 10.0) -> None:
        """Before a process that is not a server exits (CLI): generation ended and the scheduler's thread
        returned, so it is not inside torch when the interpreter ends (queued disk writes flush at exit)."""
        if not self.scheduler.stop(timeout):
            log.warning("the scheduler did not stop within %.0f s", timeout)

    def _sequence(self, request: GenerationRequest, prepared: Prepared, ticket: Ticket, waited: float) -> Sequence:
        """The request as the scheduler runs it: its prefill steps, sampler, stream and limits."""
        marks, speculates = PrefillMarks(), self._speculates(request)
        return Sequence(
            request=request,
            prompt=prepared.prompt,
            max_new_tokens=prepared.max_new_tokens,
            deadline=request.received_at + self.settings.request_deadline,
            prefill=self.prefiller.steps(
                prepared.prompt, request.conversation_id, marks, request.cache_namespace, head=speculates
            ),
            sampler=Sampler(Sampling.resolve(request.params, self.model.generation_config), self.inputs.vocab_size),
            stream=TokenStream(self.processor.tokenizer),
            eos_token_ids=frozenset(self.loaded.eos_token_ids),
            on_leave=self._keep_cache,
            ticket=ticket,
            constraint=prepared.constraint,
            drafts=DraftBudget(self.settings.speculative_tokens) if speculates else None,
            reasoning=ReasoningPhase(self.inputs.thinking, *prepared.reasoning) if prepared.reasoning else None,
            queue_wait=waited,
            marks=marks,
        )

    @staticmethod
    def _snapshots(loaded: LoadedModel, settings: Settings) -> StateSnapshots | None:
        """A hybrid model's snapshot positions (None for Qwen3-VL, whose KV cache can be cut anywhere)."""
        if not is_hybrid(loaded.model.config.text_config):
            return None
        tokenizer = loaded.processor.tokenizer
        header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        return StateSnapshots(header, settings.state_snapshot_tokens, turn_end if isinstance(turn_end, int) else None)

    def _keep_cache(self, sequence: Sequence) -> None:
        """Store a finished sequence's KV cache for the next turn (on the scheduler's thread): it
        covers the prompt and the answer except its last token (never fed back to the model)."""
        cache, prompt = sequence.cache, sequence.prompt
        if cache is None or sequence.error is not None:
            return
        if self.head is not None and getattr(cache, "draft", None) is not None:  # its entries up to the last position
            self.head.settle([cache.draft])
        covered = torch.tensor(sequence.token_ids[: cache.get_seq_length()])
        positions = covered_positions(self.model, prompt, len(covered))
        media = prompt.spans["image"] + prompt.spans["video"]
        request = sequence.request
        self.caches.kv.keep(
            request.conversation_id, covered, positions, media, prompt.num_tokens, cache, request.cache_namespace
        )

    @staticmethod
    def _head_drafts(loaded: LoadedModel, settings: Settings) -> bool:
        """Whether the checkpoint's multi-token prediction head guesses (service/model/mtp.py): it
        carries one (loaded under MTP_DRAFTING=on), MTP_DRAFTING is on and speculation runs on these weights."""
        carries = getattr(loaded.model, "mtp", None) is not None and settings.mtp_drafting == "on"
        return carries and Engine._speculative_weights(loaded, settings)

    @staticmethod
    def _speculative_weights(loaded: LoadedModel, settings: Settings) -> bool:
        """SPECULATIVE on and INT8 or 4-bit weights in memory (fp32 is the reference numerics: its
        fixed-order GEMMs would verify exactly, but what that costs was not measured; mapped INT8 weights
        take another path past a few rows, so a verify pass would not be exact)."""
        return settings.speculative == "on" and loaded.quantization in ("int8", "int4") and not loaded.weights_mapped

    def _speculates(self, request: GenerationRequest) -> bool:
        """Guessed tokens for this request: the request not against, and weights that speculate."""
        return request.speculative and self._speculative_weights(self.loaded, self.settings)
