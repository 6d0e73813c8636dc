"""The jobs room: the durable store behind OpenAI's Batch API — uploaded files, batches, and each
line's state with a lease (`store`: the contract, ids and line formats; `book`: the store's rules,
written once over a backend's primitives; `sqlite`: the embedded default under CACHE_DIR, shared by
a machine's instances; `redis`: one store for many machines), `open_store` choosing one from
JOB_STORE_URL. What runs a line (the engine, at batch priority) lives
in the HTTP layer (service/api/batches/runner.py). May import the basic top-level modules only.
"""

from __future__ import annotations

from pathlib import Path

from .store import JobStore

__all__ = ["JobStore", "open_store"]


def open_store(url: str | None, cache_dir: Path, max_attempts: int) -> JobStore:
    """JOB_STORE_URL's store (the settings checked its form): `redis://…` (every machine's instances
    share it), else SQLite — the file a `sqlite:///path` URL names, by default CACHE_DIR/jobs.sqlite3."""
    if url and not url.startswith("sqlite:///"):
        from .redis import RedisStore

        return RedisStore(url, max_attempts)
    from .sqlite import SqliteStore

    return SqliteStore(Path(url.removeprefix("sqlite://")) if url else Path(cache_dir) / "jobs.sqlite3", max_attempts)
