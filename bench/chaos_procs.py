"""The processes of a chaos trial: each one's output log and its structured events.

A trial's coordinator and workers are real processes (`ripples coordinator serve`,
`ripples worker run`). Each writes its events (ripples/events.py: registered, healed,
restored, finished, ...) to a file of its own, NAME.events.jsonl, which the harness reads
to see what it did; its output goes, line by line with the time it arrived, to NAME.log
for humans (and the tail of a failure's message), and is never parsed.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from ripples import events


class Proc:
    """One process of a trial: started at once, its output read by a thread of its own.

    Attributes:
        name: Its name in the trial (coordinator, w0, r1, ...); a worker's --host.
        role: "coordinator", "worker" (one of the run's first) or "replacement".
        log_path: NAME.log: its output, each line stamped with the seconds since the
            trial started.
        events_path: NAME.events.jsonl: its events (RIPPLES_EVENTS_FILE).
        model_path: Where a worker saves its final model (None: a coordinator).
        fault: The fault kind it received ("" if none).
        expected_exit: The exit code its fate calls for (None: any).
        started_at: Wall-clock time (Unix seconds, as events' "time") of its start.
    """

    def __init__(self, name: str, role: str, argv: list[str], log_path: Path,
                 t0_wall: float) -> None:
        """Start the process.

        Args:
            name: Its name in the trial.
            role: "coordinator", "worker" or "replacement".
            argv: Its command line.
            log_path: NAME.log; the events file goes next to it (NAME.events.jsonl).
            t0_wall: Wall-clock time of the trial's start (its log's time stamps).
        """
        self.name = name
        self.role = role
        self.log_path = log_path
        self.events_path = log_path.with_name(f"{name}.events.jsonl")
        self.model_path: Path | None = None
        self.fault = ""
        self.expected_exit: int | None = 0
        self._t0_wall = t0_wall
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._events_offset = 0
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               events.ENV_EVENTS_FILE: str(self.events_path)}
        env.pop("RIPPLES_COORDINATOR", None)
        self.events_path.unlink(missing_ok=True)  # a reused --workdir's: not this process's
        self.started_at = time.time()
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, env=env)
        self._reader = threading.Thread(target=self._read, name=f"chaos-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log_path, "w") as log:
            log.write(f"# {' '.join(self.popen.args)}\n")  # type: ignore[arg-type]
            for line in self.popen.stdout:
                now = time.time()
                with self._lock:
                    self._lines.append((now, line.rstrip("\n")))
                log.write(f"[{now - self._t0_wall:8.3f}] {line}")
                log.flush()

    def events(self, kind: str = "") -> list[dict[str, Any]]:
        """Its events so far (those written since the last call are read now).

        Args:
            kind: Only the events of this kind (ripples.events.KINDS); "": all.

        Returns:
            The events in the order it wrote them, each with its "event", "time" (Unix
            seconds) and "pid", and its fields.
        """
        with self._lock:
            new, self._events_offset = events.read(self.events_path, self._events_offset)
            self._events += new
            return [e for e in self._events if not kind or e["event"] == kind]

    def first_event(self, kind: str) -> dict[str, Any] | None:
        """Its first event of a kind (None if it wrote none yet)."""
        found = self.events(kind)
        return found[0] if found else None

    def first_line_at(self) -> float | None:
        """Wall-clock time its first output line arrived: a worker prints none before
        its imports are done (its first line is its registration, or its wait for a
        vacancy). None before that."""
        with self._lock:
            return self._lines[0][0] if self._lines else None

    def tail(self, lines: int = 15) -> str:
        """The last `lines` lines of its output."""
        with self._lock:
            return "\n".join(line for _, line in self._lines[-lines:])

    @property
    def alive(self) -> bool:
        """It has not exited yet."""
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """Its exit code (negative: the signal that ended it), None while it runs."""
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        """Send it a signal, if it still runs."""
        if self.alive:
            self.popen.send_signal(sig)

    def reap(self) -> None:
        """Kill it if it still runs; wait for it and for its output."""
        if self.alive:
            self.popen.kill()
        self.popen.wait()
        self._reader.join(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
