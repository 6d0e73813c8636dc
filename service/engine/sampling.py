"""Choosing a sequence's next token: generate's logits processors, OpenAI's penalties and
logit_bias, a grammar's mask, then the argmax or a draw from the sequence's own generator.

The same choice on every CPU: softmax and log-softmax are service/native/float_ops.py's (torch's sum
in an order that follows the instruction set), top-p sorts stably and adds the probabilities in one
order, and the draw is torch's multinomial (its exponential variates come from the generator's doubles
through libm's log1p: the same on every x86-64 CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from ..answer.logprobs import TokenLogprob, token_logprob
from ..generation import SamplingParams
from ..native import float_ops


@dataclass(frozen=True)
class Sampling:
    """A request's sampling, resolved: its parameters where it set them, else the checkpoint's
    generation_config defaults. `temperature` 0 is greedy (top_p and top_k then play no part)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    seed: int = 0
    top_logprobs: int | None = None  # record each token's log-probability and this many alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @classmethod
    def resolve(cls, params: SamplingParams, defaults) -> Sampling:
        """`params` over `defaults` (a transformers GenerationConfig: the checkpoint's); an unset seed
        is drawn at random."""
        d = defaults
        temperature = params.temperature
        if temperature is None:
            temperature = (d.temperature if d.do_sample else 0.0) or 0.0
        sampled = temperature > 0
        return cls(
            temperature=temperature,
            top_p=(params.top_p if params.top_p is not None else (d.top_p or 1.0)) if sampled else 1.0,
            top_k=(params.top_k if params.top_k is not None else (d.top_k or 0)) if sampled else 0,
            repetition_penalty=params.repetition_penalty or d.repetition_penalty or 1.0,
            seed=params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1,
            top_logprobs=params.logprobs,
            presence_penalty=params.presence_penalty or 0.0,
            frequency_penalty=params.frequency_penalty or 0.0,
            logit_bias=dict(params.logit_bias or {}),
        )


class Sampler:
    """One sequence's next token: generate's logits processors for its `Sampling`, then the argmax
    (greedy) or a draw from the sequence's own generator (the same draws `generate` makes after
    `torch.manual_seed(seed)`). OpenAI's penalties and logit_bias (`adjustments`), then a grammar's
    mask, apply after the repetition penalty.

    A guessed token (service/engine/drafts.py) never enters the choice: the token is drawn as ever,
    and the guess is accepted when it is that token — with the model's probability of it, the rest
    of the distribution otherwise: a point-mass draft's exact rule, and the generator consumed as
    without guesses, so a seeded answer is the same with speculation on and off.

    It keeps each chosen token's log-probability (float32) in `chosen` — from the distribution it drew
    from: penalties, bias, mask and temperature applied (greedy: temperature 1), top-k/top-p truncation
    not — for the answer's digest (service/answer/digest.py); with `top_logprobs` set (0-20) it also
    records it (and that many alternatives') in `logprobs` (so no alternative shows -inf)."""

    def __init__(self, sampling: Sampling, vocab_size: int):
        self.do_sample = not sampling.greedy
        penalty = sampling.repetition_penalty
        self.penalty = RepetitionPenaltyLogitsProcessor(penalty) if penalty != 1.0 else None
        self.warpers = LogitsProcessorList()
        if self.do_sample:
            if sampling.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k:
                self.warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                self.warpers.append(TopP(sampling.top_p))
        self.generator = torch.Generator().manual_seed(sampling.seed)
        self.temperature = sampling.temperature if self.do_sample else 1.0
        self.top_logprobs = sampling.top_logprobs
        self.logprobs: list[TokenLogprob] | None = [] if sampling.top_logprobs is not None else None
        self.chosen: list[float] = []  # every chosen token's log-probability
        adjusted = sampling.presence_penalty or sampling.frequency_penalty or sampling.logit_bias
        self.adjustments = (
            ScoreAdjustments(vocab_size, sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias)
            if adjusted
            else None
        )

    def __call__(self, token_ids: list[int], logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        """The next token after `token_ids` (prompt and answer so far) given its logits (1 × vocab);
        `allowed` (bool, vocab) is a grammar's mask."""
        scores = self.penalty(torch.tensor([token_ids]), logits) if self.penalty else logits
        if self.adjustments is not None:
            scores = self.adjustments(scores)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        token = self._draw(scores)
        if self.adjustments is not None:
            self.adjustments.record(token)
        tempered = scores.float()[0] if self.temperature == 1.0 else scores.float()[0] / self.temperature
        if self.logprobs is not None:
            distribution = float_ops.log_softmax(tempered)
            self.chosen.append(float(distribution[token]))
            self.logprobs.append(token_logprob(distribution, token, self.top_logprobs))
        else:  # the chosen token's alone: the same float, no vocabulary-sized result
            self.chosen.append(float_ops.log_softmax_at(tempered, token))
        return token

    def _draw(self, scores: torch.Tensor) -> int:
        if self.do_sample:
            probs = float_ops.softmax(self.warpers(None, scores) if self.warpers else scores)
            if torch.isfinite(probs).all():
                return int(torch.multinomial(probs, 1, generator=self.generator))
            # A temperature (or penalty) so extreme that the scores overflowed: the distribution's
            # limit is all its mass on the most likely token.
        return int(scores.nan_to_num(nan=float("-inf")).argmax(-1))


class TopP:
    """transformers' TopPLogitsWarper (the smallest set of most likely tokens whose probability reaches
    top_p; the most likely always kept), on every CPU alike: a stable sort (ties in token order, where
    an unstable one may order them by the instruction set), float_ops' softmax, and the probabilities
    added one after another in float64, each sum rounded to float32 as torch's cumsum rounds it."""

    def __init__(self, top_p: float):
        self.top_p = top_p

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = torch.sort(scores, descending=False, stable=True)
        probabilities = float_ops.softmax(sorted_scores.float()).numpy()
        cumulative = torch.from_numpy(np.cumsum(probabilities.astype(np.float64), axis=-1).astype(np.float32))
        remove = cumulative <= (1 - self.top_p)
        remove[..., -1:] = False
        return scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))


class ScoreAdjustments:
    """OpenAI's presence and frequency penalties (by how often each token is in the answer so far)
    and logit_bias: one offset per token id, added to a sequence's scores after the repetition
    penalty, and updated by each token chosen."""

    def __init__(self, vocab_size: int, presence: float, frequency: float, bias: dict[int, float]):
        self.presence, self.frequency = presence, frequency
        self.offset = torch.zeros(vocab_size)
        if bias:
            self.offset[list(bias)] = torch.tensor(list(bias.values()))
        self._seen: set[int] = set()

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.offset

    def record(self, token: int) -> None:
        self.offset[token] -= self.frequency + (self.presence if token not in self._seen else 0.0)
        self._seen.add(token)
