"""The output side: a sequence's tokens turned into what the client gets, on the request's own
thread — text deltas (a thinking model's reasoning apart from its answer, stop strings applied to
the answer, logprobs attached), then the Completion: why it ended (the sequence's status), usage,
timings, the answer's own token ids, and the boxes it names."""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..answer.digest import answer_digest
from ..answer.grounding import find_boxes
from ..answer.logprobs import TokenLogprob, TokenText
from ..answer.stops import StopStringMatcher
from ..generation import Completion, TextDelta, Timings
from ..model.prompts import pictures_of
from ..model.thinking import CLOSE_TAG, OPEN_TAG
from .reasoning import ReasoningPhase
from .sequence import Sequence


class OutputProcessor:
    """Shapes every sequence's answer for one tokenizer; `events` runs on the request's thread."""

    def __init__(self, tokenizer, eos_token_ids: list[int], numerics: str = ""):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.numerics = numerics  # what the answers' numbers depend on (model/identity.py): part of their digest
        self.token_text = TokenText(tokenizer)  # logprobs' token strings and bytes

    def events(self, sequence: Sequence) -> Iterator[TextDelta | Completion]:
        """Text deltas as the scheduler makes tokens, then the Completion. Closing it (client gone)
        ends the sequence at the scheduler's next step."""
        stopper = StopStringMatcher(sequence.request.params.stop)  # the answer's: not the reasoning's
        parts: list[str] = []
        split = _ReasoningSplit(sequence.reasoning)
        logprobs = _LogprobCursor(sequence.sampler.logprobs, self.eos_token_ids, self.token_text, sequence.reasoning)
        try:
            for piece, tokens in sequence.stream:
                if stopper.stopped:
                    continue  # drain until the scheduler takes it out
                thought, piece = split(piece, tokens)
                if thought or (not piece and logprobs.pending(tokens)):
                    yield TextDelta(thought, logprobs.upto(tokens), reasoning=True)
                if not piece:
                    continue
                text = stopper.feed(piece)
                if stopper.stopped:
                    sequence.cancel()
                if text:
                    parts.append(text)
                    yield TextDelta(text, logprobs.upto(tokens))
            sequence.done.wait()
            if sequence.error is not None:
                raise sequence.error
            if stopper.stopped:
                sequence.end_at_stop_string()
            tail = stopper.flush()
            # the records of tokens no text showed yet (a held-back character, tokens that render as
            # nothing), unless a stop string ended the answer before them
            rest = [] if stopper.stopped else logprobs.upto(len(sequence.stream.token_ids))
            if tail or rest:
                parts.append(tail)
                yield TextDelta(tail, rest)
        finally:
            # Client gone (GeneratorExit) or error: the sequence leaves the batch at the next step.
            sequence.cancel()
            sequence.done.wait()
        yield self._completion(sequence, "".join(parts), split.text, logprobs.reported, stopper.matched)

    def _completion(
        self,
        sequence: Sequence,
        text: str,
        reasoning: str | None,
        logprobs: list[TokenLogprob] | None,
        stop_string: str | None,
    ) -> Completion:
        ids, prompt, marks, phase = sequence.stream.token_ids, sequence.prompt, sequence.marks, sequence.reasoning
        answer_ids = ids if phase is None else ids[phase.answer_start :] if phase.answering else []
        image_tokens, video_tokens = prompt.visual_tokens
        return Completion(
            text=text,
            finish_reason=sequence.status.finish_reason,
            prompt_tokens=prompt.num_tokens,
            completion_tokens=len(ids),
            cached_tokens=marks.reused,
            cached_from=marks.reused_from,
            timings=self._timings(sequence),
            vision_cache_hits=marks.vision_hits,
            images=len(prompt.pixel_values),
            videos=len(prompt.pixel_values_videos),
            answer_token_ids=self._answer_ids(answer_ids, text),
            token_ids=tuple(ids),
            drafted_tokens=sequence.drafts.drafted if sequence.drafts else 0,
            accepted_tokens=sequence.drafts.accepted if sequence.drafts else 0,
            logprobs=logprobs,
            boxes=find_boxes(text, pictures_of(sequence.request.messages)) if "_2d" in text else [],
            reasoning=reasoning,
            reasoning_tokens=phase.spent if phase is not None else 0,
            image_tokens=image_tokens,
            video_tokens=video_tokens,
            preempted=sequence.ticket.preempted,
            stop_string=stop_string,
            answer_digest=answer_digest(self.numerics, ids, sequence.sampler.chosen[: len(ids)]),
        )

    @staticmethod
    def _timings(sequence: Sequence) -> Timings:
        request, stream, marks = sequence.request, sequence.stream, sequence.marks
        end = time.perf_counter()
        first = stream.first_token_at or end
        decode = end - first
        tokens = len(stream.token_ids)
        started = sequence.prefill_started_at or end
        return Timings(
            queue_wait=sequence.queue_wait + started - sequence.submitted_at,
            paused=sequence.ticket.paused_seconds,
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
        if ids and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        same = self.tokenizer.decode(ids, skip_special_tokens=False) == text
        return tuple(ids) if ids and same else None


class _ReasoningSplit:
    """A thinking model's stream split into reasoning and answer text by token position (what the
    scheduler's ReasoningPhase recorded before streaming each token): the tags and the separator
    show in neither, and the newlines the template writes around the reasoning are trimmed (held
    back while more reasoning may follow them). Without a phase, every piece is the answer's."""

    def __init__(self, phase: ReasoningPhase | None):
        self.phase = phase
        self._parts: list[str] = []
        self._held = ""  # newlines at the reasoning's end so far

    def __call__(self, piece: str, tokens: int) -> tuple[str, str]:
        """(reasoning text, answer text) of the piece ending with the `tokens`-th token."""
        phase, last = self.phase, tokens - 1
        if phase is None:
            return "", piece
        if last in phase.furniture:  # a tag or the separator (with any character's bytes held before it)
            piece = piece.replace(OPEN_TAG, "").replace(CLOSE_TAG, "").strip("\n")
        elif phase.answer_start is not None and last >= phase.answer_start:
            return "", piece
        text = self._held + piece
        if not self._parts:
            text = text.lstrip("\n")
        shown = text.rstrip("\n")
        self._held = text[len(shown) :]
        if shown:
            self._parts.append(shown)
        return shown, ""

    @property
    def text(self) -> str | None:
        return "".join(self._parts) if self.phase is not None else None


class _LogprobCursor:
    """Hands out the sampler's logprob records of the tokens behind each piece of text, once each,
    with each token's bytes filled in (on the request's thread, not the scheduler's) and a thinking
    model's reasoning tokens marked; end-of-turn tokens are not part of the answer and are left out."""

    def __init__(
        self,
        records: list[TokenLogprob] | None,
        eos_token_ids: frozenset[int],
        text: TokenText,
        phase: ReasoningPhase | None = None,
    ):
        self._records = records
        self._eos = eos_token_ids
        self._text = text
        self._phase = phase
        self._given = 0
        self.reported: list[TokenLogprob] | None = [] if records is not None else None

    def pending(self, tokens: int) -> bool:
        """Whether records of tokens up to `tokens` are still to be handed out."""
        return self._records is not None and tokens > self._given

    def upto(self, tokens: int) -> list[TokenLogprob]:
        if self._records is None:
            return []
        start = self._given
        records = self._records[start:tokens]
        new = [
            self._text.rendered(r, self._in_reasoning(start + i))
            for i, r in enumerate(records)
            if r.token_id not in self._eos
        ]
        self._given = max(self._given, tokens)
        self.reported.extend(new)
        return new

    def _in_reasoning(self, position: int) -> bool:
        phase = self._phase
        return phase is not None and (phase.answer_start is None or position < phase.answer_start)
