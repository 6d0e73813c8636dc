"""The job store's rules (service/jobs/store.py's contract), written once over a backend's few
primitives: each public method runs in one of the backend's transactions (SQLite's IMMEDIATE
transaction; Redis's lock), which `Backend.transaction()` gives as a `Tx`."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Protocol

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


class Tx(Protocol):
    """What the rules need of a backend, inside one transaction. A line is a dict with custom_id,
    body, state, worker, lease_until, attempts, ok, result."""

    def batch(self, batch_id: str) -> dict | None: ...

    def put_batch(self, record: dict) -> None: ...

    def add_lines(self, batch_id: str, created_at: int, lines: list[dict]) -> None: ...

    def line(self, batch_id: str, index: int) -> dict | None: ...

    def put_line(self, batch_id: str, index: int, line: dict) -> None: ...

    def lines(self, batch_id: str) -> list[dict]: ...  # in input order

    def open_lines(self, batch_id: str) -> int: ...  # pending or leased

    def skip_pending(self, batch_id: str) -> None: ...

    def claimable(self, now: float) -> tuple[str, int] | None: ...  # in-progress batches, oldest first

    def overdue(self, now: float) -> list[str]: ...  # in-progress batches past their window

    def stale(self, now: float) -> list[tuple[str, int]]: ...  # leased past their lease, batch not in progress

    def add_file(self, file: StoredFile, content: bytes) -> None: ...


class Backend(Protocol):
    def transaction(self) -> AbstractContextManager[Tx]: ...


class Book:
    """Batches and their lines, by the contract's rules, on `backend`."""

    def __init__(self, backend: Backend, max_attempts: int):
        self.backend, self.max_attempts = backend, max_attempts

    def create_batch(self, batch: NewBatch) -> dict:
        now = int(time.time())
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
            "total": len(batch.lines),
            "completed": 0,
            "failed": sum(1 for line in batch.lines if line.failed is not None),
        }
        lines = [
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
        ]
        with self.backend.transaction() as tx:
            tx.put_batch(record)
            tx.add_lines(batch.id, batch.created_at, lines)
            return self._settle(tx, record)  # every line failed already: it ends at once

    def cancel(self, batch_id: str, owner: str) -> dict | None:
        with self.backend.transaction() as tx:
            record = tx.batch(batch_id)
            if record is None or record["owner"] != owner:
                return None
            if record["status"] not in (IN_PROGRESS, FINALIZING):
                return record
            record["status"], record["cancelling_at"] = CANCELLING, int(time.time())
            tx.skip_pending(batch_id)
            return self._settle(tx, record)

    def claim(self, worker: str, lease: float) -> Claim | None:
        now = time.time()
        with self.backend.transaction() as tx:
            self._sweep(tx, now)
            while (found := tx.claimable(now)) is not None:
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
            self._settle(tx, record)

    def finish(self, claim: Claim, ok: bool, result: str) -> bool:
        """Write the line's result if this worker still holds it: whether it was written."""
        with self.backend.transaction() as tx:
            line = self._held(tx, claim)
            if line is None:
                return False
            self._done(tx, claim.batch_id, claim.index, line, ok, result)
            return True

    # -- inside a transaction --------------------------------------------------------------------

    @staticmethod
    def _held(tx: Tx, claim: Claim) -> dict | None:
        line = tx.line(claim.batch_id, claim.index)
        return line if line is not None and line["state"] == LEASED and line["worker"] == claim.worker else None

    def _done(self, tx: Tx, batch_id: str, index: int, line: dict, ok: bool, result: str) -> None:
        line.update(state=DONE, ok=ok, result=result, lease_until=None)
        tx.put_line(batch_id, index, line)
        record = tx.batch(batch_id)
        record["completed" if ok else "failed"] += 1
        self._settle(tx, record)

    def _sweep(self, tx: Tx, now: float) -> None:
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
        """Once no line is pending or leased: the output and error files written, the batch ended
        (completed; cancelled after a cancel; expired stays expired). Done once."""
        if record.get("finalized") or tx.open_lines(record["id"]):
            tx.put_batch(record)
            return record
        now = int(time.time())
        record["finalizing_at"] = record.get("finalizing_at") or now
        lines = tx.lines(record["id"])
        outputs = [r["result"] for r in lines if r["state"] == DONE and r["ok"]]
        errors = [r["result"] for r in lines if r["state"] == DONE and not r["ok"]]
        if record["status"] == EXPIRED:
            expired = [r for r in lines if r["state"] == SKIPPED]
            record["failed"] += len(expired)
            errors += [
                failed_line(r["custom_id"], "batch_expired", "the completion window ended first") for r in expired
            ]
        for key, kind, found in (("output_file_id", "output", outputs), ("error_file_id", "error", errors)):
            record[key] = None
            if found:
                content = ("\n".join(found) + "\n").encode()
                made = StoredFile(
                    new_id("file-"), f"{record['id']}_{kind}.jsonl", "batch_output", len(content), now, record["owner"]
                )
                tx.add_file(made, content)
                record[key] = made.id
        if record["status"] == CANCELLING:
            record["status"], record["cancelled_at"] = CANCELLED, now
        elif record["status"] not in ENDED:
            record["status"], record["completed_at"] = COMPLETED, now
        record["finalized"] = True
        tx.put_batch(record)
        return record
