"""The job store in Redis (JOB_STORE_URL=redis://…), shared by every instance on every machine: the
rules are service/jobs/book.py's, each change made while holding one Redis lock (redis-py's `Lock`:
a token, a timeout, so a holder that dies frees it) — a batch's work is a few changes per line, far
below what one lock serialises. With `appendonly yes` a restart of Redis loses no job and no result.

Keys under `qwen3vl:`: `batch:<id>` (the record, JSON), `lines:<id>` (index → line, JSON),
`pending:<id>` and `leases:<id>` (sorted sets of line indexes: by index; by lease end), `active` (the
batches in progress) and `unfinished` (those not finalized), by creation; `batches:<owner>`,
`files:<owner>`, `file:<id>` and `file:<id>:content`; `line-states` (counts by state, for /metrics).
"""

from __future__ import annotations

import json
from contextlib import contextmanager

from .book import Book
from .store import ENDED, IN_PROGRESS, LEASED, PENDING, SKIPPED, StoredFile, page

PREFIX = "qwen3vl:"
LOCK_SECONDS = 30  # a holder that dies (or stalls this long) frees the lock


class RedisStore(Book):
    name = "redis"

    def __init__(self, url: str, max_attempts: int = 3):
        import redis

        super().__init__(self, max_attempts)
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)

    @contextmanager
    def transaction(self):
        lock = self.client.lock(PREFIX + "lock", timeout=LOCK_SECONDS, blocking_timeout=LOCK_SECONDS)
        if not lock.acquire():
            raise TimeoutError(f"the job store's lock was held for more than {LOCK_SECONDS} s")
        try:
            yield _Tx(self.client)
        finally:
            lock.release()

    def close(self) -> None:
        self.client.close()

    # -- reads and files -------------------------------------------------------------------------

    def add_file(self, file: StoredFile, content: bytes) -> None:
        with self.transaction() as tx:
            tx.add_file(file, content)

    def file(self, file_id: str, owner: str) -> StoredFile | None:
        fields = self.client.hgetall(f"{PREFIX}file:{file_id}")
        if not fields:
            return None
        meta = {k.decode(): v.decode() for k, v in fields.items()}
        found = StoredFile(
            meta["id"], meta["filename"], meta["purpose"], int(meta["bytes"]), int(meta["created_at"]), meta["owner"]
        )
        return found if found.owner == owner else None

    def file_content(self, file_id: str, owner: str) -> bytes | None:
        return self.client.get(f"{PREFIX}file:{file_id}:content") if self.file(file_id, owner) else None

    def delete_file(self, file_id: str, owner: str) -> bool:
        with self.transaction():
            if self.file(file_id, owner) is None:
                return False
            self.client.delete(f"{PREFIX}file:{file_id}", f"{PREFIX}file:{file_id}:content")
            self.client.zrem(f"{PREFIX}files:{owner}", file_id)
            return True

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None) -> list[StoredFile]:
        ids = [i.decode() for i in self.client.zrevrange(f"{PREFIX}files:{owner}", 0, -1)]
        found = [f for f in (self.file(i, owner) for i in ids) if f is not None and purpose in (None, f.purpose)]
        return page(found, limit, after)

    def batch(self, batch_id: str, owner: str) -> dict | None:
        raw = self.client.get(f"{PREFIX}batch:{batch_id}")
        record = json.loads(raw) if raw else None
        return record if record is not None and record["owner"] == owner else None

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict]:
        ids = [i.decode() for i in self.client.zrevrange(f"{PREFIX}batches:{owner}", 0, -1)]
        return page([b for b in (self.batch(i, owner) for i in ids) if b is not None], limit, after)

    def active_batches(self, owner: str) -> int:
        return sum(1 for b in self.batches(owner, 10**9, None) if b["status"] not in ENDED)

    def line_counts(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.client.hgetall(PREFIX + "line-states").items()}


class _Tx:
    """service/jobs/book.Tx on Redis, while the store's lock is held."""

    def __init__(self, client):
        self.r = client

    def batch(self, batch_id: str) -> dict | None:
        raw = self.r.get(f"{PREFIX}batch:{batch_id}")
        return json.loads(raw) if raw else None

    def put_batch(self, record: dict) -> None:
        batch_id, new = record["id"], not self.r.exists(f"{PREFIX}batch:{record['id']}")
        self.r.set(f"{PREFIX}batch:{batch_id}", json.dumps(record))
        if new:
            order = self.r.incr(PREFIX + "order")
            self.r.zadd(f"{PREFIX}batches:{record['owner']}", {batch_id: order})
            self.r.zadd(PREFIX + "unfinished", {batch_id: order})
            self.r.zadd(PREFIX + "active", {batch_id: order})
        if record["status"] != IN_PROGRESS:
            self.r.zrem(PREFIX + "active", batch_id)
        if record.get("finalized"):
            self.r.zrem(PREFIX + "unfinished", batch_id)

    def add_lines(self, batch_id: str, created_at: int, lines: list[dict]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for index, line in enumerate(lines):
            pipe.hset(f"{PREFIX}lines:{batch_id}", index, json.dumps(line))
            if line["state"] == PENDING:
                pipe.zadd(f"{PREFIX}pending:{batch_id}", {index: index})
            pipe.hincrby(PREFIX + "line-states", line["state"], 1)
        pipe.execute()

    def line(self, batch_id: str, index: int) -> dict | None:
        raw = self.r.hget(f"{PREFIX}lines:{batch_id}", index)
        return json.loads(raw) if raw else None

    def put_line(self, batch_id: str, index: int, line: dict) -> None:
        before = self.line(batch_id, index)
        self.r.hset(f"{PREFIX}lines:{batch_id}", index, json.dumps(line))
        for state, key in ((PENDING, "pending"), (LEASED, "leases")):
            if line["state"] == state:
                score = index if state == PENDING else line["lease_until"]
                self.r.zadd(f"{PREFIX}{key}:{batch_id}", {index: score})
            else:
                self.r.zrem(f"{PREFIX}{key}:{batch_id}", index)
        if before is not None and before["state"] != line["state"]:
            self.r.hincrby(PREFIX + "line-states", before["state"], -1)
            self.r.hincrby(PREFIX + "line-states", line["state"], 1)

    def lines(self, batch_id: str) -> list[dict]:
        stored = self.r.hgetall(f"{PREFIX}lines:{batch_id}")
        return [json.loads(stored[k]) for k in sorted(stored, key=int)]

    def open_lines(self, batch_id: str) -> int:
        return self.r.zcard(f"{PREFIX}pending:{batch_id}") + self.r.zcard(f"{PREFIX}leases:{batch_id}")

    def skip_pending(self, batch_id: str) -> None:
        for raw in self.r.zrange(f"{PREFIX}pending:{batch_id}", 0, -1):
            index = int(raw)
            line = self.line(batch_id, index)
            line["state"] = SKIPPED
            self.put_line(batch_id, index, line)

    def claimable(self, now: float) -> tuple[str, int] | None:
        for raw in self.r.zrange(PREFIX + "active", 0, -1):
            batch_id = raw.decode()
            pending = self.r.zrange(f"{PREFIX}pending:{batch_id}", 0, 0)
            overdue = self.r.zrangebyscore(f"{PREFIX}leases:{batch_id}", "-inf", f"({now}")
            found = sorted(int(i) for i in [*pending, *overdue])
            if found:
                return batch_id, found[0]
        return None

    def overdue(self, now: float) -> list[str]:
        found = []
        for raw in self.r.zrange(PREFIX + "active", 0, -1):
            record = self.batch(raw.decode())
            if record is not None and record["expires_at"] < now:
                found.append(record["id"])
        return found

    def stale(self, now: float) -> list[tuple[str, int]]:
        found = []
        for raw in self.r.zrange(PREFIX + "unfinished", 0, -1):
            batch_id = raw.decode()
            record = self.batch(batch_id)
            if record is not None and record["status"] != IN_PROGRESS:
                overdue = self.r.zrangebyscore(f"{PREFIX}leases:{batch_id}", "-inf", f"({now}")
                found += [(batch_id, int(i)) for i in overdue]
        return found

    def add_file(self, file: StoredFile, content: bytes) -> None:
        meta = {"id": file.id, "filename": file.filename, "purpose": file.purpose, "bytes": file.bytes}
        meta.update(created_at=file.created_at, owner=file.owner)
        self.r.hset(f"{PREFIX}file:{file.id}", mapping=meta)
        self.r.set(f"{PREFIX}file:{file.id}:content", content)
        self.r.zadd(f"{PREFIX}files:{file.owner}", {file.id: self.r.incr(PREFIX + "order")})
