"""Log-probabilities of generated tokens, as the OpenAI API reports them: each chosen token's and
its most likely alternatives', from the distribution the sampler drew from."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id and log-probability, and the `top` most likely ids with theirs;
    `token_bytes` and `top_bytes` the tokens' exact bytes, once rendered (`TokenText.rendered`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    token_bytes: bytes = b""
    top_bytes: tuple[bytes, ...] = ()
    reasoning: bool = False  # a token of a thinking model's reasoning (or of its tags)


# What a token the distribution rules out is reported as (JSON has no -Infinity), as OpenAI does.
UNLIKELY = -9999.0


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`logprobs` (vocab,) is a log-softmax; `top` alternatives (0 = none) in descending order,
    only tokens the distribution allows (a grammar may allow fewer than `top`)."""
    alternatives = ()
    if top:
        values, ids = logprobs.topk(top)
        alternatives = tuple((i, v) for i, v in zip(ids.tolist(), values.tolist()) if math.isfinite(v))
    chosen = float(logprobs[token])
    return TokenLogprob(token, chosen if math.isfinite(chosen) else UNLIKELY, alternatives)


class TokenText:
    """A token id's text and its exact bytes (a byte-level BPE token may hold part of a character:
    its text then shows U+FFFD, its bytes say what it is)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
        self._special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._special or any(ch not in self._byte_of for ch in piece):
            return piece.encode()
        return bytes(self._byte_of[ch] for ch in piece)

    def rendered(self, record: TokenLogprob, reasoning: bool = False) -> TokenLogprob:
        """The record with its tokens' bytes filled in (and marked as reasoning's, if it is)."""
        return replace(
            record,
            token_bytes=self.bytes(record.token_id),
            top_bytes=tuple(self.bytes(i) for i, _ in record.top),
            reasoning=reasoning,
        )
