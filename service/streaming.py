"""Token streaming pieces: the streamer the batch scheduler writes each sequence's tokens into, and
stop strings."""

from __future__ import annotations

import time

from transformers import TextIteratorStreamer


class TokenStreamer(TextIteratorStreamer):
    """A TextIteratorStreamer that emits every token's text at once (not word by word), with the
    token count behind it, and records the generated ids, the time of the first one and the longest
    gap between two."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.longest_gap = 0.0  # the longest wait between two tokens, seconds
        self._held = 0  # tokens held back waiting for the rest of a UTF-8 character

    def put_token(self, token: int) -> None:
        """One generated token (the scheduler's call: no tensor made per token)."""
        ids = [token]
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.longest_gap = max(self.longest_gap, now - self.last_token_at)
        self.last_token_at = now
        self.token_ids.extend(ids)
        self.token_cache.extend(ids)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        # An incomplete UTF-8 sequence: wait for its next byte-token, but never past 4 bytes.
        if text.endswith("\ufffd") and self._held < 3:
            self._held += 1
            return
        self._held = 0
        printable, self.print_len = text[self.print_len :], len(text)
        if text.endswith("\n"):  # keep the decode window short
            self.token_cache, self.print_len = [], 0
        if printable:
            self.on_finalized_text(printable)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Queue the text with the number of tokens generated so far (its tokens are the ones since
        the previous piece): readers iterate (text, token_count) pairs."""
        self.text_queue.put((text, len(self.token_ids)), timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)


def partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters are the beginning of `tag` (0: none, never all of it)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


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
        hold = max((partial_suffix(buf, s) for s in self.stops), default=0)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
