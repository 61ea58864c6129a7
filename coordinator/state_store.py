"""The coordinator's state dir: the run's state in an embedded SQLite database (WAL).

`ripples coordinator serve --state-dir DIR` keeps DIR/coordinator.db: the run's last
snapshot (coordinator/snapshot.py: one row per worker, the run's other state as
key/value rows), the coordinator's incarnation (it grows at every start on the same
dir) and the rendezvous store's port, which a restarted coordinator binds again so the
workers find it where they left it. No external service: SQLite ships with Python.

WAL mode with synchronous=NORMAL: a save is one transaction that a crash of the
coordinator process never tears (the database is always at the previous or the new
save); a power loss may lose the last saves, never the file. Saves are whole snapshots,
written at every membership change and twice a second otherwise, so a restart loses at
most half a second of progress reports, which the workers' next reports restore.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

DB_NAME = "coordinator.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (worker_id INTEGER PRIMARY KEY, record TEXT NOT NULL);
"""


class StateStore:
    """One coordinator's state dir. Thread-safe: saves may run off the event loop."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path = self.directory / DB_NAME
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as err:
            raise OSError(f"cannot use the state dir {self.directory}: {err}") from err
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ meta
    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta(self, key: str, value: str) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def next_incarnation(self) -> int:
        """This start's incarnation: 1 on a new dir, one more than the last start's."""
        incarnation = int(self._meta("incarnation") or 0) + 1
        self._set_meta("incarnation", str(incarnation))
        return incarnation

    @property
    def store_port(self) -> int:
        """The rendezvous store's port of the last start (0: none yet)."""
        return int(self._meta("store_port") or 0)

    @store_port.setter
    def store_port(self, port: int) -> None:
        self._set_meta("store_port", str(port))

    # ------------------------------------------------------------------ the run
    def load(self) -> dict[str, Any] | None:
        """The last saved snapshot, or None for a new dir."""
        with self._lock:
            rows = dict(self._db.execute("SELECT key, value FROM run").fetchall())
            workers = self._db.execute(
                "SELECT record FROM workers ORDER BY worker_id").fetchall()
        if not rows:
            return None
        try:
            snapshot = {key: json.loads(value) for key, value in rows.items()}
            snapshot["workers"] = [json.loads(record) for (record,) in workers]
        except json.JSONDecodeError as err:
            raise ValueError(f"the state in {self.path} is damaged: {err}") from err
        return snapshot

    def save(self, snapshot: dict[str, Any]) -> None:
        """Replace the saved snapshot with this one, in one transaction."""
        run = [(key, json.dumps(value)) for key, value in snapshot.items() if key != "workers"]
        workers = [(w["worker_id"], json.dumps(w)) for w in snapshot["workers"]]
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO run VALUES (?, ?)", run)
            self._db.executemany("INSERT OR REPLACE INTO workers VALUES (?, ?)", workers)

    def close(self) -> None:
        with self._lock:
            self._db.close()
