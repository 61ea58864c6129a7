"""The state dir itself: one coordinator at a time, and never a silent fresh start.

`ripples coordinator serve --state-dir DIR` keeps the run history in DIR/history.db and
each run's state in DIR/runs/<run id>/ (coordinator/history.py, state_store.py). Two
things would lose that state without a word, so a coordinator checks both at its start:

- Two coordinators on one dir both serve its active run and both hand out the same
  worker ids. `StateDirLock` holds an exclusive lock on DIR/lock (fcntl.flock) for the
  coordinator's life, with the holder's pid, host, address and start time written in
  it: a second coordinator is refused at once, naming the holder. The kernel drops the
  lock of a process that died (SIGKILL, a crash), so a restart never waits for a stale
  lock or asks for one to be removed.
- A history.db that is missing, empty or without its tables while the dir shows it had
  one (run dirs under runs/, SQLite's side files) would start as "no run yet": run ids
  and the worker-id counter would reset, breaking the promise that worker ids are unique
  across runs. `check_history` refuses to start, saying what is wrong and how to
  recover. A first start on an empty (or new) dir has no such traces and goes on.
  Likewise an active run whose state file is missing or empty would restart and forget
  its workers: `check_active_run` refuses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sqlite3
import time
from pathlib import Path

from ripples.coordinator.history import DB_NAME as HISTORY_NAME
from ripples.coordinator.history import RunHistory
from ripples.coordinator.state_store import DB_NAME as RUN_STATE_NAME

LOCK_NAME = "lock"
"""DIR/lock: held (flock) by the coordinator that serves DIR; its text names it."""

RECOVER = ("restore it from a backup, or move the state dir aside to start afresh "
           "(its runs and worker ids then start again from zero)")
"""How to recover from a state dir that lost its store (the refusal's end)."""


class StateLost(ValueError):
    """The state dir lost a store it had: the coordinator refuses to start (a damaged
    run's record, by contrast, fails that run alone)."""


class StateDirLock:
    """The exclusive lock of a state dir, held from `acquire` to `release`."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self._holder: dict[str, object] = {}

    def acquire(self) -> StateDirLock:
        """Take the lock; OSError naming the holder when another process has it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise OSError(f"cannot use the state dir {self.directory}: {err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OSError(f"the state dir {self.directory} is in use by another coordinator "
                          f"({holder}); stop that one first, or give this one another "
                          "--state-dir") from None
        self._fd = fd
        self._holder = {"pid": os.getpid(), "host": socket.gethostname(), "address": "",
                        "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        self._write()
        return self

    def note_address(self, address: str) -> None:
        """The holder's gRPC address, once it listens (a refused coordinator names it)."""
        if self._fd is not None:
            self._holder["address"] = address
            self._write()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def _write(self) -> None:
        """The holder's description as the lock file's text (best effort: the lock is
        what counts, the text only makes a refusal clearer)."""
        assert self._fd is not None
        with contextlib.suppress(OSError):
            data = (json.dumps(self._holder) + "\n").encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)


def _read_holder(fd: int) -> str:
    """The holder, as its lock file's text names it."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        holder = {}
    if not isinstance(holder, dict) or "pid" not in holder:
        return "its holder did not say who it is"
    address = f", serving {holder['address']}" if holder.get("address") else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')}{address}, since " \
           f"{holder.get('started', '?')}"


def check_history(directory: str | Path) -> None:
    """Refuse (ValueError saying how to recover) a state dir whose history is missing,
    empty or has no tables although the dir shows it had one. A new or empty dir, and a
    dir of the previous version, pass."""
    directory = Path(directory)
    path = directory / HISTORY_NAME
    traces = _traces(directory)
    if not path.exists():
        if traces:
            raise ValueError(f"the state dir {directory} has lost its run history: "
                             f"{HISTORY_NAME} is missing, yet {traces} remain; {RECOVER}")
        return
    if path.stat().st_size == 0:  # SQLite never leaves its file empty once it wrote
        raise ValueError(f"the run history {path} is empty (0 bytes): it was truncated; "
                         f"{RECOVER}")
    try:
        with contextlib.closing(sqlite3.connect(str(path), timeout=10.0)) as db:
            tables = {name for (name,) in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as err:
        raise ValueError(f"the run history {path} cannot be read ({err}); {RECOVER}") from err
    if not {"meta", "runs"} <= tables:
        raise ValueError(f"the run history {path} has lost its tables (it holds "
                         f"{', '.join(sorted(tables)) or 'none'}); {RECOVER}")


def _traces(directory: Path) -> str:
    """What in `directory` shows that a history was kept there ("" if nothing does)."""
    found = []
    runs = directory / "runs"
    if runs.is_dir():
        count = sum(1 for entry in runs.iterdir() if entry.is_dir())
        if count:
            found.append(f"{count} run dir{'s' if count > 1 else ''} under runs/")
    found += [f"{HISTORY_NAME}{side}" for side in ("-wal", "-shm")
              if (directory / f"{HISTORY_NAME}{side}").exists()]
    return " and ".join(found)


def check_active_run(history: RunHistory, directory: str | Path) -> None:
    """Refuse (ValueError saying how to recover) to resume an active run whose state file
    is missing or empty: a new run's state is stored before the history calls it running
    (run_queue.py), so it had one, and starting it afresh would forget its workers and
    hand their ids out again. Checked before anything is written (a refusal leaves the
    dir as it was); run_queue.py refuses a state file whose tables are empty."""
    running = history.running()
    if running is None:
        return
    path = Path(directory) / "runs" / running.run_id / RUN_STATE_NAME
    what = "is missing" if not path.exists() else (
        "is empty (0 bytes)" if path.stat().st_size == 0 else "")
    if what:
        raise StateLost(f"the active run {running.run_id} has lost its state: {path} "
                         f"{what}; {RECOVER}")
