"""A request's stream of generated tokens: the scheduler puts ids in, the request's thread takes
text out."""

from __future__ import annotations

import queue
import time

from tokenizers.decoders import DecodeStream


class TokenStream:
    """The tokens the scheduler generates for one request. The scheduler only records them
    (`put_token`, `end`: no decoding on its thread); the request's thread iterates
    (text, token_count) pieces, decoding incrementally with tokenizers' `DecodeStream` — a piece
    for each token that completes text, none while a byte-level token holds part of a UTF-8
    character — and at the end whatever is still held, as the tokenizer decodes it. Also records
    the ids, the time of the first and the longest gap between two."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.longest_gap = 0.0  # the longest wait between two tokens, seconds

    def put_token(self, token: int) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.longest_gap = max(self.longest_gap, now - self.last_token_at)
        self.last_token_at = now
        self.token_ids.append(token)
        self._queue.put(token)

    def end(self) -> None:
        self._queue.put(None)

    def __iter__(self):
        decoder, rust = DecodeStream(skip_special_tokens=True), self._tokenizer.backend_tokenizer
        count, held = 0, []
        while (token := self._queue.get()) is not None:
            count += 1
            held.append(token)
            text = decoder.step(rust, token)
            if text:
                held.clear()
                yield text, count
        if held:  # an unfinished character at the end: shown as the tokenizer decodes it
            text = self._tokenizer.decode(held, skip_special_tokens=True)
            if text:
                yield text, count
