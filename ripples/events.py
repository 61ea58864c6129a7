"""Structured events: one JSON object per line, appended to the file that the environment
variable RIPPLES_EVENTS_FILE names, for tools that watch processes (the chaos harness,
bench/chaos_trial.py) instead of parsing their log text.

Shared plumbing on the ground floor: the standard library only. With the variable unset
or empty, `emit` does nothing. Each event is one line::

    {"event": "worker_healed", "time": 1718000000.123, "pid": 4242, "donor": 1, ...}

`time` is the wall clock (Unix seconds) when the process emitted it, `pid` the emitting
process's id; the other keys are the event's fields. Several processes may append to one
file: it is opened with O_APPEND and each line goes out in one write call, so lines stay
whole. `read` leaves a last line without its newline for later (a writer may still be at
it) and skips a line that is not JSON (one a writer killed mid-write could leave). A
failing write (a missing folder, a full disk, a read-only file) never breaks the emitting
process: it logs one warning and goes on.

The event kinds, their fields, and where they are emitted (each next to the log line that
tells a human the same, which stays):

- ``coordinator_listening`` (coordinator/server.py: the coordinator serves): ``address``
  (HOST:PORT for clients), ``metrics_address`` (HOST:PORT), ``run_id`` (the run it
  serves; "" when none yet).
- ``worker_registered`` (worker/session.py: the coordinator took the worker in):
  ``worker_id``, ``host``, ``run_id``, ``protocol``.
- ``worker_healed`` (worker/protocols/base.py: a replacement copied a live peer's model;
  its ``worker_registered`` event, of the same ``pid``, gives its worker id): ``donor``
  (the peer's worker id), ``seconds`` (the copy), ``asked_seconds`` (since it first asked
  for its heal group).
- ``checkpoint_restored`` (worker/checkpoint.py: a worker loaded a checkpoint; in a
  lock-step run's restart round, a replacement's "heal"): ``step``, ``path``.
- ``worker_finished`` (worker/daemon.py: `ripples worker run` trained to the end):
  ``worker_id``, ``reason`` (why its training ended, as the worker saw it).
- ``run_ended`` (coordinator/runs.py: a run ended and went into the history): ``run_id``,
  ``state`` ("finished": its budget or target; "failed"; "stopped": by an operator),
  ``reason`` (the stop reason, as text), ``iterations`` (the workers' iterations, as the
  iteration budget counts them: a replacement carries on its predecessor's count),
  ``max_worker_iterations`` (the most any one of those workers made: a lock-step run's
  per-worker count).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

ENV_EVENTS_FILE = "RIPPLES_EVENTS_FILE"
"""The environment variable naming the file events are appended to (unset: none)."""

COORDINATOR_LISTENING = "coordinator_listening"
WORKER_REGISTERED = "worker_registered"
WORKER_HEALED = "worker_healed"
CHECKPOINT_RESTORED = "checkpoint_restored"
WORKER_FINISHED = "worker_finished"
RUN_ENDED = "run_ended"
KINDS = (COORDINATOR_LISTENING, WORKER_REGISTERED, WORKER_HEALED, CHECKPOINT_RESTORED,
         WORKER_FINISHED, RUN_ENDED)
"""Every event kind (the module's docstring lists their fields)."""
RESERVED = ("event", "time", "pid")
"""Keys every event carries; a field of the same name is dropped."""

logger = logging.getLogger(__name__)
_warned = threading.Event()


def emit(event: str, /, **fields: Any) -> None:
    """Append one event to the events file, if RIPPLES_EVENTS_FILE names one.

    Never raises: a write that fails logs a warning (once per process) and is dropped.

    Args:
        event: The event's kind (one of KINDS).
        **fields: The event's fields; values JSON cannot hold are written as their str().
    """
    path = os.environ.get(ENV_EVENTS_FILE)
    if not path:
        return
    record: dict[str, Any] = {"event": event, "time": time.time(), "pid": os.getpid()}
    record.update((k, v) for k, v in fields.items() if k not in RESERVED)
    try:
        line = (json.dumps(record, default=str) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            written = os.write(fd, line)  # one call: whole among other appenders' lines
        finally:
            os.close(fd)
        if written != len(line):
            raise OSError(f"wrote {written} of {len(line)} bytes")
    except (OSError, TypeError, ValueError) as err:
        if not _warned.is_set():
            _warned.set()
            logger.warning("cannot write events to %s (%s): %s; this process drops its "
                           "events quietly from now on", path, ENV_EVENTS_FILE, err)


def read(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The whole event lines of a file from a byte offset on.

    Args:
        path: An events file (a missing one holds none yet).
        offset: Where to start: the offset an earlier call returned, to read what came
            since.

    Returns:
        (the events, in file order, each a dict with at least "event", "time" and "pid";
        the offset after the last whole line). A last line without its newline (still
        being written) is left for the next call; a line that is not a JSON object (one
        cut short by a killed writer) is skipped.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = []
    for raw in data[:end].splitlines():
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events, offset + end
