"""Stop strings: cutting a streamed answer at the first one, holding back what may begin one."""

from __future__ import annotations


def partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters are the beginning of `tag` (0: none, never all of it)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back any tail that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets `stopped` when a stop string appears."""
        if not self.stops:
            return text
        buf = self._held + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self.stopped, self._held = True, ""
            return buf[:cut]
        hold = max((partial_suffix(buf, s) for s in self.stops), default=0)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
