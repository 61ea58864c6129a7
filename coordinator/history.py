"""The coordinator service's runs: submitted, active and finished, in SQLite.

`DIR/history.db` (the state dir; an in-memory database without one) holds one row per
run: what was submitted (the run's options, the script, its name), where the run stands
(queued, running, finished, failed, stopped, cancelled) and, once it ended, its final
RunStatus: settings, per-worker records, the bounded loss curve, the stop reason. A
finished run's dashboard page and `ripples status RUN` render from that row after the
run's workers are gone. The service's own counters live in the same file (the worker
ids handed out so far, the coordinator's incarnation, the rendezvous store's port).

Writes are single transactions (WAL, synchronous=NORMAL), as in state_store.py.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from ripples.coordinator.state_store import StoreWriteError, open_database
from ripples.run_records import ENDED, agent_summary, state_name, summary
from ripples.v1 import coordinator_pb2 as pb

__all__ = ["DB_NAME", "ENDED", "RunHistory", "agent_summary", "state_name", "summary"]

DB_NAME = "history.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT UNIQUE NOT NULL,
    info BLOB NOT NULL,          -- RunInfo
    options TEXT NOT NULL,       -- the run's options as submitted (JSON)
    final_status BLOB            -- RunStatus at the end (NULL until then)
);
"""
class RunHistory:
    """Every run of one coordinator service. Thread-safe."""

    def __init__(self, directory: str | Path | None) -> None:
        self.path = Path(directory) / DB_NAME if directory else None
        self._db = open_database(self.path, SCHEMA, f"keep the run history in {self.path}")
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ counters
    def meta(self, key: str, default: int = 0) -> int:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else int(row[0])

    def set_meta(self, key: str, value: int) -> None:
        """Store a counter (StoreWriteError if the disk refuses: nothing changed)."""
        with self._writing():
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, str(value)))

    # ------------------------------------------------------------------ runs
    def add(self, info: pb.RunInfo, options: dict[str, object]) -> None:
        """A new run (ValueError when its id is taken; StoreWriteError if the disk refuses
        it: nothing is stored)."""
        try:
            with self._writing():
                self._db.execute("INSERT INTO runs (run_id, info, options) VALUES (?, ?, ?)",
                                 (info.run_id, info.SerializeToString(),
                                  json.dumps(options)))
        except sqlite3.IntegrityError as err:
            raise ValueError(f"a run with id {info.run_id!r} exists already") from err

    def update(self, info: pb.RunInfo, final_status: pb.RunStatus | None = None) -> None:
        """A run's new row (StoreWriteError if the disk refuses it: the old row stays)."""
        with self._writing():
            if final_status is None:
                self._db.execute("UPDATE runs SET info = ? WHERE run_id = ?",
                                 (info.SerializeToString(), info.run_id))
            else:
                self._db.execute(
                    "UPDATE runs SET info = ?, final_status = ? WHERE run_id = ?",
                    (info.SerializeToString(), final_status.SerializeToString(), info.run_id))

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One write transaction; a disk that refuses it (full, read-only, failing) raises
        StoreWriteError, which says so, and the transaction is rolled back."""
        with self._lock:
            try:
                with self._db:
                    yield
            except sqlite3.IntegrityError:
                raise
            except sqlite3.OperationalError as err:
                raise StoreWriteError(self.path or Path(":memory:"), err,
                                      "the run history") from err

    def runs(self) -> list[pb.RunInfo]:
        """Every run, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT run_id, info FROM runs ORDER BY seq").fetchall()
        return [_read_info(run_id, info) for run_id, info in rows]

    def get(self, run_id: str) -> pb.RunInfo | None:
        """The run with this id, or with this unique id prefix (as git's short hashes)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT run_id, info FROM runs WHERE run_id = ? OR run_id LIKE ? ESCAPE '\\' "
                "ORDER BY seq", (run_id, _like_prefix(run_id))).fetchall()
        infos = [_read_info(found, info) for found, info in rows]
        exact = [i for i in infos if i.run_id == run_id]
        if exact:
            return exact[0]
        named = [i for i in self.runs() if i.name == run_id]
        if len(named) == 1:
            return named[0]
        return infos[0] if len(infos) == 1 else None

    def options(self, run_id: str) -> dict[str, Any]:
        """The run's options as submitted (RunSettings.build takes them; ValueError when
        its row holds no JSON object, as a hand edit may leave it)."""
        with self._lock:
            row = self._db.execute("SELECT options FROM runs WHERE run_id = ?",
                                   (run_id,)).fetchone()
        if row is None:
            raise KeyError(run_id)
        options = json.loads(row[0])
        if not isinstance(options, dict):
            raise ValueError(f"run {run_id}'s options in {DB_NAME} are no JSON object")
        return options

    def final_status(self, run_id: str) -> pb.RunStatus | None:
        with self._lock:
            row = self._db.execute("SELECT final_status FROM runs WHERE run_id = ?",
                                   (run_id,)).fetchone()
        if row is None or row[0] is None:
            return None
        try:
            return pb.RunStatus.FromString(row[0])
        except DecodeError as err:
            raise ValueError(f"run {run_id}'s final status in {DB_NAME} cannot be read: "
                             f"{err}") from None

    def queued(self) -> list[pb.RunInfo]:
        return [i for i in self.runs() if i.state == pb.RUN_STATE_QUEUED]

    def running(self) -> pb.RunInfo | None:
        active = [i for i in self.runs() if i.state == pb.RUN_STATE_RUNNING]
        return active[-1] if active else None

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _read_info(run_id: str, blob: bytes) -> pb.RunInfo:
    """A run's row; one that cannot be read (a hand edit, a torn write of an older
    version) is listed as a failed run saying so, and the others stay readable."""
    try:
        return pb.RunInfo.FromString(blob)
    except DecodeError as err:
        return pb.RunInfo(run_id=run_id, state=pb.RUN_STATE_FAILED,
                          stop_reason=f"damaged record: its row in {DB_NAME} cannot be read "
                                      f"({err})")


def _like_prefix(text: str) -> str:
    """A LIKE pattern (ESCAPE '\\') for the ids that start with `text`."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
