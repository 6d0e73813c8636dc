"""Token streaming pieces: the streamer `generate` writes into, cancellation, and stop strings."""

from __future__ import annotations

import threading
import time

import torch
from transformers import StoppingCriteria, TextIteratorStreamer


class TokenStreamer(TextIteratorStreamer):
    """A TextIteratorStreamer that emits every token's text at once (not word by word) and records
    the generated ids and the time of the first one."""

    def __init__(self, tokenizer, timeout: float | None = None):
        super().__init__(tokenizer, skip_prompt=True, timeout=timeout, skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None
        self._held = 0  # tokens held back waiting for the rest of a UTF-8 character

    def put(self, value):
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        ids = value.flatten().tolist()
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids.extend(ids)
        self.token_cache.extend(ids)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        # An incomplete UTF-8 sequence: wait for its next byte-token, but never past 4 bytes.
        if text.endswith("\ufffd") and self._held < 3:
            self._held += 1
            return
        self._held = 0
        printable, self.print_len = text[self.print_len:], len(text)
        if text.endswith("\n"):  # keep the decode window short
            self.token_cache, self.print_len = [], 0
        if printable:
            self.on_finalized_text(printable)


class CancelOnEvent(StoppingCriteria):
    """Stops `generate` at the next token once `event` is set (client gone, stop string, shutdown)
    or the `deadline` (a perf_counter time) has passed — which also sets the event."""

    def __init__(self, event: threading.Event, deadline: float | None = None):
        self.event = event
        self.deadline = deadline

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            self.event.set()
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back any tail that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets `stopped` when a stop string appears."""
        if not self.stops:
            return text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return buf[:cut]
        hold = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
