"""The job store in one SQLite file (the default: CACHE_DIR/jobs.sqlite3), shared by the instances of
one machine: WAL mode, one connection per thread, every change in an IMMEDIATE transaction (so two
instances claiming at once take different lines). The rules are service/jobs/book.py's.

The file holds every tenant's requests: it is made (and kept) readable by this user alone (0600, as
its -wal and -shm files, which SQLite makes like it), and what is deleted is overwritten with zeros
(`secure_delete`; the write-ahead log keeps it until a checkpoint overwrites it). A claim is index
seeks only: the owners' turns by turn, an owner's pending lines by (batch, index) in a partial
index, leases by their end. The file is the store only while it is the one opened: `problem()`
notices it replaced or removed."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .book import Book
from .store import ENDED, IN_PROGRESS, LEASED, PENDING, SKIPPED, StoredFile, page

CHUNK = 2**20  # a file's content is written and read this many bytes at a time
# A file's metadata apart from its content: a row read for its expiry never walks a blob's pages, and
# a zeroblob last in its row is reserved without being made in memory.
FILES = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER
)"""
TABLES = f"""
{FILES};
CREATE TABLE IF NOT EXISTS contents (id TEXT PRIMARY KEY, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, record TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, finalized INTEGER NOT NULL DEFAULT 0,
    purge_at INTEGER
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL, worker TEXT, lease_until REAL, attempts INTEGER NOT NULL DEFAULT 0,
    ok INTEGER, result TEXT, owner TEXT NOT NULL DEFAULT '', seq INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
);
CREATE TABLE IF NOT EXISTS turns (owner TEXT PRIMARY KEY, turn INTEGER NOT NULL);
"""
# A store made before files expired and owners took turns (its files held their content): the
# contents moved to their table, the columns the rest needs filled in (the lines of ended batches,
# whose results are in their files, go).
UPGRADE = f"""
INSERT INTO contents (id, content) SELECT id, content FROM files;
ALTER TABLE files RENAME TO files_before;
{FILES};
INSERT INTO files (id, owner, filename, purpose, bytes, created_at)
    SELECT id, owner, filename, purpose, bytes, created_at FROM files_before;
DROP TABLE files_before;
ALTER TABLE batches ADD COLUMN finalized INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN purge_at INTEGER;
ALTER TABLE lines ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE lines ADD COLUMN seq INTEGER NOT NULL DEFAULT 0;
UPDATE batches SET finalized = coalesce(json_extract(record, '$.finalized'), 0);
DELETE FROM lines WHERE batch_id IN (SELECT id FROM batches WHERE finalized);
UPDATE lines SET owner = (SELECT owner FROM batches WHERE id = batch_id),
    seq = (SELECT rowid FROM batches WHERE id = batch_id);
INSERT OR IGNORE INTO turns SELECT DISTINCT owner, 0 FROM lines WHERE state = '{PENDING}';
"""
INDEXES = f"""
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (state, lease_until);
CREATE INDEX IF NOT EXISTS lines_open ON lines (batch_id, state);
CREATE INDEX IF NOT EXISTS lines_pending ON lines (owner, seq, idx) WHERE state = '{PENDING}';
CREATE INDEX IF NOT EXISTS turns_in_order ON turns (turn);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, created_at);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, expires_at);
CREATE INDEX IF NOT EXISTS batches_to_purge ON batches (purge_at) WHERE purge_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS batches_unfinished ON batches (owner) WHERE NOT finalized;
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at);
CREATE INDEX IF NOT EXISTS files_to_expire ON files (expires_at) WHERE expires_at IS NOT NULL;
"""
LINE_FIELDS = ("custom_id", "body", "state", "worker", "lease_until", "attempts", "ok", "result")
FILE_FIELDS = "id, filename, purpose, bytes, created_at, owner, expires_at"
LIVE = "(expires_at IS NULL OR expires_at > ?)"  # a file not yet expired


class SqliteStore(Book):
    name = "sqlite"
    failures = (sqlite3.Error, OSError)  # what a broken file or folder raises (service/jobs/guard.py)

    def __init__(self, path: Path, max_attempts: int = 3):
        super().__init__(self, max_attempts)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _make_private(self.path)
        self._local = threading.local()
        with self.transaction() as tx:  # every instance may run it: one at a time, each sees the last's
            _set_up(tx.db)
        self._identity = _identity(os.stat(self.path))

    @staticmethod
    def explain(exc: BaseException) -> str:
        """A failure in words a client may read (no path)."""
        return exc.strerror.lower() if isinstance(exc, OSError) and exc.strerror else str(exc)

    def problem(self) -> str | None:
        try:
            now = _identity(os.stat(self.path))
        except FileNotFoundError:
            return "its file was removed while serving"
        except OSError as exc:
            return f"its file cannot be read ({self.explain(exc)})"
        return None if now == self._identity else "its file was replaced while serving"

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA secure_delete=ON")  # what is deleted (a tenant's requests) is overwritten, not left
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

    # -- reads -----------------------------------------------------------------------------------

    def file(self, file_id: str, owner: str) -> StoredFile | None:
        row = (
            self._db()
            .execute(
                f"SELECT {FILE_FIELDS} FROM files WHERE id = ? AND owner = ? AND {LIVE}",
                (file_id, owner, time.time()),
            )
            .fetchone()
        )
        return StoredFile(**dict(row)) if row else None

    def file_chunks(self, file_id: str, owner: str) -> Iterator[bytes] | None:
        """The content's chunks, read from a blob opened now: a file deleted meanwhile is still read
        whole (the blob reads the snapshot it was opened in)."""
        row = (
            self._db()
            .execute(
                f"SELECT c.rowid, f.bytes FROM files f JOIN contents c ON c.id = f.id "
                f"WHERE f.id = ? AND f.owner = ? AND {LIVE}",
                (file_id, owner, time.time()),
            )
            .fetchone()
        )
        if row is None or row["bytes"] == 0:
            return None if row is None else iter(())
        try:
            blob = self._db().blobopen("contents", "content", row["rowid"], readonly=True)
        except sqlite3.OperationalError:
            if self.file(file_id, owner) is None:  # deleted since the row was read
                return None
            raise
        return _read(blob)

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None) -> list[StoredFile]:
        rows = (
            self._db()
            .execute(
                f"SELECT {FILE_FIELDS} FROM files WHERE owner = ? AND (? IS NULL OR purpose = ?) AND {LIVE} "
                "ORDER BY created_at DESC, rowid DESC",
                (owner, purpose, purpose, time.time()),
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

    # -- batches ---------------------------------------------------------------------------------

    def batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT record FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return json.loads(row["record"]) if row else None

    def put_batch(self, record: dict) -> None:
        self.db.execute(
            "INSERT INTO batches (id, owner, record, status, created_at, expires_at, finalized, purge_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET record = excluded.record, "
            "status = excluded.status, finalized = excluded.finalized, purge_at = excluded.purge_at",
            (
                record["id"],
                record["owner"],
                json.dumps(record),
                record["status"],
                record["created_at"],
                record["expires_at"],
                int(bool(record.get("finalized"))),
                record.get("purge_at"),
            ),
        )

    def drop_batch(self, record: dict) -> None:
        self.db.execute("DELETE FROM batches WHERE id = ?", (record["id"],))

    def unfinished(self, owner: str) -> list[dict]:
        rows = self.db.execute("SELECT record FROM batches WHERE owner = ? AND NOT finalized", (owner,))
        return [json.loads(r["record"]) for r in rows.fetchall()]

    def overdue(self, now: float) -> list[str]:
        rows = self.db.execute("SELECT id FROM batches WHERE status = ? AND expires_at < ?", (IN_PROGRESS, now))
        return [r["id"] for r in rows.fetchall()]

    def ended_before(self, now: float, limit: int) -> list[dict]:
        rows = self.db.execute("SELECT record FROM batches WHERE purge_at < ? LIMIT ?", (now, limit))
        return [json.loads(r["record"]) for r in rows.fetchall()]

    # -- lines -----------------------------------------------------------------------------------

    def add_lines(self, record: dict, lines: Iterable[dict]) -> None:
        [seq] = self.db.execute("SELECT rowid FROM batches WHERE id = ?", (record["id"],)).fetchone()
        self.db.executemany(
            f"INSERT INTO lines (batch_id, idx, owner, seq, {', '.join(LINE_FIELDS)}) "
            f"VALUES (?, ?, ?, ?{', ?' * len(LINE_FIELDS)})",
            ((record["id"], i, record["owner"], seq, *(line[k] for k in LINE_FIELDS)) for i, line in enumerate(lines)),
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

    def has_open_lines(self, batch_id: str) -> bool:
        return self.db.execute(
            "SELECT EXISTS (SELECT 1 FROM lines WHERE batch_id = ? AND state IN (?, ?))", (batch_id, PENDING, LEASED)
        ).fetchone()[0]

    def skip_pending(self, batch_id: str) -> None:
        self.db.execute(
            "UPDATE lines SET state = ?, body = '' WHERE batch_id = ? AND state = ?", (SKIPPED, batch_id, PENDING)
        )

    def drop_lines(self, batch_id: str) -> None:
        self.db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))

    def stale(self, now: float) -> list[tuple[str, int]]:
        rows = self.db.execute(
            "SELECT l.batch_id, l.idx FROM lines l JOIN batches b ON b.id = l.batch_id "
            "WHERE l.state = ? AND l.lease_until < ? AND b.status != ?",
            (LEASED, now, IN_PROGRESS),
        )
        return [(r["batch_id"], r["idx"]) for r in rows.fetchall()]

    def lapsed(self, now: float) -> tuple[str, int] | None:
        row = self.db.execute(
            "SELECT l.batch_id, l.idx FROM lines l JOIN batches b ON b.id = l.batch_id "
            "WHERE l.state = ? AND l.lease_until < ? AND b.status = ? ORDER BY l.lease_until LIMIT 1",
            (LEASED, now, IN_PROGRESS),
        ).fetchone()
        return (row["batch_id"], row["idx"]) if row else None

    # -- the owners' turns -----------------------------------------------------------------------

    def next_owner(self) -> str | None:
        row = self.db.execute("SELECT owner FROM turns ORDER BY turn LIMIT 1").fetchone()
        return row["owner"] if row else None

    def first_pending(self, owner: str) -> tuple[str, int] | None:
        row = self.db.execute(  # the partial index lines_pending: its WHERE written as the index's
            f"SELECT batch_id, idx FROM lines WHERE owner = ? AND state = '{PENDING}' ORDER BY seq, idx LIMIT 1",
            (owner,),
        ).fetchone()
        return (row["batch_id"], row["idx"]) if row else None

    def served(self, owner: str) -> None:
        self.db.execute("UPDATE turns SET turn = (SELECT MAX(turn) FROM turns) + 1 WHERE owner = ?", (owner,))

    def join_turns(self, owner: str) -> None:
        self.db.execute(
            "INSERT OR IGNORE INTO turns VALUES (?, coalesce((SELECT MIN(turn) FROM turns), 1) - 1)", (owner,)
        )

    def leave_turns(self, owner: str) -> None:
        self.db.execute("DELETE FROM turns WHERE owner = ?", (owner,))

    # -- files -----------------------------------------------------------------------------------

    def file(self, file_id: str) -> StoredFile | None:
        row = self.db.execute(f"SELECT {FILE_FIELDS} FROM files WHERE id = ?", (file_id,)).fetchone()
        return StoredFile(**dict(row)) if row else None

    def put_file(self, file: StoredFile, chunks: Iterable[bytes]) -> None:
        """The metadata, a content row with room for the bytes, then the bytes written into it chunk by
        chunk."""
        self.db.execute(
            f"INSERT INTO files ({FILE_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (file.id, file.filename, file.purpose, file.bytes, file.created_at, file.owner, file.expires_at),
        )
        made = self.db.execute("INSERT INTO contents (id, content) VALUES (?, zeroblob(?))", (file.id, file.bytes))
        written = 0
        if file.bytes:
            with self.db.blobopen("contents", "content", made.lastrowid) as blob:
                for chunk in chunks:
                    blob.write(chunk)
                    written += len(chunk)
        if written != file.bytes:
            raise ValueError(f"file {file.id}: {written} bytes given for {file.bytes}")

    def drop_file(self, file: StoredFile) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file.id,))
        self.db.execute("DELETE FROM contents WHERE id = ?", (file.id,))

    def expired_files(self, now: float, limit: int) -> list[StoredFile]:
        rows = self.db.execute(f"SELECT {FILE_FIELDS} FROM files WHERE expires_at <= ? LIMIT ?", (now, limit))
        return [StoredFile(**dict(r)) for r in rows.fetchall()]

    def stored_bytes(self, owner: str, now: float) -> int:
        [files] = self.db.execute(
            f"SELECT coalesce(SUM(bytes), 0) FROM files WHERE owner = ? AND {LIVE}", (owner, now)
        ).fetchone()
        return files + sum(record.get("bytes", 0) for record in self.unfinished(owner))


def _line(row) -> dict:
    line = dict(row)
    line["ok"] = None if line["ok"] is None else bool(line["ok"])
    return line


def _read(blob) -> Iterator[bytes]:
    with blob:
        while chunk := blob.read(CHUNK):
            yield chunk


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


def _make_private(path: Path) -> None:
    """The file (made if missing) and its -wal and -shm readable and writable by this user alone; a
    folder in its place raises IsADirectoryError."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for each in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError, PermissionError):  # another user's file: theirs to set
            os.chmod(each, 0o600)


def _set_up(db: sqlite3.Connection) -> None:
    """The tables (upgraded from an older store's) and their indexes, inside the caller's transaction."""
    for statement in _statements(TABLES):
        db.execute(statement)
    columns = {row["name"] for row in db.execute("PRAGMA table_info(files)")}
    if "content" in columns:
        for statement in _statements(UPGRADE):
            db.execute(statement)
    for statement in _statements(INDEXES):
        db.execute(statement)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
