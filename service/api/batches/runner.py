"""Batch lines run on this instance's engine when its batch has room: a thread that claims lines from
the job store (service/jobs/: a lease, renewed while a line runs) and runs each as the Chat
Completions endpoint would, at BATCH_PRIORITY — so interactive requests go first and take a running
line's place when the batch is full (service/engine/admission.py): the line resumes later with the
same answer (`/v1/embeddings` lines run as the embeddings endpoint runs them). A line runs as its
batch's tenant, in a request context of its own (service/api/context.py:
its tenant's caches; ordered by priority alone, outside the fair share of interactive requests). Every
instance on every machine sharing the store does the same (the store hands lines to the tenants in
turn); a line whose instance dies runs again elsewhere once its lease ends, and its result is written
once. The runner also sweeps the store (expired batches, files and ended batches past their time)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time

from pydantic import ValidationError

from ... import metrics
from ...errors import InternalError, QueueFull, ServiceError, StoreUnavailable, Unavailable
from ...generation import Completion
from ...jobs.store import Claim, JobStore, new_id, result_line
from ...settings import Settings
from ..access.tenants import Tenants
from ..chat.protocol import ChatCompletionRequest
from ..chat.serving import chat_request, completion_body
from ..context import RequestContext, context_for
from ..error_shapes import validation_error
from ..search.protocol import EmbeddingsRequest
from ..search.serving import embedding_list, embeddings_request

log = logging.getLogger("service.batches")

POLL_SECONDS = 0.5  # how often an idle runner looks for lines (a batch made here wakes it at once)
RENEW_SECONDS = 1.0  # how often a running line renews its lease and sees a cancel
SWEEP_SECONDS = 5.0  # how often the runner expires what is due in the store (service/jobs/book.Book.sweep)


class BatchRunner:
    """Claims and runs batch lines while the engine has a free place in its batch."""

    def __init__(self, engine, store: JobStore, settings: Settings, tenants: Tenants):
        self.engine, self.store, self.settings, self.tenants = engine, store, settings, tenants
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{new_id('')[:8]}"
        self.capacity = settings.batch_concurrency or settings.max_batch_size
        self._running = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        for result in ("ok", "failed", "duplicate"):  # at zero from the start, for dashboards and alerts
            metrics.BATCH_LINES_RUN.labels(result)
        self._thread = threading.Thread(target=self._loop, name="batch-runner", daemon=True)
        self._thread.start()
        log.info(
            "batch runner %s: up to %d lines at priority %d", self.worker, self.capacity, self.settings.batch_priority
        )

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _loop(self) -> None:
        swept = -SWEEP_SECONDS
        while not self._stop.is_set():
            started = False
            try:
                if time.monotonic() - swept >= SWEEP_SECONDS:
                    swept = time.monotonic()
                    self.store.sweep()
                if self._has_room():
                    claim = self.store.claim(self.worker, self.settings.batch_lease_seconds)
                    if claim is not None:
                        with self._lock:
                            self._running += 1
                        metrics.BATCH_LINES_RUNNING.inc()
                        threading.Thread(target=self._run, args=(claim,), name="batch-line", daemon=True).start()
                        started = True
                metrics.record_batch_lines(self.store.line_counts())
            except StoreUnavailable:  # its guard logged why: it is opened again at a later poll
                pass
            except Exception:
                log.exception("batch runner: the job store failed")
            if not started:
                self._wake.wait(POLL_SECONDS)
                self._wake.clear()

    def _has_room(self) -> bool:
        with self._lock:
            mine = self._running
        return mine < self.capacity and self.engine.admission.has_room()

    def _run(self, claim: Claim) -> None:
        try:
            ok, line = self._answer(claim)
            if line is None:
                return  # given back: no result to write
            if self.store.finish(claim, ok, line):
                metrics.BATCH_LINES_RUN.labels("ok" if ok else "failed").inc()
            else:  # another instance finished it after this one's lease ran out: its result stands
                metrics.BATCH_LINES_RUN.labels("duplicate").inc()
        except Exception:
            log.exception("batch line %s/%s: writing its result failed", claim.batch_id, claim.custom_id)
        finally:
            with self._lock:
                self._running -= 1
            metrics.BATCH_LINES_RUNNING.dec()
            self._wake.set()

    def _renewed(self, claim: Claim) -> bool:
        """Whether the line is still this instance's. A store out of reach for now changes nothing: the
        answer is written if the lease still holds once it is back (else the line runs again)."""
        try:
            return self.store.renew(claim, self.settings.batch_lease_seconds)
        except StoreUnavailable:
            return True

    def _answer(self, claim: Claim) -> tuple[bool, str | None]:
        """(ok, the line for the output or error file), or (False, None) when the line was given back
        (the engine too busy, its batch cancelled, the instance stopping)."""
        request_id = new_id("batch_req_")
        context = context_for(
            self.tenants, self.tenants.by_owner(claim.owner), request_id, time.perf_counter(), fair_share=False
        )
        if claim.endpoint == "/v1/embeddings":
            return self._embed(claim, request_id, context)
        return self._chat(claim, request_id, context)

    def _not_run(self, claim: Claim, exc: Exception, request_id: str) -> tuple[bool, str | None]:
        """A line its endpoint refused: given back when an interactive burst took the room first (later),
        else (False, its error line)."""
        if isinstance(exc, (QueueFull, Unavailable)):
            self.store.release(claim)
            return False, None
        if isinstance(exc, ValidationError):
            error = validation_error(exc)
        elif isinstance(exc, ServiceError):
            error = exc
        else:
            log.error("batch line %s/%s failed", claim.batch_id, claim.custom_id, exc_info=exc)
            error = InternalError(request_id)
        return False, result_line(claim.custom_id, error.status, error.to_dict())

    def _embed(self, claim: Claim, request_id: str, context: RequestContext) -> tuple[bool, str | None]:
        """An embeddings line: run as the endpoint runs it, its lease renewed meanwhile (a line of many
        inputs may take longer than a lease); cancelled at the next forward once it is no longer ours."""
        cancelled, finished = threading.Event(), threading.Event()

        def renew():
            while not finished.wait(RENEW_SECONDS):
                if not self._renewed(claim):
                    cancelled.set()
                    return

        renewer = threading.Thread(target=renew, name="batch-line-lease", daemon=True)
        try:
            body = EmbeddingsRequest.model_validate(json.loads(claim.body))
            line = body.model_copy(update={"priority": self.settings.batch_priority})
            search = embeddings_request(line, self.engine.limits, context)
            renewer.start()
            result = self.engine.run_search(dataclasses.replace(search, cancelled=cancelled))
        except Exception as exc:
            if cancelled.is_set() and isinstance(exc, ServiceError):  # its batch cancelled, or its lease lost
                self.store.release(claim)
                return False, None
            return self._not_run(claim, exc, request_id)
        finally:
            finished.set()
        return True, result_line(claim.custom_id, 200, embedding_list(line, self.engine.info.name, result))

    def _chat(self, claim: Claim, request_id: str, context: RequestContext) -> tuple[bool, str | None]:
        try:
            body = ChatCompletionRequest.model_validate(json.loads(claim.body))
            line = body.model_copy(update={"priority": self.settings.batch_priority})  # whatever the body asks
            gen_request, shape = chat_request(line, self.engine.limits, context, body.user)
            generation = self.engine.submit(gen_request)
        except Exception as exc:
            return self._not_run(claim, exc, request_id)
        done, renewed = None, time.monotonic()
        try:
            for event in generation:
                if isinstance(event, Completion):
                    done = event
                elif time.monotonic() - renewed > RENEW_SECONDS:
                    renewed = time.monotonic()
                    if not self._renewed(claim):
                        generation.cancel()  # cancelled, expired, or no longer ours: stop at the next token
        except ServiceError as exc:
            return False, result_line(claim.custom_id, exc.status, exc.to_dict())
        finally:
            generation.close()
        if done is None or done.finish_reason == "cancelled":  # its batch cancelled, or the instance stopping
            self.store.release(claim)
            return False, None
        return True, result_line(claim.custom_id, 200, completion_body(request_id, self.engine.info, done, shape))
