"""The one HTTP client of the benchmarks: a request to the native `/v1/chat` (JSON lines) or the
OpenAI endpoint (server-sent events, or one JSON answer), with the client's own timings."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import requests

from bench.core.inputs import encoded_photo


@dataclass
class Reply:
    status: int
    done: dict  # the native done line, the OpenAI stream's last chunk, or the whole JSON answer ({}: none came)
    first_text: float | None  # seconds from sending to the first event with text (None: none came)
    total: float  # seconds from sending to the end of the answer
    text_events: int  # events that carried text: a random model's tokens often decode to none

    @property
    def ok(self) -> bool:
        return self.status == 200 and bool(self.done) and "error" not in self.done

    @property
    def tokens(self) -> int:
        return self.done["usage"]["completion_tokens"]

    @property
    def ttft(self) -> float:
        """The server's time to first token (native endpoint)."""
        return self.done["timings"]["time_to_first_token"]


def _events(response: requests.Response):
    kind = response.headers.get("content-type", "")
    if kind.startswith("application/x-ndjson"):
        yield from (json.loads(line) for line in response.iter_lines() if line)
    elif kind.startswith("text/event-stream"):
        for line in response.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[len(b"data: ") :])
    elif response.content:
        yield response.json()


def _has_text(event: dict) -> bool:
    if "delta" in event:  # native
        return True
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def post(base: str, path: str, body=None, *, form=None, files=None, timeout: float = 900, check: bool = True) -> Reply:
    """POST `body` (JSON) or `form` and `files` (multipart) to base + path, reading the answer as it
    streams. With `check`, anything but a complete 200 answer raises."""
    t0 = time.perf_counter()
    first, done, texts = None, {}, 0
    with requests.post(base + path, json=body, data=form, files=files, stream=True, timeout=timeout) as r:
        for event in _events(r):
            if _has_text(event):
                texts += 1
                first = first if first is not None else time.perf_counter() - t0
            if event.get("done") or "error" in event or not path.endswith("/v1/chat"):
                done = event
        reply = Reply(r.status_code, done, first, time.perf_counter() - t0, texts)
    if check and not reply.ok:
        raise RuntimeError(f"{path} answered {reply.status}: {str(done)[:500]}")
    return reply


def chat(base: str, body=None, **kwargs) -> Reply:
    """One native `/v1/chat` request (streamed unless the body says `"stream": false`)."""
    return post(base, "/v1/chat", body, **kwargs)


def openai_chat(base: str, body: dict, **kwargs) -> Reply:
    """One `/v1/chat/completions` request; `done` the answer (or the stream's last chunk)."""
    return post(base, "/v1/chat/completions", {"model": "qwen3-vl", **body}, **kwargs)


def picture_conversations(base: str, count: int = 10, turns: int = 3, max_tokens: int = 16) -> list[int]:
    """`count` conversations of `turns` native form requests, each opening with a ~448×448 JPEG (three
    widths in turn): what a small server's memory meets. The statuses."""
    statuses = []
    for i in range(count):
        for turn in range(turns):
            form = {
                "prompt": f"Turn {turn + 1}: describe it further.",
                "conversation_id": f"bench-{i}",
                "max_tokens": str(max_tokens),
                "stream": "false",
                "temperature": "0",
            }
            files = None
            if turn == 0:
                files = {"image": (f"p{i}.jpg", encoded_photo(".jpg", 448 + 32 * (i % 3), 448, seed=i), "image/jpeg")}
            statuses.append(chat(base, form=form, files=files, check=False).status)
    return statuses
