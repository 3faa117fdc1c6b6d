"""The dispatcher's durable store of offline batches: one SQLite file (`dispatcher.batch_db`, WAL) holding the
uploaded files, the batches and every request of every batch with its result.

Why SQLite and these transactions: a dispatcher can be SIGKILLed at any instant, and a restart must lose no
accepted request and duplicate no result.

* A submit stores the input file, the batch and all its requests in one transaction: a batch exists whole or
  not at all (a store that cannot be written refuses it with StoreUnavailable, nothing half-accepted).
* A request's result is written in the same transaction that marks it done, and only while it is pending:
  a request that ran twice (it was running when the process died, and ran again after the restart) keeps
  the first result recorded; the second is dropped.
* "Running" is never stored: after a restart every request without a result is pending and runs again.
  Greedy and seeded requests give the same answer the second time, so a re-run is invisible.

The file is created on the first submit, not at start-up: a dispatcher that never runs a batch leaves no file
behind. While it is open, an advisory lock (`<db>-lock`) keeps a second dispatcher off the same file; the
kernel drops it with the process, so a SIGKILL leaves nothing stale. Methods are synchronous and thread-safe;
the dispatcher calls them through asyncio.to_thread, so fsyncs never stall its event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from kunserve.services.dispatcher.batch_format import CANCELLED, EXPIRED, BatchRequest, never_ran_line

SCHEMA_VERSION = 1
ACTIVE = ("in_progress", "cancelling")  # statuses the runner works on
TERMINAL = ("completed", "expired", "cancelled", "failed")
_ENDED_AT = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
_NEVER_RAN_CODE = {"expired": EXPIRED, "cancelled": CANCELLED}
BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE files (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE batches (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, status TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, expires_at INTEGER NOT NULL, input_file_id TEXT NOT NULL REFERENCES files(id),
    output_file_id TEXT, error_file_id TEXT, total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, metadata TEXT NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
CREATE TABLE items (
    batch_id TEXT NOT NULL REFERENCES batches(id), idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
    body TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'pending', result TEXT, attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx));
CREATE INDEX items_pending ON items (batch_id, state, idx);
"""


class StoreError(Exception):
    """Base of the store's errors; the message is what the client is told."""


class StoreUnavailable(StoreError):
    """The store cannot be opened or written (a path that cannot be created, a full disk, a read-only file,
    another dispatcher holding it). Whatever was being written was rolled back."""


class NotFound(StoreError):
    pass


class Conflict(StoreError):
    """The batch is not in a state that allows this (cancel a completed batch)."""


@dataclass(frozen=True)
class FileInfo:
    id: str
    created_at: int
    filename: str
    purpose: str
    bytes: int


@dataclass(frozen=True)
class BatchInfo:
    id: str
    created_at: int
    status: str
    endpoint: str
    completion_window: str
    expires_at: int
    input_file_id: str
    output_file_id: str | None
    error_file_id: str | None
    total: int
    completed: int
    failed: int
    metadata: dict[str, str]
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None


@dataclass(frozen=True)
class Item:
    """A request of a batch that has no result yet."""

    batch_id: str
    index: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class ItemResult:
    """A request's recorded result: `line` is its result line (OpenAI's output format); `ok` is False for an
    error line (the request failed, or never ran)."""

    index: int
    custom_id: str
    ok: bool
    line: str
    attempts: int


_BATCH_COLUMNS = ("id, created_at, status, endpoint, completion_window, expires_at, input_file_id, output_file_id, "
                  "error_file_id, total, completed, failed, metadata, in_progress_at, finalizing_at, completed_at, "
                  "failed_at, expired_at, cancelling_at, cancelled_at")


def _batch(row: Sequence[Any]) -> BatchInfo:
    values = list(row)
    values[12] = json.loads(values[12])
    return BatchInfo(*values)


def line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


class BatchStore:
    """The store at `path` (created on the first write). `clock` gives Unix seconds (tests move it)."""

    def __init__(self, path: str | os.PathLike[str], clock: Callable[[], float] = time.time) -> None:
        self.path = os.fspath(path)
        self.clock = clock
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._lockfile: IO[str] | None = None

    # -- opening ----------------------------------------------------------------------------------------
    def _now(self) -> int:
        return int(self.clock())

    def _unavailable(self, what: str, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(f"the batch store (dispatcher.batch_db = {self.path}) {what}: {exc}")

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        """The open connection; opens (and with `create`, creates) the file first. None: no file yet and not
        `create` (a read of a store nothing was ever written to). Called with the lock held."""
        if self._db is not None:
            return self._db
        if not create and not os.path.exists(self.path):
            return None
        lockfile = None
        try:
            lockfile = open(self.path + "-lock", "a")  # held open (and locked) for as long as the store is
            fcntl.flock(lockfile.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            try:
                self._prepare(db)
            except BaseException:
                db.close()
                raise
        except BlockingIOError:
            if lockfile is not None:
                lockfile.close()
            raise StoreUnavailable(f"the batch store (dispatcher.batch_db = {self.path}) is in use by another "
                                   f"dispatcher (it holds {self.path}-lock)") from None
        except (OSError, sqlite3.Error) as exc:
            if lockfile is not None:
                lockfile.close()
            raise self._unavailable("cannot be opened", exc) from None
        self._db, self._lockfile = db, lockfile
        return db

    def _prepare(self, db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a result once recorded survives a power loss too
        db.execute("PRAGMA foreign_keys=ON")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:  # a new file: the schema and its version in one transaction
            db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        elif version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version}, this dispatcher reads version {SCHEMA_VERSION}")

    def exists(self) -> bool:
        return self._db is not None or os.path.exists(self.path)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._lockfile is not None:
                self._lockfile.close()  # releases the advisory lock
                self._lockfile = None

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it or (on any error, StoreUnavailable for the store's own) none."""
        with self._lock:
            db = self._connect(create=True)
            assert db is not None
            try:
                db.execute("BEGIN IMMEDIATE")
                yield db
                db.execute("COMMIT")
            except BaseException as exc:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise self._unavailable("cannot be written", exc) from None
                raise

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection | None]:
        with self._lock:
            try:
                yield self._connect(create=False)
            except sqlite3.Error as exc:
                raise self._unavailable("cannot be read", exc) from None

    # -- files --------------------------------------------------------------------------------------------
    @staticmethod
    def _insert_file(db: sqlite3.Connection, content: bytes, filename: str, purpose: str, now: int) -> FileInfo:
        info = FileInfo(f"file-{uuid.uuid4().hex}", now, filename, purpose, len(content))
        db.execute("INSERT INTO files (id, created_at, filename, purpose, bytes, content) VALUES (?, ?, ?, ?, ?, ?)",
                   (info.id, info.created_at, info.filename, info.purpose, info.bytes, content))
        return info

    def add_file(self, content: bytes, filename: str, purpose: str) -> FileInfo:
        with self._write() as db:
            return self._insert_file(db, content, filename, purpose, self._now())

    def file(self, file_id: str) -> FileInfo:
        with self._read() as db:
            row = db.execute("SELECT id, created_at, filename, purpose, bytes FROM files WHERE id = ?",
                             (file_id,)).fetchone() if db is not None else None
        if row is None:
            raise NotFound(f"no file {file_id!r}")
        return FileInfo(*row)

    def file_content(self, file_id: str) -> bytes:
        with self._read() as db:
            row = db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone() if db is not None else None
        if row is None:
            raise NotFound(f"no file {file_id!r}")
        return bytes(row[0])

    def list_files(self, limit: int, after: str = "", purpose: str = "") -> tuple[list[FileInfo], bool]:
        """Newest first, up to `limit`, after the file `after` (OpenAI's cursor), only `purpose` when given; and
        whether more follow."""
        with self._read() as db:
            if db is None:
                if after:
                    raise NotFound(f"no file {after!r}")
                return [], False
            where: list[str] = []
            args: list[Any] = []
            if after:
                row = db.execute("SELECT rowid FROM files WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise NotFound(f"no file {after!r}")
                where.append("rowid < ?")
                args.append(row[0])
            if purpose:
                where.append("purpose = ?")
                args.append(purpose)
            clause = f"WHERE {' AND '.join(where)}" if where else ""
            rows = db.execute(f"SELECT id, created_at, filename, purpose, bytes FROM files {clause} "
                              "ORDER BY rowid DESC LIMIT ?", [*args, limit + 1]).fetchall()
        return [FileInfo(*r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> None:
        """Forget a file. The input file of a stored batch stays while the batch does (the batch refers to it;
        OpenAI would let it go); a batch's output and error files may go, its counts and results stay."""
        with self._write() as db:
            used = db.execute("SELECT id FROM batches WHERE input_file_id = ? LIMIT 1", (file_id,)).fetchone()
            if used is not None:
                raise Conflict(f"file {file_id!r} is the input of batch {used[0]!r}; it stays while the batch does")
            if db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 0:
                raise NotFound(f"no file {file_id!r}")

    # -- batches ------------------------------------------------------------------------------------------
    def _insert_batch(self, db: sqlite3.Connection, input_file_id: str, endpoint: str, window: str, window_s: int,
                      requests: Sequence[BatchRequest], metadata: Mapping[str, str], now: int) -> str:
        batch_id = f"batch_{uuid.uuid4().hex}"
        db.execute("INSERT INTO batches (id, created_at, status, endpoint, completion_window, expires_at, input_file_id, "
                   "total, metadata, in_progress_at) VALUES (?, ?, 'in_progress', ?, ?, ?, ?, ?, ?, ?)",
                   (batch_id, now, endpoint, window, now + window_s, input_file_id, len(requests),
                    json.dumps(dict(metadata)), now))
        db.executemany("INSERT INTO items (batch_id, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                       ((batch_id, i, r.custom_id, json.dumps(r.body, separators=(",", ":"), ensure_ascii=False))
                        for i, r in enumerate(requests)))
        return batch_id

    def create_batch(self, input_file_id: str, *, endpoint: str, window: str, window_s: int,
                     requests: Sequence[BatchRequest], metadata: Mapping[str, str]) -> BatchInfo:
        """A batch over an uploaded file (already parsed into `requests`); it starts in_progress."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM files WHERE id = ?", (input_file_id,)).fetchone() is None:
                raise NotFound(f"no file {input_file_id!r}")
            batch_id = self._insert_batch(db, input_file_id, endpoint, window, window_s, requests, metadata, self._now())
            return self._get(db, batch_id)

    def submit(self, content: bytes, filename: str, *, endpoint: str, window: str, window_s: int,
               requests: Sequence[BatchRequest], metadata: Mapping[str, str]) -> BatchInfo:
        """The input file and its batch in one transaction (the gRPC API sends both at once)."""
        with self._write() as db:
            now = self._now()
            f = self._insert_file(db, content, filename, "batch", now)
            batch_id = self._insert_batch(db, f.id, endpoint, window, window_s, requests, metadata, now)
            return self._get(db, batch_id)

    @staticmethod
    def _get(db: sqlite3.Connection | None, batch_id: str) -> BatchInfo:
        row = (db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
               if db is not None else None)
        if row is None:
            raise NotFound(f"no batch {batch_id!r}")
        return _batch(row)

    def batch(self, batch_id: str) -> BatchInfo:
        with self._read() as db:
            return self._get(db, batch_id)

    def list_batches(self, limit: int, after: str = "") -> tuple[list[BatchInfo], bool]:
        """Newest first, up to `limit`, starting after the batch `after` (OpenAI's cursor); and whether more follow."""
        with self._read() as db:
            if db is None:
                if after:
                    raise NotFound(f"no batch {after!r}")
                return [], False
            where = ""
            args: list[int] = []
            if after:
                row = db.execute("SELECT rowid FROM batches WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise NotFound(f"no batch {after!r}")
                where, args = "WHERE rowid < ?", [row[0]]
            rows = db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches {where} ORDER BY rowid DESC LIMIT ?",
                              [*args, limit + 1]).fetchall()
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[BatchInfo]:
        """Batches the runner works on, oldest first."""
        with self._read() as db:
            if db is None:
                return []
            rows = db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE status IN (?, ?) ORDER BY rowid",
                              ACTIVE).fetchall()
        return [_batch(r) for r in rows]

    def cancel(self, batch_id: str) -> BatchInfo:
        """in_progress -> cancelling (the runner stops its requests and finishes it as cancelled). Cancelling a
        batch that is cancelling or cancelled again is a no-op; one that ended otherwise is a Conflict."""
        if not self.exists():  # no batch was ever stored: do not create the file to say so
            raise NotFound(f"no batch {batch_id!r}")
        with self._write() as db:
            b = self._get(db, batch_id)
            if b.status == "in_progress":
                db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                           (self._now(), batch_id))
                return self._get(db, batch_id)
            if b.status in ("cancelling", "cancelled"):
                return b
            raise Conflict(f"batch {batch_id!r} is {b.status}; only a batch in progress can be cancelled")

    # -- requests -----------------------------------------------------------------------------------------
    def pending_items(self, batch_id: str, after_index: int, limit: int) -> list[Item]:
        """Requests without a result, in input order, from index `after_index` + 1."""
        with self._read() as db:
            if db is None:
                return []
            rows = db.execute("SELECT idx, custom_id, body FROM items WHERE batch_id = ? AND state = 'pending' AND "
                              "idx > ? ORDER BY idx LIMIT ?", (batch_id, after_index, limit)).fetchall()
        return [Item(batch_id, idx, cid, json.loads(body)) for idx, cid, body in rows]

    def start_item(self, batch_id: str, index: int) -> int:
        """Count an attempt to run the request (what a re-run after a restart shows); its new count."""
        with self._write() as db:
            db.execute("UPDATE items SET attempts = attempts + 1 WHERE batch_id = ? AND idx = ?", (batch_id, index))
            row = db.execute("SELECT attempts FROM items WHERE batch_id = ? AND idx = ?", (batch_id, index)).fetchone()
        return int(row[0]) if row is not None else 0

    def record(self, batch_id: str, index: int, line: str, ok: bool) -> bool:
        """Record the request's result line (exactly once): False when it already had one (a re-run's result,
        or the batch ended meanwhile), which is then dropped."""
        with self._write() as db:
            cur = db.execute("UPDATE items SET state = ?, result = ? WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                             ("done" if ok else "failed", line, batch_id, index))
            if cur.rowcount != 1:
                return False
            db.execute(f"UPDATE batches SET {'completed' if ok else 'failed'} = "
                       f"{'completed' if ok else 'failed'} + 1 WHERE id = ?", (batch_id,))
        return True

    def finish(self, batch_id: str, status: str) -> BatchInfo:
        """End an active batch as `status` (completed, expired or cancelled): requests still pending get an
        error line saying they never ran, the output file (the successful lines) and the error file (the
        rest) are written, in input order, and the status changes, all in one transaction. A batch that
        already ended is returned as it is."""
        with self._write() as db:
            b = self._get(db, batch_id)
            if b.status not in ACTIVE:
                return b
            now = self._now()
            if status in _NEVER_RAN_CODE:
                code = _NEVER_RAN_CODE[status]
                pending = db.execute("SELECT idx, custom_id FROM items WHERE batch_id = ? AND state = 'pending'",
                                     (batch_id,)).fetchall()
                db.executemany("UPDATE items SET state = 'failed', result = ? WHERE batch_id = ? AND idx = ?",
                               ((never_ran_line(line_id(), cid, code), batch_id, idx) for idx, cid in pending))
                db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(pending), batch_id))
            files: dict[str, str | None] = {}
            for state, suffix in (("done", "output"), ("failed", "error")):
                lines = [r[0] for r in db.execute("SELECT result FROM items WHERE batch_id = ? AND state = ? ORDER BY idx",
                                                  (batch_id, state))]
                files[suffix] = (self._insert_file(db, ("\n".join(lines) + "\n").encode("utf-8"),
                                                   f"{batch_id}_{suffix}.jsonl", "batch_output", now).id
                                 if lines else None)
            db.execute(f"UPDATE batches SET status = ?, finalizing_at = ?, {_ENDED_AT[status]} = ?, output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?", (status, now, now, files["output"], files["error"], batch_id))
            return self._get(db, batch_id)

    def results(self, batch_id: str, after_index: int = -1, limit: int = 1000) -> list[ItemResult]:
        """Recorded results in input order, from index `after_index` + 1 (requests still pending are skipped)."""
        with self._read() as db:
            self._get(db, batch_id)
            assert db is not None
            rows = db.execute("SELECT idx, custom_id, state, result, attempts FROM items WHERE batch_id = ? AND "
                              "state != 'pending' AND idx > ? ORDER BY idx LIMIT ?", (batch_id, after_index, limit))
            return [ItemResult(idx, cid, state == "done", line, attempts) for idx, cid, state, line, attempts in rows]
