"""The job store's rules (service/jobs/store.py's contract), written once over a backend's few
primitives: each public method runs in one of the backend's transactions (SQLite's IMMEDIATE
transaction; Redis's lock), which `Backend.transaction()` gives as a `Tx`."""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

from ..errors import StorageFull, TooLarge
from .store import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    DONE,
    ENDED,
    EXPIRED,
    FINALIZING,
    IN_PROGRESS,
    LEASED,
    PENDING,
    SKIPPED,
    Claim,
    NewBatch,
    StoredFile,
    failed_line,
    new_id,
)

SWEPT_AT_ONCE = 64  # expired files and ended batches removed by one sweep (its transaction stays short)


class Tx(Protocol):
    """What the rules need of a backend, inside one transaction. A line is a dict with custom_id,
    body, state, worker, lease_until, attempts, ok, result. Every method is a few index seeks, but
    for those that read or change a whole batch (`add_lines`, `lines`, `skip_pending`, `drop_lines`)."""

    def batch(self, batch_id: str) -> dict | None: ...

    def put_batch(self, record: dict) -> None: ...

    def drop_batch(self, record: dict) -> None: ...  # an ended batch, its lines already dropped

    def unfinished(self, owner: str) -> list[dict]: ...  # the owner's batches whose lines are held

    def overdue(self, now: float) -> list[str]: ...  # in-progress batches past their window

    def ended_before(self, now: float, limit: int) -> list[dict]: ...  # ended batches past their `purge_at`

    def add_lines(self, record: dict, lines: Iterable[dict]) -> None: ...

    def line(self, batch_id: str, index: int) -> dict | None: ...

    def put_line(self, batch_id: str, index: int, line: dict) -> None: ...

    def lines(self, batch_id: str) -> list[dict]: ...  # in input order

    def has_open_lines(self, batch_id: str) -> bool: ...  # pending or leased

    def skip_pending(self, batch_id: str) -> None: ...  # their request bodies dropped

    def drop_lines(self, batch_id: str) -> None: ...

    def stale(self, now: float) -> list[tuple[str, int]]: ...  # leased past their lease, batch not in progress

    def lapsed(self, now: float) -> tuple[str, int] | None: ...  # leased past its lease, batch in progress

    def next_owner(self) -> str | None: ...  # whose turn it is: the owner served least recently

    def first_pending(self, owner: str) -> tuple[str, int] | None: ...  # its oldest batch's first pending line

    def served(self, owner: str) -> None: ...  # to the back of the turns

    def join_turns(self, owner: str) -> None: ...  # an owner with pending lines; a newcomer goes first

    def leave_turns(self, owner: str) -> None: ...

    def file(self, file_id: str) -> StoredFile | None: ...  # whoever owns it, expired or not

    def put_file(self, file: StoredFile, chunks: Iterable[bytes]) -> None: ...

    def drop_file(self, file: StoredFile) -> None: ...

    def expired_files(self, now: float, limit: int) -> list[StoredFile]: ...

    def stored_bytes(self, owner: str, now: float) -> int: ...  # its unexpired files and held request bodies


class Backend(Protocol):
    def transaction(self) -> AbstractContextManager[Tx]: ...


def expired(file: StoredFile, now: float) -> bool:
    """Whether `file` is past its `expires_at` (gone for its owner, whether swept yet or not)."""
    return file.expires_at is not None and file.expires_at <= now


class Book:
    """Batches and their lines, by the contract's rules, on `backend`."""

    def __init__(self, backend: Backend, max_attempts: int):
        self.backend, self.max_attempts = backend, max_attempts

    def add_file(self, file: StoredFile, chunks: Iterable[bytes], quota: int) -> None:
        with self.backend.transaction() as tx:
            _within_quota(tx, file.owner, file.bytes, quota, time.time())
            tx.put_file(file, chunks)

    def delete_file(self, file_id: str, owner: str) -> bool:
        """Delete an owner's file: a batch still running from it is cancelled, its request bodies dropped."""
        now = time.time()
        with self.backend.transaction() as tx:
            found = tx.file(file_id)
            if found is None or found.owner != owner or expired(found, now):
                return False
            self._drop_file(tx, found, int(now))
            return True

    def create_batch(self, batch: NewBatch, quota: int) -> dict | None:
        """The batch, in progress (or ended at once if no line can run); None if its input file was
        deleted meanwhile. Its request bodies count in its owner's quota while it holds them."""
        now = int(time.time())
        total = failed = held = 0
        for line in batch.lines:  # a first pass: the counts (the lines are written in a second)
            total, failed, held = total + 1, failed + (line.failed is not None), held + len(line.body.encode())
        record = {
            "id": batch.id,
            "owner": batch.owner,
            "endpoint": batch.endpoint,
            "input_file_id": batch.input_file_id,
            "completion_window": batch.completion_window,
            "status": IN_PROGRESS,
            "created_at": batch.created_at,
            "in_progress_at": now,
            "expires_at": batch.created_at + batch.window_seconds,
            "metadata": batch.metadata,
            "total": total,
            "completed": 0,
            "failed": failed,
            "bytes": held,
            "output_ttl": batch.output_ttl,
        }
        lines = (  # made as they are written: the bodies are not held twice
            {
                "custom_id": line.custom_id,
                "body": line.body,
                "state": DONE if line.failed else PENDING,
                "worker": None,
                "lease_until": None,
                "attempts": 0,
                "ok": False if line.failed else None,
                "result": line.failed,
            }
            for line in batch.lines
        )
        with self.backend.transaction() as tx:
            source = tx.file(batch.input_file_id)
            if source is None or source.owner != batch.owner or expired(source, now):
                return None
            _within_quota(tx, batch.owner, held, quota, now)
            tx.put_batch(record)
            tx.add_lines(record, lines)
            if record["failed"] < record["total"]:
                tx.join_turns(batch.owner)
            return self._settle(tx, record)  # every line failed already: it ends at once

    def cancel(self, batch_id: str, owner: str) -> dict | None:
        with self.backend.transaction() as tx:
            record = tx.batch(batch_id)
            if record is None or record["owner"] != owner:
                return None
            return self._cancel(tx, record, int(time.time()))

    def claim(self, worker: str, lease: float) -> Claim | None:
        """The next line to run: one whose lease ran out first, else the next owner's in turn."""
        now = time.time()
        with self.backend.transaction() as tx:
            self._expire(tx, now)
            while (found := tx.lapsed(now) or self._next_in_turn(tx)) is not None:
                batch_id, index = found
                line = tx.line(batch_id, index)
                if line["attempts"] >= self.max_attempts:  # its instances died under it each time
                    message = f"the line was started {line['attempts']} times and never finished"
                    self._done(
                        tx, batch_id, index, line, False, failed_line(line["custom_id"], "attempts_exhausted", message)
                    )
                    continue
                line.update(state=LEASED, worker=worker, lease_until=now + lease, attempts=line["attempts"] + 1)
                tx.put_line(batch_id, index, line)
                batch = tx.batch(batch_id)
                custom_id, body, attempt = line["custom_id"], line["body"], line["attempts"]
                return Claim(batch_id, index, custom_id, body, worker, attempt, batch["endpoint"], batch["owner"])
        return None

    def renew(self, claim: Claim, lease: float) -> bool:
        """Extend the lease; False if the line is no longer this worker's to finish (its batch
        cancelled or expired, or the line taken by another instance after the lease ran out)."""
        with self.backend.transaction() as tx:
            line = self._held(tx, claim)
            if line is None or tx.batch(claim.batch_id)["status"] != IN_PROGRESS:
                return False
            line["lease_until"] = time.time() + lease
            tx.put_line(claim.batch_id, claim.index, line)
            return True

    def release(self, claim: Claim) -> None:
        """Give a line up without a result (the engine too busy, the instance stopping, its batch
        cancelled): pending again, the attempt not counted, while its batch is in progress; else
        skipped. Nothing if another instance holds it now."""
        with self.backend.transaction() as tx:
            line = self._held(tx, claim)
            if line is None:
                return
            record = tx.batch(claim.batch_id)
            again = record["status"] == IN_PROGRESS
            line.update(state=PENDING if again else SKIPPED, worker=None, lease_until=None)
            line["attempts"] -= int(again)
            tx.put_line(claim.batch_id, claim.index, line)
            if again:
                tx.join_turns(record["owner"])
            self._settle(tx, record)

    def finish(self, claim: Claim, ok: bool, result: str) -> bool:
        """Write the line's result if this worker still holds it: whether it was written."""
        with self.backend.transaction() as tx:
            line = self._held(tx, claim)
            if line is None:
                return False
            self._done(tx, claim.batch_id, claim.index, line, ok, result)
            return True

    def sweep(self) -> None:
        now = time.time()
        with self.backend.transaction() as tx:
            self._expire(tx, now)
            for file in tx.expired_files(now, SWEPT_AT_ONCE):
                self._drop_file(tx, file, int(now))
            for record in tx.ended_before(now, SWEPT_AT_ONCE):
                tx.drop_batch(record)

    # -- inside a transaction --------------------------------------------------------------------

    @staticmethod
    def _held(tx: Tx, claim: Claim) -> dict | None:
        line = tx.line(claim.batch_id, claim.index)
        return line if line is not None and line["state"] == LEASED and line["worker"] == claim.worker else None

    @staticmethod
    def _next_in_turn(tx: Tx) -> tuple[str, int] | None:
        """The first pending line of the owner whose turn it is, who then goes to the back; an owner
        found with none leaves the turns (and comes back first when it has some again)."""
        while (owner := tx.next_owner()) is not None:
            found = tx.first_pending(owner)
            if found is not None:
                tx.served(owner)
                return found
            tx.leave_turns(owner)
        return None

    def _cancel(self, tx: Tx, record: dict, now: int) -> dict:
        if record["status"] not in (IN_PROGRESS, FINALIZING):
            return record
        record["status"], record["cancelling_at"] = CANCELLING, now
        tx.skip_pending(record["id"])
        return self._settle(tx, record)

    def _drop_file(self, tx: Tx, file: StoredFile, now: int) -> None:
        tx.drop_file(file)
        for record in tx.unfinished(file.owner):
            if record["input_file_id"] == file.id:
                self._cancel(tx, record, now)

    def _done(self, tx: Tx, batch_id: str, index: int, line: dict, ok: bool, result: str) -> None:
        line.update(state=DONE, ok=ok, result=result, lease_until=None)
        tx.put_line(batch_id, index, line)
        record = tx.batch(batch_id)
        record["completed" if ok else "failed"] += 1
        self._settle(tx, record)

    def _expire(self, tx: Tx, now: float) -> None:
        """Batches past their completion window expire (what had not run fails as expired); lines of
        ended batches whose instance died under them are given up."""
        for batch_id in tx.overdue(now):
            record = tx.batch(batch_id)
            record["status"], record["expired_at"] = EXPIRED, int(now)
            tx.skip_pending(batch_id)
            self._settle(tx, record)
        for batch_id, index in tx.stale(now):
            line = tx.line(batch_id, index)
            line.update(state=SKIPPED, lease_until=None)
            tx.put_line(batch_id, index, line)
            self._settle(tx, tx.batch(batch_id))

    def _settle(self, tx: Tx, record: dict) -> dict:
        """Once no line is pending or leased: the output and error files written (kept `output_ttl`
        seconds, and the batch as long), the lines dropped, the batch ended (completed; cancelled
        after a cancel; expired stays expired). Done once."""
        if record.get("finalized") or tx.has_open_lines(record["id"]):
            tx.put_batch(record)
            return record
        now = int(time.time())
        ttl = record.get("output_ttl")  # None: a batch made before outputs expired, kept as it was
        record["finalizing_at"] = record.get("finalizing_at") or now
        lines = tx.lines(record["id"])
        outputs = [r["result"] for r in lines if r["state"] == DONE and r["ok"]]
        errors = [r["result"] for r in lines if r["state"] == DONE and not r["ok"]]
        if record["status"] == EXPIRED:
            expired_lines = [r for r in lines if r["state"] == SKIPPED]
            record["failed"] += len(expired_lines)
            errors += [
                failed_line(r["custom_id"], "batch_expired", "the completion window ended first") for r in expired_lines
            ]
        for key, kind, found in (("output_file_id", "output", outputs), ("error_file_id", "error", errors)):
            record[key] = None
            if found:
                content = ("\n".join(found) + "\n").encode()
                made = StoredFile(
                    new_id("file-"),
                    f"{record['id']}_{kind}.jsonl",
                    "batch_output",
                    len(content),
                    now,
                    record["owner"],
                    None if ttl is None else now + ttl,
                )
                tx.put_file(made, [content])
                record[key] = made.id
        if record["status"] == CANCELLING:
            record["status"], record["cancelled_at"] = CANCELLED, now
        elif record["status"] not in ENDED:
            record["status"], record["completed_at"] = COMPLETED, now
        record["purge_at"] = None if ttl is None else now + ttl
        record["finalized"] = True
        tx.drop_lines(record["id"])
        tx.put_batch(record)
        return record


def _within_quota(tx: Tx, owner: str, adding: int, quota: int, now: float) -> None:
    """Raise unless `adding` bytes more keep `owner` within `quota` (413 if they never could)."""
    used = tx.stored_bytes(owner, now)
    if used + adding <= quota:
        return
    if adding > quota:
        raise TooLarge(
            f"storing this takes {adding} bytes; BATCH_MAX_STORED_BYTES, each tenant's storage, is {quota}",
            code="storage_quota_exceeded",
        )
    raise StorageFull(
        f"your files and running batches hold {used} bytes; {adding} more would pass BATCH_MAX_STORED_BYTES "
        f"({quota}): delete files (or let them expire), or wait for a batch to end",
        headers={"Retry-After": "60"},
    )
