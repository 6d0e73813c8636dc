"""A request's prefill as steps the batch scheduler runs between decode steps: the conversation
cache lookup, the vision encoder (a block per step, features from the vision cache when seen
before), then the prompt in pieces of PREFILL_CHUNK_TOKENS, each one forward on the request's own
KV cache through the text decoder's forward (service/model/forward.py)."""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from ..caches.tiers import ConversationTiers
from ..caches.vision_features import VisionFeatureCache
from ..model.forward import Rows, TextForward, VisionRows
from ..model.kv import headroom
from ..model.prompts import PreparedPrompt
from ..vision.features import VisionFeatures
from ..vision.steps import image_steps, video_steps
from .mtp_drafts import HeadDrafts
from .sequence import Prefilled, PrefillMarks

_TYPE_IDS = {"image": 1, "video": 2}  # the processor's mm_token_type_ids


def prompt_positions(model, prompt: PreparedPrompt) -> tuple[torch.Tensor, int]:
    """The prompt's M-RoPE positions (3 × tokens), from ALL its images' and videos' grids (a reused
    prefix included), and the delta by which every token after it is shifted from its index."""
    positions, deltas = model.model.get_rope_index(
        prompt.input_ids, prompt.mm_token_type_ids, prompt.image_grid_thw, prompt.video_grid_thw
    )
    return positions[:, 0], int(deltas[0, 0])


def covered_positions(model, prompt: PreparedPrompt, tokens: int) -> torch.Tensor:
    """M-RoPE positions (3 × `tokens`) of the prompt and the answer after it (each at its index plus the delta)."""
    positions, delta = prompt_positions(model, prompt)
    after = torch.arange(prompt.num_tokens, max(tokens, prompt.num_tokens)) + delta
    return torch.cat([positions, after.expand(3, -1)], dim=1)[:, :tokens]


class PromptRows:
    """A prompt as rows of the text decoder's forward: its token ids, M-RoPE positions, and the
    vision features (`features`: each modality's, for its placeholders after the first `reused`
    tokens — the rest are in the KV cache — in order) that fill its placeholders."""

    def __init__(
        self,
        model,
        prompt: PreparedPrompt,
        features: dict[str, VisionFeatures],
        reused: int,
        positions: tuple[torch.Tensor, int] | None = None,  # prompt_positions', when the caller has them
    ):
        self.positions, self.rope_delta = positions or prompt_positions(model, prompt)
        self.ids = prompt.input_ids[0]
        self.types = prompt.mm_token_type_ids[0]
        self.features = features
        # for each token index (and the end), how many pads of a modality precede it, from `reused` on
        self._pads_before = {
            m: torch.cat([torch.zeros(1, dtype=torch.long), (self.types == _TYPE_IDS[m]).long().cumsum(0)])
            for m in features
        }
        self.reused = reused

    def piece(self, cache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, list[Rows]]:
        """The forward's arguments for prompt tokens [start, end) on `cache` — a piece may cut
        through a picture: it gets the feature rows of the placeholders it holds."""
        types = self.types[start:end]
        vision = []
        for modality, features in self.features.items():
            before = self._pads_before[modality]
            lo, hi = int(before[start] - before[self.reused]), int(before[end] - before[self.reused])
            if hi > lo:
                vision.append(VisionRows((types == _TYPE_IDS[modality]).nonzero()[:, 0], features.rows(lo, hi)))
        return self.ids[start:end], self.positions[:, start:end], [Rows(cache, end - start, vision)]


class StateSnapshots:
    """Where a hybrid model's prefill keeps its recurrent state (service/model/hybrid.py): where each
    turn starts and where an assistant turn's header (`<|im_start|>assistant\n`) ends — a later turn's
    re-rendered history shares the prompt up to there at least, even where the template writes the
    answer back otherwise than it was prompted (a thinking block dropped) — before each turn's end
    token (where a kept answer's cache ends: a resent history finds it there), every `every` tokens
    (0: never), and at the prompt's end. The same positions are where a lookup looks for a state."""

    def __init__(self, header: list[int], every: int, turn_end: int | None = None):
        self.header, self.every, self.turn_end = header, every, turn_end

    def points(self, token_ids: torch.Tensor) -> set[int]:
        length = len(token_ids)
        points = {length}
        if self.every:
            points.update(range(self.every, length, self.every))
        if self.header:
            for i in (token_ids == self.header[0]).nonzero()[:, 0].tolist():
                points.add(i)
                if token_ids[i : i + len(self.header)].tolist() == self.header:
                    points.add(i + len(self.header))
        if self.turn_end is not None:  # before each turn's end: where a kept answer's cache ends
            points.update((token_ids == self.turn_end).nonzero()[:, 0].tolist())
        return points - {0}


class Prefiller:
    """Makes each request's prefill generator (`steps`) on one model, its caches and its encoder."""

    def __init__(
        self,
        model,
        forward: TextForward,
        vision_encoder,
        kv_cache: ConversationTiers,
        vision_cache: VisionFeatureCache,
        chunk_tokens: int,
        kv_dtype: torch.dtype,
        snapshots: StateSnapshots | None = None,
        head: HeadDrafts | None = None,
    ):
        self.model, self.forward, self.vision_encoder = model, forward, vision_encoder
        self.kv_cache, self.vision_cache = kv_cache, vision_cache
        self.chunk_tokens, self.kv_dtype = chunk_tokens, kv_dtype
        self.snapshots = snapshots  # a hybrid model's: where its prompts' recurrent states are kept
        self.head = head  # the multi-token prediction head's entries, for sequences that draft with it

    def piece_ends(self, length: int, reused: int, also: set[int] = frozenset()) -> list[int]:
        """Where the prefill pieces after a cache of `reused` tokens end: every PREFILL_CHUNK_TOKENS,
        at the end, and at the positions in `also` (a hybrid model's snapshots). (service/model/forward.py
        computes every row alike: where a prompt is cut changes no bit.)"""
        ends = {*range(reused + self.chunk_tokens, length, self.chunk_tokens), length}
        return sorted(ends | {p for p in also if reused < p < length})

    def features(
        self, prompt: PreparedPrompt, reused: int, cache_namespace: str
    ) -> Generator[None, None, tuple[dict, int]]:
        """Features of each image and video after the first `reused` tokens (the rest are in the KV
        cache), by modality and index, from the vision cache or the encoder (run in steps); and how
        many came from the cache. One image (one video frame pair) per encoder call: a step stays
        short, and the features are those the cache keys name whatever else is being encoded."""
        encoders = {
            "image": lambda i: image_steps(
                self.vision_encoder, prompt.pixel_values[i], prompt.image_grid_thw[i : i + 1]
            ),
            "video": lambda i: video_steps(
                self.vision_encoder, prompt.pixel_values_videos[i], prompt.video_grid_thw[i : i + 1]
            ),
        }
        features, hits = {"image": {}, "video": {}}, 0
        for modality, encode in encoders.items():
            for i, span in enumerate(prompt.spans[modality]):
                if span.start < reused:
                    continue
                cached = self.vision_cache.get(span.key, cache_namespace)
                if cached is None:
                    cached = yield from encode(i)
                    self.vision_cache.put(span.key, cached, cache_namespace)
                else:
                    hits += 1
                features[modality][i] = cached
        return features, hits

    def steps(
        self,
        prompt: PreparedPrompt,
        conversation_id: str | None,
        marks: PrefillMarks,
        cache_namespace: str = "",
        head: bool = False,
    ) -> Generator[object, None, Prefilled]:
        """The prefill, a step per `yield` (which yields what it waits for, if it waits for a read);
        records cache use and timings in `marks`. The caches are those of `cache_namespace` only. With
        `head`, the sequence drafts with the multi-token prediction head: its cache carries the head's
        entries for every prompt position (a reused cache that holds none: it guesses otherwise)."""
        t0 = time.perf_counter()
        media = prompt.spans["image"] + prompt.spans["video"]  # what the KV cache matches: the same for both
        capacity = prompt.num_tokens + headroom(prompt.num_tokens)
        rope = prompt_positions(
            self.model, prompt
        )  # the disk tier's blocks are checked against them, and rows use them
        keep = sorted(self.snapshots.points(prompt.input_ids[0])) if self.snapshots is not None else []
        reuse = yield from self.kv_cache.lookup(
            prompt.input_ids[0], rope[0], media, conversation_id, capacity, cache_namespace, keep
        )
        marks.reused = reuse.tokens if reuse else 0
        marks.reused_from = reuse.source if reuse else None
        # The request owns the cache: each piece extends it in place.
        head = head and self.head is not None
        cache = reuse.cache if reuse is not None else self.forward.new_cache(self.kv_dtype, draft=head)
        if not head and getattr(cache, "draft", None) is not None:
            cache.draft = None  # this request does not guess: the head's entries would not follow its answer
        marks.cache_lookup = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            features, marks.vision_hits = yield from self.features(prompt, marks.reused, cache_namespace)
            marks.prefill_start = time.perf_counter()
            marks.vision_encode = marks.prefill_start - t1
            merged = {m: VisionFeatures.cat([f[i] for i in sorted(f)]) for m, f in features.items() if f}
            rows = PromptRows(self.model, prompt, merged, marks.reused, rope)
            cache.reserve(capacity)
            start, computing = marks.reused, 0.0
            for end in self.piece_ends(prompt.num_tokens, marks.reused, set(keep)):
                yield
                t2 = time.perf_counter()
                logits = self.forward(*rows.piece(cache, start, end), logits_rows=torch.tensor([end - start - 1]))
                if getattr(cache, "draft", None) is not None:
                    self.head.settle([cache.draft])
                if end in keep:
                    cache.snapshot()
                computing += time.perf_counter() - t2
                start = end
            self.kv_cache.measured_prefill(prompt.num_tokens - marks.reused, computing)
        except GeneratorExit:  # cancelled while prefilling: hand the reused prefix back for the client's retry
            if reuse is not None:
                cache.crop(marks.reused - cache.get_seq_length())
                reused = marks.reused
                self.kv_cache.keep(
                    conversation_id,
                    prompt.input_ids[0, :reused],
                    rope[0][:, :reused],
                    media,
                    reused,
                    cache,
                    cache_namespace,
                )
            raise
        return Prefilled(cache=cache, logits=logits.float(), rope_delta=rows.rope_delta)
