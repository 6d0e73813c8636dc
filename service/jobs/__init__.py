"""The jobs room: the durable store behind OpenAI's Batch API — uploaded files, batches, and each
line's state with a lease (`store`: the contract, ids and line formats; `book`: its rules, written once
over each backend's primitives; `sqlite`: the embedded default under CACHE_DIR, shared by a machine's
instances; `redis`: one store for many machines), and `guard`: the store opened on first use and set
aside (503, a metric, one log line) while it cannot be used — `open_store` choosing one from
JOB_STORE_URL. What runs a line (the engine, at batch priority) lives in the HTTP layer
(service/api/batches/runner.py). May import the basic top-level modules only.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from .guard import GuardedStore
from .store import JobStore

__all__ = ["GuardedStore", "JobStore", "open_store"]


def open_store(url: str | None, cache_dir: Path, max_attempts: int) -> GuardedStore:
    """JOB_STORE_URL's store (the settings checked its form), opened when first used: `redis://…`
    (every machine's instances share it), else SQLite — the file a `sqlite:///path` URL names, by
    default CACHE_DIR/jobs.sqlite3."""
    if url and not url.startswith("sqlite:///"):
        from .redis import RedisStore

        where = f"redis {url.rpartition('@')[2]}"  # what follows a password, if the URL holds one
        opener = partial(RedisStore, url, max_attempts)
        return GuardedStore("Redis", where, opener, RedisStore.failures, RedisStore.explain)
    from .sqlite import SqliteStore

    path = Path(url.removeprefix("sqlite://")) if url else Path(cache_dir) / "jobs.sqlite3"
    opener = partial(SqliteStore, path, max_attempts)
    return GuardedStore(f"SQLite file {path.name}", str(path), opener, SqliteStore.failures, SqliteStore.explain)
