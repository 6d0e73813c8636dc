"""Choosing a sequence's next token: generate's logits processors, OpenAI's penalties and
logit_bias, a grammar's mask, then the argmax or a draw from the sequence's own generator."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..answer.logprobs import TokenLogprob, token_logprob


class Sampler:
    """One sequence's next token: generate's logits processors for its config, then the argmax
    (greedy) or a draw from the sequence's own generator (the same draws `generate` makes after
    `torch.manual_seed(seed)`). OpenAI's penalties and logit_bias (`adjustments`), then a grammar's
    mask, apply after the repetition penalty.

    A guessed token (service/engine/drafts.py) never enters the choice: the token is drawn as ever,
    and the guess is accepted when it is that token — with the model's probability of it, the rest
    of the distribution otherwise: a point-mass draft's exact rule, and the generator consumed as
    without guesses, so a seeded answer is the same with speculation on and off.

    With `top_logprobs` set (0-20) it records each chosen token's log-probability (and that many
    alternatives') in `logprobs`, from the distribution it drew from: penalties, bias, mask and temperature
    applied (greedy: temperature 1), top-k/top-p truncation not (so no alternative shows -inf)."""

    def __init__(
        self,
        config: GenerationConfig,
        seed: int,
        top_logprobs: int | None = None,
        adjustments: ScoreAdjustments | None = None,
    ):
        self.do_sample = bool(config.do_sample)
        penalty = config.repetition_penalty
        self.penalty = RepetitionPenaltyLogitsProcessor(penalty) if penalty is not None and penalty != 1.0 else None
        self.warpers = LogitsProcessorList()
        if self.do_sample:
            if config.temperature is not None and config.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k:
                self.warpers.append(TopKLogitsWarper(config.top_k))
            if config.top_p is not None and config.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(config.top_p))
        self.generator = torch.Generator().manual_seed(seed)
        self.temperature = config.temperature if self.do_sample and config.temperature else 1.0
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] | None = [] if top_logprobs is not None else None
        self.adjustments = adjustments

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
        if self.logprobs is not None:
            distribution = (scores.float() / self.temperature).log_softmax(-1)[0]
            self.logprobs.append(token_logprob(distribution, token, self.top_logprobs))
        return token

    def _draw(self, scores: torch.Tensor) -> int:
        if self.do_sample:
            probs = (self.warpers(None, scores) if self.warpers else scores).softmax(-1)
            if torch.isfinite(probs).all():
                return int(torch.multinomial(probs, 1, generator=self.generator))
            # A temperature (or penalty) so extreme that the scores overflowed: the distribution's
            # limit is all its mass on the most likely token.
        return int(scores.nan_to_num(nan=float("-inf")).argmax(-1))


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
