"""The coordinator's state dir: the run's state in an embedded SQLite database (WAL).

`ripples coordinator serve --state-dir DIR` keeps the active run's state in
DIR/runs/<run id>/coordinator.db: its last snapshot (coordinator/snapshot.py: one row
per worker, the run's other state as key/value rows). The service's own counters (the
coordinator's incarnation, the rendezvous store's port, which a restarted coordinator
binds again so the workers find it where they left it) are in DIR/history.db
(coordinator/history.py). No external service: SQLite ships with Python.

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


class StateStore:
    """One run's state in the state dir. Thread-safe: saves may run off the event loop."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / DB_NAME
        self._db = open_database(self.path, SCHEMA, f"use the state dir {self.directory}")
        self._lock = threading.Lock()

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
