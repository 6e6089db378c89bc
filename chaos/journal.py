"""The run journal: one durable, append-only SQLite file per run.

Every request, fault, heal and phase is written here before anything is computed from it, so the
reports are a pure function of this file and a crashed run still has one. WAL mode lets readers
(`pdchaos report` on a live run) work while the writer appends. `synchronous=NORMAL` gives up
durability only on power loss: a committed transaction survives a SIGKILL of the writer.

Requests are buffered and committed in batches (at least every `flush_interval_s`, or every
`flush_every` records), because one commit per request would cap the load we can record. Events
and meta are rare and often must be durable before the next step (a heal plan before its fault),
so they commit at once, after the buffered requests, which keeps the file a prefix of the run.
"""

from __future__ import annotations

import atexit
import enum
import functools
import json
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from chaos import transport

JOURNAL_FILENAME = "journal.sqlite"
SCHEMA_VERSION = 1


class JournalError(Exception):
    """The journal cannot be used as asked (wrong schema, closed, read-only)."""


class Outcome(str, enum.Enum):
    """What the client knows about a request, as in Jepsen histories."""

    OK = "ok"  # definitely succeeded
    FAIL = "fail"  # definitely did not take effect
    INFO = "info"  # indeterminate: timeout, disconnect, abort in flight


class EventKind(str, enum.Enum):
    """The kinds the suite writes; `JournalEvent.kind` is a plain string so others can be added."""

    PHASE = "phase"
    FAULT = "fault"
    CONFIRM = "confirm"
    HEAL = "heal"
    AUDIT = "audit"
    PROBE = "probe"
    NOTE = "note"
    VERDICT = "verdict"


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are epoch seconds (time.time())."""

    id: str
    request_index: int  # the number its canary markers carry
    phase: str | None = None  # baseline, load, aftershock, ...
    user_kind: str = ""
    actor: str = ""
    endpoint: str = ""
    stream: bool = False
    markers: list[str] = field(default_factory=list)
    prompt: str = ""  # may be left empty to save space; prompt_chars still says how long it was
    prompt_chars: int | None = None  # None: len(prompt)
    max_tokens: int | None = None
    planned_send: float | None = None  # when the load shape wanted it sent (coordinated omission)
    t_send: float | None = None
    t_first_byte: float | None = None
    t_first_token: float | None = None
    t_end: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival time of each token chunk
    status: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    response_text: str = ""
    body_bytes: int | None = None
    outcome: Outcome = Outcome.INFO  # nothing proven yet is indeterminate
    error_class: str | None = None
    error_detail: str | None = None
    anomaly: str | None = None

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.outcome)
        if self.prompt_chars is None:
            self.prompt_chars = len(self.prompt)


@dataclass(frozen=True)
class JournalEvent:
    """A fault, heal, phase change, probe or note; `data` is any JSON object."""

    kind: str
    name: str
    data: Mapping[str, Any] = field(default_factory=dict)
    t: float = field(default_factory=time.time)
    seq: int | None = None  # assigned by the journal

    def __post_init__(self) -> None:
        if isinstance(self.kind, enum.Enum):  # store "fault", not "EventKind.FAULT"
            object.__setattr__(self, "kind", str(self.kind.value))


_SCHEMA = """
CREATE TABLE requests (
    id TEXT PRIMARY KEY,
    request_index INTEGER NOT NULL,
    phase TEXT,
    user_kind TEXT NOT NULL,
    actor TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    stream INTEGER NOT NULL CHECK (stream IN (0, 1)),
    markers TEXT NOT NULL,
    prompt TEXT NOT NULL,
    prompt_chars INTEGER NOT NULL,
    max_tokens INTEGER,
    planned_send REAL,
    t_send REAL,
    t_first_byte REAL,
    t_first_token REAL,
    t_end REAL,
    token_times TEXT NOT NULL,
    status INTEGER,
    finish_reason TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    cached_tokens INTEGER,
    response_text TEXT NOT NULL,
    body_bytes INTEGER,
    outcome TEXT NOT NULL CHECK (outcome IN ('ok', 'fail', 'info')),
    error_class TEXT,
    error_detail TEXT,
    anomaly TEXT
);
CREATE INDEX requests_by_index ON requests (request_index);
CREATE INDEX requests_by_send ON requests (t_send);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    t REAL NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX events_by_kind ON events (kind, name);
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

REQUEST_COLUMNS = tuple(f.name for f in fields(RequestRecord))
_JSON_COLUMNS = frozenset({"markers", "token_times"})
_INSERT_REQUEST = (
    f"INSERT INTO requests ({', '.join(REQUEST_COLUMNS)}) VALUES ({', '.join('?' for _ in REQUEST_COLUMNS)})"
)


def _request_row(record: RequestRecord) -> tuple[Any, ...]:
    row: list[Any] = []
    for name in REQUEST_COLUMNS:
        value = getattr(record, name)
        if name in _JSON_COLUMNS:
            value = json.dumps(value)
        elif name == "stream":
            value = int(bool(value))
        elif name == "outcome":
            value = Outcome(value).value
        if isinstance(value, str):
            value = transport.redact(value)  # a target may echo the API key back in a body
        row.append(value)
    return tuple(row)


def _request_from_row(row: tuple[Any, ...]) -> RequestRecord:
    values = dict(zip(REQUEST_COLUMNS, row, strict=True))
    for name in _JSON_COLUMNS:
        values[name] = json.loads(values[name])
    values["stream"] = bool(values["stream"])
    return RequestRecord(**values)


def _event_from_row(row: tuple[Any, ...]) -> JournalEvent:
    seq, t, kind, name, data = row
    return JournalEvent(kind=kind, name=name, data=json.loads(data), t=t, seq=seq)


def _close_if_alive(ref: weakref.ref[Journal]) -> None:
    journal = ref()
    if journal is not None:
        journal.close()


class Journal:
    """One run's journal. Use `create` or `open`; safe to share between threads."""

    def __init__(
        self,
        path: Path,
        conn: sqlite3.Connection,
        *,
        readonly: bool,
        flush_interval_s: float,
        flush_every: int,
    ) -> None:
        self.path = path
        self.readonly = readonly
        self._conn = conn
        self._lock = threading.RLock()
        self._pending: list[tuple[Any, ...]] = []
        self._flush_every = flush_every
        self._flush_interval_s = flush_interval_s
        self._flush_error: Exception | None = None
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        self._at_exit = functools.partial(_close_if_alive, weakref.ref(self))
        if not readonly:
            # A run that exits without close() still commits what it buffered.
            atexit.register(self._at_exit)
            self._flusher = threading.Thread(
                target=self._flush_periodically, name=f"journal-flush:{path.name}", daemon=True
            )
            self._flusher.start()

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def create(cls, run_dir: str | Path, *, flush_interval_s: float = 0.5, flush_every: int = 256) -> Journal:
        """A new, empty journal at RUN_DIR/journal.sqlite (the directory is made if needed)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / JOURNAL_FILENAME
        if path.exists():
            raise FileExistsError(f"{path}: a run directory holds one journal; use a new run dir")
        conn = cls._connect(path, readonly=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")  # persists in the file: readers get WAL too
            conn.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        finally:
            conn.close()
        return cls.open(path, flush_interval_s=flush_interval_s, flush_every=flush_every)

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        readonly: bool = False,
        flush_interval_s: float = 0.5,
        flush_every: int = 256,
    ) -> Journal:
        """An existing journal, by its file or its run directory."""
        path = Path(path)
        if path.is_dir():
            path = path / JOURNAL_FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no journal here (is it a pdchaos run directory?)")
        conn = cls._connect(path, readonly=readonly)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION:
            conn.close()
            raise JournalError(f"{path}: journal schema version {version}, this pdchaos reads {SCHEMA_VERSION}")
        return cls(
            path,
            conn,
            readonly=readonly,
            flush_interval_s=flush_interval_s,
            flush_every=flush_every,
        )

    @staticmethod
    def _connect(path: Path, *, readonly: bool) -> sqlite3.Connection:
        target = f"{path.resolve().as_uri()}?mode=ro" if readonly else str(path)
        # Autocommit mode: transactions are the explicit BEGIN/COMMIT below. The lock in Journal
        # serialises threads, so the connection may be used from the flusher thread too.
        conn = sqlite3.connect(target, uri=readonly, isolation_level=None, check_same_thread=False, timeout=10.0)
        if not readonly:
            conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------

    def append_request(self, record: RequestRecord) -> None:
        self.append_requests((record,))

    def append_requests(self, records: Iterable[RequestRecord]) -> None:
        rows = [_request_row(r) for r in records]  # serialise here: bad values fail the caller
        with self._lock:
            self._check_writable()
            self._pending.extend(rows)
            if len(self._pending) >= self._flush_every:
                self._flush_locked()

    def append_event(self, event: JournalEvent) -> JournalEvent:
        """Commit the event now (after any buffered requests); returns it with its `seq`."""
        data = transport.redact(json.dumps(dict(event.data)))
        with self._lock:
            self._check_writable()
            self._flush_locked()
            return replace(event, seq=self._insert_event(event.t, event.kind, event.name, data))

    def set_meta(self, key: str, value: Any) -> None:
        """Commit a JSON value under `key` now, replacing any earlier one."""
        encoded = transport.redact(json.dumps(value))
        with self._lock:
            self._check_writable()
            self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, encoded))

    def flush(self) -> None:
        """Commit every buffered request now."""
        with self._lock:
            self._check_open()
            self._flush_locked()

    def close(self) -> None:
        """Commit what is buffered and close; safe to call twice."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        if self._flusher is not None:
            self._flusher.join()
            atexit.unregister(self._at_exit)
        with self._lock:
            try:
                if not self.readonly:
                    self._flush_locked()
            finally:
                self._conn.close()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise JournalError(f"{self.path}: journal is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise JournalError(f"{self.path}: journal was opened read-only")
        if self._flush_error is not None:
            error, self._flush_error = self._flush_error, None
            raise JournalError(f"{self.path}: a background flush failed: {error}") from error

    def _flush_periodically(self) -> None:
        while not self._closed.wait(self._flush_interval_s):
            with self._lock:
                if self._closed.is_set():
                    return
                try:
                    self._flush_locked()
                except Exception as error:  # kept for the writer's next call; rows stay buffered
                    self._flush_error = error

    def _flush_locked(self) -> None:
        if not self._pending:
            return
        rows = self._pending
        try:
            self._insert_rows(rows)
        except sqlite3.IntegrityError:
            # A duplicate id must not poison the batch: insert one by one and keep each
            # rejected record as an event, so nothing the client saw is lost.
            self._insert_rows_one_by_one(rows)
        self._pending = []

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> None:
        self._conn.execute("BEGIN")
        try:
            self._conn.executemany(_INSERT_REQUEST, rows)
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _insert_rows_one_by_one(self, rows: list[tuple[Any, ...]]) -> None:
        self._conn.execute("BEGIN")
        try:
            for row in rows:
                try:
                    self._conn.execute(_INSERT_REQUEST, row)
                except sqlite3.IntegrityError as error:
                    rejected = {"error": str(error), "record": dict(zip(REQUEST_COLUMNS, row, strict=True))}
                    self._insert_event(time.time(), EventKind.NOTE.value, "rejected_request", json.dumps(rejected))
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _insert_event(self, t: float, kind: str, name: str, data: str) -> int:
        cursor = self._conn.execute(
            "INSERT INTO events (t, kind, name, data) VALUES (?, ?, ?, ?)", (t, kind, name, data)
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    # -- reading ---------------------------------------------------------------------------

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self._query_one("SELECT value FROM meta WHERE key = ?", (key,))
        return default if row is None else json.loads(row[0])

    def all_meta(self) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            rows = self._conn.execute("SELECT key, value FROM meta ORDER BY key").fetchall()
        return {key: json.loads(value) for key, value in rows}

    def count_requests(self, *, outcome: Outcome | str | None = None) -> int:
        if outcome is None:
            row = self._query_one("SELECT COUNT(*) FROM requests", ())
        else:
            row = self._query_one("SELECT COUNT(*) FROM requests WHERE outcome = ?", (Outcome(outcome).value,))
        assert row is not None
        return int(row[0])

    def get_request(self, request_id: str) -> RequestRecord | None:
        columns = ", ".join(REQUEST_COLUMNS)
        row = self._query_one(f"SELECT {columns} FROM requests WHERE id = ?", (request_id,))
        return None if row is None else _request_from_row(row)

    def iter_requests(
        self,
        *,
        outcome: Outcome | str | None = None,
        phase: str | None = None,
        batch_size: int = 1000,
    ) -> Iterator[RequestRecord]:
        """Requests in the order they were committed, read a page at a time (runs are large)."""
        where, params = ["rowid > ?"], []
        if outcome is not None:
            where.append("outcome = ?")
            params.append(Outcome(outcome).value)
        if phase is not None:
            where.append("phase = ?")
            params.append(phase)
        sql = (
            f"SELECT rowid, {', '.join(REQUEST_COLUMNS)} FROM requests "
            f"WHERE {' AND '.join(where)} ORDER BY rowid LIMIT ?"
        )
        for row in self._iter_pages(sql, params, batch_size):
            yield _request_from_row(row[1:])

    def iter_events(
        self,
        *,
        kind: EventKind | str | None = None,
        name: str | None = None,
        after_seq: int = 0,
        batch_size: int = 1000,
    ) -> Iterator[JournalEvent]:
        """Events in `seq` order; `after_seq` lets a follower read only what is new."""
        where, params = ["seq > ?"], []
        if kind is not None:
            where.append("kind = ?")
            params.append(kind.value if isinstance(kind, EventKind) else kind)
        if name is not None:
            where.append("name = ?")
            params.append(name)
        sql = f"SELECT seq, t, kind, name, data FROM events WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"
        for row in self._iter_pages(sql, params, batch_size, initial_key=after_seq):
            yield _event_from_row(row)

    def _iter_pages(
        self, sql: str, params: list[Any], batch_size: int, *, initial_key: int = 0
    ) -> Iterator[tuple[Any, ...]]:
        """Keyset pagination on the first column: the lock is never held while the caller runs."""
        if not self.readonly:
            self.flush()  # a writer reads its own appends
        last = initial_key
        while True:
            with self._lock:
                self._check_open()
                rows = self._conn.execute(sql, (last, *params, batch_size)).fetchall()
            yield from rows
            if len(rows) < batch_size:
                return
            last = rows[-1][0]

    def _query_one(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        with self._lock:
            self._check_open()
            if not self.readonly:
                self._flush_locked()
            row: tuple[Any, ...] | None = self._conn.execute(sql, params).fetchone()
            return row
