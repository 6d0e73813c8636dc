"""The job store in Redis (JOB_STORE_URL=redis://…), shared by every instance on every machine: the
rules are service/jobs/book.py's, each change made while holding one Redis lock (redis-py's `Lock`:
a token, a timeout of LOCK_SECONDS that its holder extends while it works, so a holder that dies —
or a Redis restarted under it — frees it within seconds) — a batch's work is a few changes per line, far
below what one lock serialises. With `appendonly yes` a restart of Redis loses no job and no result.

Keys under `qwen3vl:`: `batch:<id>` (the record, JSON, with its creation `order`), `lines:<id>` (index
→ line, JSON) while the batch holds them, `pending:<id>` and `leases:<id>` (sorted sets of line
indexes: by index; by lease end); the claim's sorted sets — `turns` (owners with pending lines, by
turn), `queue:<owner>` (an owner's pending lines, `<index>:<batch>` by batch order) and `leases`
(`<batch>:<index>` by lease end); `deadlines` (batches in progress by window end), `unfinished` (those
not finalized, by order), `purge` (ended batches by when they go), `expiry` (files by `expires_at`);
`batches:<owner>`, `files:<owner>`, `file:<id>` and `file:<id>:content`; `line-states` (counts by
state, for /metrics); `version` (the layout's).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import redis

from .book import Book, expired
from .store import ENDED, IN_PROGRESS, LEASED, PENDING, SKIPPED, StoredFile, page

PREFIX = "qwen3vl:"
LOCK_SECONDS = 5  # a holder that dies frees the lock this soon; a live one extends it while it works
WAIT_SECONDS = 60  # how long a change waits for the lock (behind another's long one: a batch of 50,000 lines)
CHUNK = 2**20  # a file's content is written and read this many bytes at a time
PIPELINED = 1000  # lines sent to Redis at once when a batch is made
LAYOUT = "2"  # 2: files expire, owners take turns (1, unmarked: before)


class RedisStore(Book):
    name = "redis"
    failures = (redis.RedisError, OSError)  # what an unreachable Redis raises (service/jobs/guard.py)

    def __init__(self, url: str, max_attempts: int = 3):
        super().__init__(self, max_attempts)
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self.client.ping()  # opened means reachable
        if self.client.get(PREFIX + "version") != LAYOUT.encode():
            with self.transaction() as tx:
                tx.upgrade()

    @staticmethod
    def explain(exc: BaseException) -> str:
        """A failure in words a client may read (no address)."""
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
            return "Redis is unreachable"
        return f"Redis answered {type(exc).__name__}: {exc}"

    def problem(self) -> str | None:
        return None  # a Redis that fails says so on the next call

    @contextmanager
    def transaction(self):
        lock = self.client.lock(
            PREFIX + "lock", timeout=LOCK_SECONDS, blocking_timeout=WAIT_SECONDS, thread_local=False
        )  # its token seen by the thread that extends it
        if not lock.acquire():
            raise TimeoutError(f"the job store's lock was held for more than {WAIT_SECONDS} s")
        done = threading.Event()

        def keep_holding():  # a machine killed mid-change stops this too: its lock ends LOCK_SECONDS later
            while not done.wait(LOCK_SECONDS / 3):
                try:
                    lock.extend(LOCK_SECONDS, replace_ttl=True)
                except redis.RedisError:
                    return

        keeper = threading.Thread(target=keep_holding, name="job-store-lock", daemon=True)
        keeper.start()
        try:
            yield _Tx(self.client)
        finally:
            done.set()
            keeper.join()
            lock.release()

    def close(self) -> None:
        self.client.close()

    # -- reads -----------------------------------------------------------------------------------

    def file(self, file_id: str, owner: str) -> StoredFile | None:
        found = _Tx(self.client).file(file_id)
        return found if found is not None and found.owner == owner and not expired(found, time.time()) else None

    def file_chunks(self, file_id: str, owner: str) -> Iterator[bytes] | None:
        found = self.file(file_id, owner)
        return None if found is None else self._read(f"{PREFIX}file:{file_id}:content", found.bytes)

    def _read(self, key: str, size: int) -> Iterator[bytes]:
        for start in range(0, size, CHUNK):
            yield self.client.getrange(key, start, start + CHUNK - 1)

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None) -> list[StoredFile]:
        ids = [i.decode() for i in self.client.zrevrange(f"{PREFIX}files:{owner}", 0, -1)]
        found = [f for f in (self.file(i, owner) for i in ids) if f is not None and purpose in (None, f.purpose)]
        return page(found, limit, after)

    def batch(self, batch_id: str, owner: str) -> dict | None:
        record = _Tx(self.client).batch(batch_id)
        return record if record is not None and record["owner"] == owner else None

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict]:
        ids = [i.decode() for i in self.client.zrevrange(f"{PREFIX}batches:{owner}", 0, -1)]
        return page([b for b in (self.batch(i, owner) for i in ids) if b is not None], limit, after)

    def active_batches(self, owner: str) -> int:
        return sum(1 for b in _Tx(self.client).unfinished(owner) if b["status"] not in ENDED)

    def line_counts(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.client.hgetall(PREFIX + "line-states").items()}


class _Tx:
    """service/jobs/book.Tx on Redis, while the store's lock is held (its reads serve the store's
    reads outside it too)."""

    def __init__(self, client):
        self.r = client

    # -- batches ---------------------------------------------------------------------------------

    def batch(self, batch_id: str) -> dict | None:
        raw = self.r.get(f"{PREFIX}batch:{batch_id}")
        return json.loads(raw) if raw else None

    def put_batch(self, record: dict) -> None:
        batch_id = record["id"]
        if "order" not in record:
            record["order"] = self.r.incr(PREFIX + "order")
            self.r.zadd(f"{PREFIX}batches:{record['owner']}", {batch_id: record["order"]})
            self.r.zadd(PREFIX + "unfinished", {batch_id: record["order"]})
        pipe = self.r.pipeline(transaction=False)
        pipe.set(f"{PREFIX}batch:{batch_id}", json.dumps(record))
        if record["status"] == IN_PROGRESS:
            pipe.zadd(PREFIX + "deadlines", {batch_id: record["expires_at"]})
        else:
            pipe.zrem(PREFIX + "deadlines", batch_id)
        if record.get("finalized"):
            pipe.zrem(PREFIX + "unfinished", batch_id)
        if record.get("purge_at") is not None:
            pipe.zadd(PREFIX + "purge", {batch_id: record["purge_at"]})
        pipe.execute()

    def drop_batch(self, record: dict) -> None:
        batch_id = record["id"]
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(f"{PREFIX}batch:{batch_id}")
        pipe.zrem(f"{PREFIX}batches:{record['owner']}", batch_id)
        for index in ("purge", "unfinished", "deadlines"):
            pipe.zrem(PREFIX + index, batch_id)
        pipe.execute()

    def unfinished(self, owner: str) -> list[dict]:
        records = (self.batch(raw.decode()) for raw in self.r.zrange(PREFIX + "unfinished", 0, -1))
        return [r for r in records if r is not None and r["owner"] == owner]

    def overdue(self, now: float) -> list[str]:
        return [raw.decode() for raw in self.r.zrangebyscore(PREFIX + "deadlines", "-inf", f"({now}")]

    def ended_before(self, now: float, limit: int) -> list[dict]:
        ids = self.r.zrangebyscore(PREFIX + "purge", "-inf", f"({now}", start=0, num=limit)
        return [r for r in (self.batch(raw.decode()) for raw in ids) if r is not None]

    # -- lines -----------------------------------------------------------------------------------

    def add_lines(self, record: dict, lines: Iterable[dict]) -> None:
        batch_id, queue = record["id"], f"{PREFIX}queue:{record['owner']}"
        pipe = self.r.pipeline(transaction=False)
        for index, line in enumerate(lines):
            pipe.hset(f"{PREFIX}lines:{batch_id}", index, json.dumps(line))
            if line["state"] == PENDING:
                pipe.zadd(f"{PREFIX}pending:{batch_id}", {index: index})
                pipe.zadd(queue, {_queued(batch_id, index): record["order"]})
            pipe.hincrby(PREFIX + "line-states", line["state"], 1)
            if index % PIPELINED == PIPELINED - 1:  # the pipeline holds its commands until it is sent
                pipe.execute()
        pipe.execute()

    def line(self, batch_id: str, index: int) -> dict | None:
        raw = self.r.hget(f"{PREFIX}lines:{batch_id}", index)
        return json.loads(raw) if raw else None

    def put_line(self, batch_id: str, index: int, line: dict) -> None:
        before, record = self.line(batch_id, index), self.batch(batch_id)
        queue, lease = f"{PREFIX}queue:{record['owner']}", f"{batch_id}:{index}"
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(f"{PREFIX}lines:{batch_id}", index, json.dumps(line))
        if line["state"] == PENDING:
            pipe.zadd(f"{PREFIX}pending:{batch_id}", {index: index})
            pipe.zadd(queue, {_queued(batch_id, index): record["order"]})
        else:
            pipe.zrem(f"{PREFIX}pending:{batch_id}", index)
            pipe.zrem(queue, _queued(batch_id, index))
        if line["state"] == LEASED:
            pipe.zadd(f"{PREFIX}leases:{batch_id}", {index: line["lease_until"]})
            pipe.zadd(PREFIX + "leases", {lease: line["lease_until"]})
        else:
            pipe.zrem(f"{PREFIX}leases:{batch_id}", index)
            pipe.zrem(PREFIX + "leases", lease)
        if before is not None and before["state"] != line["state"]:
            pipe.hincrby(PREFIX + "line-states", before["state"], -1)
            pipe.hincrby(PREFIX + "line-states", line["state"], 1)
        pipe.execute()

    def lines(self, batch_id: str) -> list[dict]:
        stored = self.r.hgetall(f"{PREFIX}lines:{batch_id}")
        return [json.loads(stored[k]) for k in sorted(stored, key=int)]

    def has_open_lines(self, batch_id: str) -> bool:
        return self.r.zcard(f"{PREFIX}pending:{batch_id}") + self.r.zcard(f"{PREFIX}leases:{batch_id}") > 0

    def skip_pending(self, batch_id: str) -> None:
        indexes = [int(raw) for raw in self.r.zrange(f"{PREFIX}pending:{batch_id}", 0, -1)]
        if not indexes:
            return
        queue = f"{PREFIX}queue:{self.batch(batch_id)['owner']}"
        pipe = self.r.pipeline(transaction=False)
        for index, raw in zip(indexes, self.r.hmget(f"{PREFIX}lines:{batch_id}", indexes)):
            line = {**json.loads(raw), "state": SKIPPED, "body": ""}
            pipe.hset(f"{PREFIX}lines:{batch_id}", index, json.dumps(line))
            pipe.zrem(queue, _queued(batch_id, index))
        pipe.delete(f"{PREFIX}pending:{batch_id}")
        pipe.hincrby(PREFIX + "line-states", PENDING, -len(indexes))
        pipe.hincrby(PREFIX + "line-states", SKIPPED, len(indexes))
        pipe.execute()

    def drop_lines(self, batch_id: str) -> None:
        states = Counter(json.loads(raw)["state"] for raw in self.r.hvals(f"{PREFIX}lines:{batch_id}"))
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(f"{PREFIX}lines:{batch_id}", f"{PREFIX}pending:{batch_id}", f"{PREFIX}leases:{batch_id}")
        for state, count in states.items():
            pipe.hincrby(PREFIX + "line-states", state, -count)
        pipe.execute()

    def _lapsed_leases(self, now: float) -> Iterator[tuple[str, int, dict]]:
        for raw in self.r.zrangebyscore(PREFIX + "leases", "-inf", f"({now}"):
            batch_id, _, index = raw.decode().rpartition(":")
            record = self.batch(batch_id)
            if record is not None:
                yield batch_id, int(index), record

    def stale(self, now: float) -> list[tuple[str, int]]:
        return [(b, i) for b, i, record in self._lapsed_leases(now) if record["status"] != IN_PROGRESS]

    def lapsed(self, now: float) -> tuple[str, int] | None:
        return next(((b, i) for b, i, record in self._lapsed_leases(now) if record["status"] == IN_PROGRESS), None)

    # -- the owners' turns -----------------------------------------------------------------------

    def next_owner(self) -> str | None:
        first = self.r.zrange(PREFIX + "turns", 0, 0)
        return first[0].decode() if first else None

    def first_pending(self, owner: str) -> tuple[str, int] | None:
        first = self.r.zrange(f"{PREFIX}queue:{owner}", 0, 0)
        if not first:
            return None
        index, _, batch_id = first[0].decode().partition(":")
        return batch_id, int(index)

    def served(self, owner: str) -> None:
        self.r.zadd(PREFIX + "turns", {owner: self.r.incr(PREFIX + "turn")})

    def join_turns(self, owner: str) -> None:
        first = self.r.zrange(PREFIX + "turns", 0, 0, withscores=True)
        self.r.zadd(PREFIX + "turns", {owner: (first[0][1] if first else 1) - 1}, nx=True)

    def leave_turns(self, owner: str) -> None:
        self.r.zrem(PREFIX + "turns", owner)

    # -- files -----------------------------------------------------------------------------------

    def file(self, file_id: str) -> StoredFile | None:
        fields = self.r.hgetall(f"{PREFIX}file:{file_id}")
        if not fields:
            return None
        meta = {k.decode(): v.decode() for k, v in fields.items()}
        until = meta.get("expires_at") or None  # "" or missing: kept until deleted
        return StoredFile(
            meta["id"],
            meta["filename"],
            meta["purpose"],
            int(meta["bytes"]),
            int(meta["created_at"]),
            meta["owner"],
            None if until is None else int(until),
        )

    def put_file(self, file: StoredFile, chunks: Iterable[bytes]) -> None:
        """The content appended chunk by chunk (never whole in memory), then the file's record."""
        key, written = f"{PREFIX}file:{file.id}:content", 0
        self.r.set(key, b"")
        for chunk in chunks:
            self.r.append(key, chunk)
            written += len(chunk)
        if written != file.bytes:
            self.r.delete(key)
            raise ValueError(f"file {file.id}: {written} bytes given for {file.bytes}")
        meta = {"id": file.id, "filename": file.filename, "purpose": file.purpose, "bytes": file.bytes}
        meta.update(created_at=file.created_at, owner=file.owner, expires_at=file.expires_at or "")
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(f"{PREFIX}file:{file.id}", mapping=meta)
        pipe.zadd(f"{PREFIX}files:{file.owner}", {file.id: self.r.incr(PREFIX + "order")})
        if file.expires_at is not None:
            pipe.zadd(PREFIX + "expiry", {file.id: file.expires_at})
        pipe.execute()

    def drop_file(self, file: StoredFile) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(f"{PREFIX}file:{file.id}", f"{PREFIX}file:{file.id}:content")
        pipe.zrem(f"{PREFIX}files:{file.owner}", file.id)
        pipe.zrem(PREFIX + "expiry", file.id)
        pipe.execute()

    def expired_files(self, now: float, limit: int) -> list[StoredFile]:
        ids = self.r.zrangebyscore(PREFIX + "expiry", "-inf", now, start=0, num=limit)
        return [f for f in (self.file(raw.decode()) for raw in ids) if f is not None]

    def stored_bytes(self, owner: str, now: float) -> int:
        pipe = self.r.pipeline(transaction=False)
        for raw in self.r.zrange(f"{PREFIX}files:{owner}", 0, -1):
            pipe.hmget(f"{PREFIX}file:{raw.decode()}", "bytes", "expires_at")
        live = [int(size) for size, until in pipe.execute() if size is not None and not (until and int(until) <= now)]
        return sum(live) + sum(record.get("bytes", 0) for record in self.unfinished(owner))

    # -- the layout of before ---------------------------------------------------------------------

    def upgrade(self) -> None:
        """A store of layout 1 in layout 2: the unfinished batches' lines queued by owner and their
        leases indexed, the in-progress ones' deadlines; the lines of ended batches (their results in
        their files) dropped. Once, under the lock."""
        if self.r.get(PREFIX + "version") == LAYOUT.encode():
            return  # another instance did it while this one waited for the lock
        for key in self.r.scan_iter(match=PREFIX + "batch:*"):
            record = json.loads(self.r.get(key))
            if record.get("finalized"):
                self.drop_lines(record["id"])
        self.r.delete(PREFIX + "active")
        for raw, order in self.r.zrange(PREFIX + "unfinished", 0, -1, withscores=True):
            record = self.batch(raw.decode())
            record["order"] = int(order)
            self.put_batch(record)
            batch_id = record["id"]
            pending = [int(i) for i in self.r.zrange(f"{PREFIX}pending:{batch_id}", 0, -1)]
            if pending:
                self.r.zadd(f"{PREFIX}queue:{record['owner']}", {_queued(batch_id, i): order for i in pending})
                self.join_turns(record["owner"])
            leases = self.r.zrange(f"{PREFIX}leases:{batch_id}", 0, -1, withscores=True)
            if leases:
                self.r.zadd(PREFIX + "leases", {f"{batch_id}:{int(i)}": until for i, until in leases})
        self.r.set(PREFIX + "version", LAYOUT)


def _queued(batch_id: str, index: int) -> str:
    """A pending line's member of its owner's queue: equal scores (one batch) sort by the padded index."""
    return f"{index:012d}:{batch_id}"
