"""Repeated log records summed up instead of written one by one.

A fault that repeats in a tight loop (an accept loop out of file descriptors: asyncio,
uvicorn and gRPC each log every failed accept, with its traceback) would otherwise fill
the disk with the same lines, megabytes a second, and bury everything else. Every
command's logging (ripples/cli/arguments.py: setup_logging) passes through one
RepeatFilter: the first record of a kind is written, the same kind again within
`window_seconds` is only counted, and the first one after the window is written with
the count of those left out ("... repeated 4,210 times in the last 10 s").

Records are of one kind when they come from the same logger at the same level and say
the same: the same text, or, for a record with a traceback, the same message template
(before its arguments are filled in: a file descriptor number or an address does not
make a new kind) and the same exception type. So ordinary lines that differ ("registered
worker 3", "registered worker 4") are all written; only identical lines and tracebacks
of one kind are folded. A count that no later record of its kind carries (the flood
stopped) is written on its own once its window is over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_SECONDS = 10.0
MAX_KINDS = 1000
"""Kinds remembered at most (the oldest are forgotten first): a flood of distinct
messages cannot grow the filter without bound."""


@dataclass
class _Window:
    started: float
    left_out: int = 0


class RepeatFilter(logging.Filter):
    """Lets one record of a kind through per `window_seconds`, counting the rest; the
    handler it filters for (`install` sets it) writes a count that no later record of
    its kind carried, once the window is over."""

    def __init__(self, window_seconds: float = WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_seconds = window_seconds
        self.handler: logging.Handler | None = None
        """Where a lone count is written (None: counts only ride on later records)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int, str, str], _Window] = {}
        self._timer: threading.Timer | None = None

    @staticmethod
    def _kind(record: logging.LogRecord) -> tuple[str, int, str, str]:
        exc_type = record.exc_info[0] if record.exc_info else None
        if exc_type is not None:  # a traceback: its template and exception make the kind
            return (record.name, record.levelno, str(record.msg), exc_type.__name__)
        return (record.name, record.levelno, record.getMessage(), "")

    def filter(self, record: logging.LogRecord) -> bool:
        kind = self._kind(record)
        now = self._clock()
        with self._lock:
            window = self._windows.get(kind)
            if window is not None and now - window.started < self.window_seconds:
                window.left_out += 1
                self._flush_later()
                return False
            self._windows.pop(kind, None)
            self._windows[kind] = _Window(now)  # the newest last
            while len(self._windows) > MAX_KINDS:
                del self._windows[next(iter(self._windows))]
        if window is not None and window.left_out:
            record.msg = (f"{record.getMessage()} (repeated {window.left_out:,} times in "
                          f"the last {now - window.started:.0f} s)")
            record.args = None
        return True

    def _flush_later(self) -> None:
        """Write the counts left out once their windows end (under the lock)."""
        if self.handler is None or self._timer is not None:
            return
        self._timer = threading.Timer(self.window_seconds, self.flush)
        self._timer.daemon = True
        self._timer.start()

    def flush(self) -> None:
        """Write, as a record of its own, each count whose window is over and that no
        record of its kind carried."""
        now = self._clock()
        with self._lock:
            self._timer = None
            done = [(kind, w) for kind, w in self._windows.items()
                    if w.left_out and now - w.started >= self.window_seconds]
            for kind, _ in done:
                del self._windows[kind]
            if any(w.left_out for w in self._windows.values()):
                self._flush_later()
        for (name, level, text, exc_name), window in done:
            what = f"{text} ({exc_name})" if exc_name else text
            summary = logging.LogRecord(
                name, level, __file__, 0, "%s: repeated %s more times in the last %.0f s",
                (what, f"{window.left_out:,}", now - window.started), None)
            if self.handler is not None:
                self.handler.handle(summary)


def install(handlers: list[logging.Handler] | None = None) -> None:
    """One RepeatFilter on each of `handlers` (default: the root logger's) that has none."""
    for handler in handlers if handlers is not None else logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            repeats = RepeatFilter()
            repeats.handler = handler
            handler.addFilter(repeats)
