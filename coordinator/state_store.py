"""The coordinator's state dir: the run's state in an embedded SQLite database (WAL).

`ripples coordinator serve --state-dir DIR` keeps the active run's state in
DIR/runs/<run id>/coordinator.db: its last snapshot (coordinator/snapshot.py: one row
per worker, the run's other state as key/value rows). The service's own counters (the
coordinator's incarnation, the rendezvous store's port, which a restarted coordinator
binds again so the workers find it where they left it) are in DIR/history.db
(coordinator/history.py). No external service: SQLite ships with Python.

WAL mode with synchronous=NORMAL: a save is one transaction that a crash of the
coordinator process never tears (the database is always at the previous or the new
save); a power loss may lose the last saves, never the file. Saves happen at every
membership change and twice a second otherwise (less often past 5,000 workers:
state_saver.save_interval, 10 s at 100,000), so a restart loses at most that much of the
progress reports, which the workers' next reports restore. A save writes only the rows
that changed since the last one: a registration stores the new worker's row and the run's
changed keys, not every worker again (a whole rewrite took 54 ms per Register at 2,000
workers, against 0.2 ms: bench/state_store.py).

A save the disk refuses (full, read-only, failing) raises StoreWriteError and changes
nothing stored; the caller keeps its memory consistent with that (a registration is
undone and refused, other saves are retried).
"""

from __future__ import annotations

import errno
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

DB_NAME = "coordinator.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (worker_id INTEGER PRIMARY KEY, record TEXT NOT NULL);
"""


def open_database(path: Path | None, schema: str, what: str) -> sqlite3.Connection:
    """An SQLite database at `path` (None: in memory) in WAL mode with synchronous=NORMAL
    (see above), its tables made; OSError saying `what` it was for."""
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path) if path else ":memory:", check_same_thread=False,
                             timeout=10.0)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(schema)
    except (OSError, sqlite3.Error) as err:
        raise OSError(f"cannot {what}: {err}") from err
    return db


class StoreWriteError(OSError):
    """A save the state dir's disk refused; nothing of it was stored."""

    def __init__(self, path: Path, err: sqlite3.Error | OSError,
                 what: str = "the run's state") -> None:
        name = getattr(err, "sqlite_errorname", "")
        self.full = name == "SQLITE_FULL" or getattr(err, "errno", None) == errno.ENOSPC
        """The disk is full (else read-only or failing)."""
        super().__init__(f"cannot save {what} in {path}: {err}")

    @property
    def reason(self) -> str:
        """What a client is told: the cause, without the server's paths."""
        return ("the disk of the coordinator's state dir is full" if self.full else
                "the coordinator's state dir cannot be written (a read-only or failing disk)")

    @property
    def status(self) -> str:
        """The gRPC status a refused call gets: RESOURCE_EXHAUSTED for a full disk (a
        client may retry once space is freed), UNAVAILABLE for a read-only or failing one."""
        return "RESOURCE_EXHAUSTED" if self.full else "UNAVAILABLE"


class StateStore:
    """One run's state in the state dir. Thread-safe: saves may run off the event loop."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / DB_NAME
        self._db = open_database(self.path, SCHEMA, f"use the state dir {self.directory}")
        self._lock = threading.Lock()
        self._last_encoded: dict[str, tuple[Any, str]] = {}
        """Each run key's last value and its JSON text (`_encoded`)."""
        self._saved_run: dict[str, str] = {}
        """The text of each run key as stored (a save writes the keys that differ)."""
        self._saved_workers: dict[int, str] = {}
        """The text of each worker's row as stored."""

    # ------------------------------------------------------------------ the run
    def load(self) -> dict[str, Any] | None:
        """The last saved snapshot, or None for a new dir."""
        with self._lock:
            rows = dict(self._db.execute("SELECT key, value FROM run").fetchall())
            workers = self._db.execute(
                "SELECT worker_id, record FROM workers ORDER BY worker_id").fetchall()
            self._saved_run, self._saved_workers = dict(rows), dict(workers)
        if not rows:
            return None
        try:
            snapshot = {key: json.loads(value) for key, value in rows.items()}
            snapshot["workers"] = [json.loads(record) for (_, record) in workers]
        except json.JSONDecodeError as err:
            raise ValueError(f"the state in {self.path} is damaged: {err}") from err
        return snapshot

    def save(self, snapshot: dict[str, Any]) -> None:
        """Store the snapshot's run keys and worker rows (all of them, or the workers a
        partial snapshot holds: snapshot.take's `only`), in one transaction, writing
        those that differ from what is stored; StoreWriteError if the disk refuses."""
        run = {key: self._encoded(key, value) for key, value in snapshot.items()
               if key != "workers"}
        workers = {w["worker_id"]: json.dumps(w) for w in snapshot["workers"]}
        with self._lock:
            changed_run = [(k, v) for k, v in run.items() if self._saved_run.get(k) != v]
            changed = [(i, v) for i, v in workers.items() if self._saved_workers.get(i) != v]
            if not changed_run and not changed:
                return
            try:
                with self._db:
                    self._db.executemany("INSERT OR REPLACE INTO run VALUES (?, ?)",
                                         changed_run)
                    self._db.executemany("INSERT OR REPLACE INTO workers VALUES (?, ?)",
                                         changed)
            except (sqlite3.Error, OSError) as err:
                raise StoreWriteError(self.path, err) from err
            self._saved_run.update(changed_run)
            self._saved_workers.update(changed)

    def _encoded(self, key: str, value: Any) -> str:
        """`value` as JSON text; encoded once while the snapshots hand the same object
        (the run's settings, with their edge list: core.settings_options)."""
        last = self._last_encoded.get(key)
        if last is not None and last[0] is value:
            return last[1]
        text = json.dumps(value)
        self._last_encoded[key] = (value, text)
        return text

    def check_writable(self) -> None:
        """StoreWriteError unless the disk takes a write now (a registration asks first,
        so that it is refused before it changed anything)."""
        with self._lock:
            try:
                with self._db:
                    self._db.execute("UPDATE run SET value = value WHERE key = 'format'")
            except (sqlite3.Error, OSError) as err:
                raise StoreWriteError(self.path, err) from err

    def close(self) -> None:
        with self._lock:
            self._db.close()
