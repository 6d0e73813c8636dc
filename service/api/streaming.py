"""What every API's serving shares: stream a generation's events while the client is still there
(each API's StreamEncoder writes them, in SSE events or JSON lines framed here), or collect them, and
record metrics and one log line when it ends."""

from __future__ import annotations

import json
import logging
import select
import socket
from collections.abc import Callable, Iterator
from typing import Protocol

from .. import metrics
from ..errors import InternalError, ServiceError
from ..generation import Completion, Generation, GenerationRequest, TextDelta, priority_class

log = logging.getLogger("service.requests")


def sse(data: str, event: str | None = None) -> bytes:
    """One server-sent event: its `event:` line when it is named, its `data:` line, a blank line."""
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {data}\n\n".encode()


def json_line(obj: dict) -> bytes:
    """One line of a JSON-lines stream."""
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def client_gone(environ) -> bool:
    """True once the client closed its connection (EOF is readable on the socket Gunicorn gives us)."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def record(
    request: GenerationRequest,
    generation: Generation,
    done: Completion | None,
    endpoint: str,
    error_code: str | None = None,
) -> None:
    """Metrics and the request's log line; `done` is None when the client left mid-stream or the
    generation ended in an error (`error_code`)."""
    tenant = metrics.tenant_label(request.tenant.name)
    if done is None:
        made = generation.generated_tokens
        metrics.FINISHED.labels("error" if error_code else "cancelled").inc()
        metrics.GENERATED_TOKENS.inc(made)
        metrics.TENANT_TOKENS.labels(tenant, "completion").inc(made)
        if error_code:
            log.warning("%s %s ended by an error (%s) after %d tokens", request.request_id, endpoint, error_code, made)
        else:
            log.info("%s %s client gone after %d tokens", request.request_id, endpoint, made)
        return
    t, label = done.timings, priority_class(request.priority)
    metrics.FINISHED.labels(done.finish_reason).inc()
    metrics.GENERATED_TOKENS.inc(done.completion_tokens)
    metrics.PROMPT_TOKENS.inc(done.prompt_tokens)
    for kind, tokens in (("prompt", done.prompt_tokens), ("cached", done.cached_tokens)):
        metrics.TENANT_TOKENS.labels(tenant, kind).inc(tokens)
    metrics.TENANT_TOKENS.labels(tenant, "completion").inc(done.completion_tokens)
    metrics.QUEUE_WAIT.labels(label).observe(t.queue_wait)
    metrics.IMAGE_DECODE.observe(t.image_decode)
    metrics.VISION_ENCODE.observe(t.vision_encode)
    if done.completion_tokens:
        metrics.TTFT.labels(label).observe(t.time_to_first_token)
    if done.completion_tokens > 1:
        metrics.INTER_TOKEN.observe(t.decode / (done.completion_tokens - 1))
    log.info(
        "%s %s %s prompt=%d cached=%d completion=%d queue=%.3fs decode_img=%.3fs vision=%.3fs "
        "prefill=%.3fs ttft=%.3fs tok/s=%.1f total=%.3fs",
        request.request_id,
        endpoint,
        done.finish_reason,
        done.prompt_tokens,
        done.cached_tokens,
        done.completion_tokens,
        t.queue_wait,
        t.image_decode,
        t.vision_encode,
        t.prefill,
        t.time_to_first_token,
        t.decode_tokens_per_s,
        t.total,
    )


def tokens_used(generation: Generation, done: Completion | None) -> int:
    """What a request counts against its tenant's tokens a minute: prompt and answer (what it made, if cut)."""
    return done.prompt_tokens + done.completion_tokens if done is not None else generation.generated_tokens


def collect(
    generation: Generation, request: GenerationRequest, endpoint: str, spend: Callable[[int], None] | None = None
) -> Completion:
    """Run a non-streaming request to its end (an error propagates to the app's handler: its status);
    `spend` gets its tokens (access/rates.TenantRates.admit)."""
    done, error_code = None, None
    try:
        metrics.GENERATING.inc()
        for event in generation:
            if isinstance(event, Completion):
                done = event
    except Exception as exc:
        error_code = error_code_of(exc)
        raise
    finally:
        metrics.GENERATING.dec()
        generation.close()
        record(request, generation, done, endpoint, error_code)
        if spend is not None:
            spend(tokens_used(generation, done))
    return done


def error_code_of(exc: Exception) -> str:
    return (exc.code or "error") if isinstance(exc, ServiceError) else InternalError.code


class StreamEncoder(Protocol):
    """One API's wire format for a stream: what goes out first, for each text delta, for the
    finished answer, and for an error that ends the stream (each zero or more chunks of bytes)."""

    def head(self) -> Iterator[bytes]: ...

    def delta(self, event: TextDelta) -> Iterator[bytes]: ...

    def done(self, event: Completion) -> Iterator[bytes]: ...

    def error(self, exc: ServiceError) -> Iterator[bytes]: ...


class EventStream:
    """A WSGI response body: engine events encoded by `encoder`, generating stopped as soon as the
    client is gone, and the model freed on close() even if never iterated; `spend` gets its tokens."""

    def __init__(
        self,
        generation: Generation,
        request: GenerationRequest,
        environ,
        endpoint: str,
        encoder: StreamEncoder,
        spend: Callable[[int], None] | None = None,
    ):
        self.generation = generation
        self.request = request
        self.environ = environ
        self.endpoint = endpoint
        self.encoder = encoder
        self.spend = spend
        self.done: Completion | None = None
        self.error_code: str | None = None  # of the error event that ended the stream
        self._body = self._chunks()
        self._closed = False
        metrics.GENERATING.inc()  # admitted: it holds the model until close()

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        return next(self._body)

    def _chunks(self) -> Iterator[bytes]:
        try:
            yield from self.encoder.head()
            for event in self.generation:
                if client_gone(self.environ):
                    return
                if isinstance(event, Completion):
                    self.done = event
                    yield from self.encoder.done(event)
                else:
                    yield from self.encoder.delta(event)
        except Exception as exc:
            if not isinstance(exc, ServiceError):
                log.exception("%s %s failed mid-stream", self.request.request_id, self.endpoint)
                exc = InternalError(self.request.request_id)
            self.error_code = error_code_of(exc)
            metrics.STREAM_ERRORS.labels(self.error_code).inc()  # its 200 went out before: count it here
            yield from self.encoder.error(exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._body.close()
        self.generation.close()
        metrics.GENERATING.dec()
        record(self.request, self.generation, self.done, self.endpoint, self.error_code)
        if self.spend is not None:
            self.spend(tokens_used(self.generation, self.done))
