"""The job store in one SQLite file (the default: CACHE_DIR/jobs.sqlite3), shared by the instances of
one machine: WAL mode, one connection per thread, every change in an IMMEDIATE transaction (so two
instances claiming at once take different lines). The rules are service/jobs/book.py's."""

from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

from .book import Book
from .store import ENDED, IN_PROGRESS, LEASED, PENDING, SKIPPED, StoredFile, page

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, record TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL, worker TEXT, lease_until REAL, attempts INTEGER NOT NULL DEFAULT 0,
    ok INTEGER, result TEXT, PRIMARY KEY (batch_id, idx)
);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (state, lease_until);
"""
LINE_FIELDS = ("custom_id", "body", "state", "worker", "lease_until", "attempts", "ok", "result")
FILE_FIELDS = "id, filename, purpose, bytes, created_at, owner"


class SqliteStore(Book):
    name = "sqlite"

    def __init__(self, path: Path, max_attempts: int = 3):
        super().__init__(self, max_attempts)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._db().executescript(SCHEMA)  # IF NOT EXISTS: every instance may run it (it commits itself)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    @contextmanager
    def transaction(self):
        """An IMMEDIATE transaction: the write lock taken at the start, so one that reads then writes
        cannot lose a race to another instance's."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield _Tx(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # -- reads and files -------------------------------------------------------------------------

    def add_file(self, file: StoredFile, content: bytes) -> None:
        with self.transaction() as tx:
            tx.add_file(file, content)

    def file(self, file_id: str, owner: str) -> StoredFile | None:
        row = (
            self._db()
            .execute(f"SELECT {FILE_FIELDS} FROM files WHERE id = ? AND owner = ?", (file_id, owner))
            .fetchone()
        )
        return StoredFile(**dict(row)) if row else None

    def file_content(self, file_id: str, owner: str) -> bytes | None:
        row = self._db().execute("SELECT content FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return bytes(row["content"]) if row else None

    def delete_file(self, file_id: str, owner: str) -> bool:
        with self.transaction() as tx:
            return tx.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None) -> list[StoredFile]:
        rows = (
            self._db()
            .execute(
                f"SELECT {FILE_FIELDS} FROM files WHERE owner = ? AND (? IS NULL OR purpose = ?) "
                "ORDER BY created_at DESC, rowid DESC",
                (owner, purpose, purpose),
            )
            .fetchall()
        )
        return page([StoredFile(**dict(r)) for r in rows], limit, after)

    def batch(self, batch_id: str, owner: str) -> dict | None:
        row = self._db().execute("SELECT record FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)).fetchone()
        return json.loads(row["record"]) if row else None

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict]:
        rows = (
            self._db()
            .execute("SELECT record FROM batches WHERE owner = ? ORDER BY created_at DESC, rowid DESC", (owner,))
            .fetchall()
        )
        return page([json.loads(r["record"]) for r in rows], limit, after)

    def active_batches(self, owner: str) -> int:
        marks = ",".join("?" * len(ENDED))
        return (
            self._db()
            .execute(f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status NOT IN ({marks})", (owner, *ENDED))
            .fetchone()[0]
        )

    def line_counts(self) -> dict[str, int]:
        rows = self._db().execute("SELECT state, COUNT(*) AS n FROM lines GROUP BY state").fetchall()
        return {r["state"]: r["n"] for r in rows}


class _Tx:
    """service/jobs/book.Tx on one connection inside a transaction."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT record FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return json.loads(row["record"]) if row else None

    def put_batch(self, record: dict) -> None:
        self.db.execute(
            "INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET record = excluded.record, "
            "status = excluded.status",
            (
                record["id"],
                record["owner"],
                json.dumps(record),
                record["status"],
                record["created_at"],
                record["expires_at"],
            ),
        )

    def add_lines(self, batch_id: str, created_at: int, lines: list[dict]) -> None:
        self.db.executemany(
            f"INSERT INTO lines (batch_id, idx, {', '.join(LINE_FIELDS)}) VALUES (?, ?{', ?' * len(LINE_FIELDS)})",
            [(batch_id, i, *(line[k] for k in LINE_FIELDS)) for i, line in enumerate(lines)],
        )

    def line(self, batch_id: str, index: int) -> dict | None:
        row = self.db.execute(
            f"SELECT {', '.join(LINE_FIELDS)} FROM lines WHERE batch_id = ? AND idx = ?", (batch_id, index)
        ).fetchone()
        return _line(row) if row else None

    def put_line(self, batch_id: str, index: int, line: dict) -> None:
        self.db.execute(
            f"UPDATE lines SET {', '.join(f'{k} = ?' for k in LINE_FIELDS)} WHERE batch_id = ? AND idx = ?",
            (*(line[k] for k in LINE_FIELDS), batch_id, index),
        )

    def lines(self, batch_id: str) -> list[dict]:
        rows = self.db.execute(
            f"SELECT {', '.join(LINE_FIELDS)} FROM lines WHERE batch_id = ? ORDER BY idx", (batch_id,)
        ).fetchall()
        return [_line(r) for r in rows]

    def open_lines(self, batch_id: str) -> int:
        return self.db.execute(
            "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND state IN (?, ?)", (batch_id, PENDING, LEASED)
        ).fetchone()[0]

    def skip_pending(self, batch_id: str) -> None:
        self.db.execute("UPDATE lines SET state = ? WHERE batch_id = ? AND state = ?", (SKIPPED, batch_id, PENDING))

    def claimable(self, now: float) -> tuple[str, int] | None:
        row = self.db.execute(
            "SELECT l.batch_id, l.idx FROM lines l JOIN batches b ON b.id = l.batch_id WHERE b.status = ? AND "
            "(l.state = ? OR (l.state = ? AND l.lease_until < ?)) ORDER BY b.created_at, b.rowid, l.idx LIMIT 1",
            (IN_PROGRESS, PENDING, LEASED, now),
        ).fetchone()
        return (row["batch_id"], row["idx"]) if row else None

    def overdue(self, now: float) -> list[str]:
        rows = self.db.execute("SELECT id FROM batches WHERE status = ? AND expires_at < ?", (IN_PROGRESS, now))
        return [r["id"] for r in rows.fetchall()]

    def stale(self, now: float) -> list[tuple[str, int]]:
        rows = self.db.execute(
            "SELECT l.batch_id, l.idx FROM lines l JOIN batches b ON b.id = l.batch_id "
            "WHERE l.state = ? AND l.lease_until < ? AND b.status != ?",
            (LEASED, now, IN_PROGRESS),
        )
        return [(r["batch_id"], r["idx"]) for r in rows.fetchall()]

    def add_file(self, file: StoredFile, content: bytes) -> None:
        self.db.execute(
            "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
            (file.id, file.owner, file.filename, file.purpose, file.bytes, file.created_at, content),
        )


def _line(row) -> dict:
    line = dict(row)
    line["ok"] = None if line["ok"] is None else bool(line["ok"])
    return line
