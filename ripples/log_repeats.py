"""Repeated log records summed up instead of written one by one.

A fault that repeats in a tight loop (an accept loop out of file descriptors: asyncio,
uvicorn and gRPC each log every failed accept, with its traceback) would otherwise fill
the disk with the same lines, megabytes a second, and bury everything else. Every
command's logging (ripples/cli/arguments.py: setup_logging) passes through one
RepeatFilter: the first record of a kind is written, the same kind again within
`window_seconds` is only counted, and the first one after the window is written with
the count of those left out ("... repeated 4,210 times in the last 10 s").

Records are of one kind when they come from the same logger at the same level with the
same message template (before its arguments are filled in: a file descriptor number or
an address does not make a new kind) and the same exception type.
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
    """Lets one record of a kind through per `window_seconds`, counting the rest."""

    def __init__(self, window_seconds: float = WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int, str, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc_type = record.exc_info[0] if record.exc_info else None
        kind = (record.name, record.levelno, str(record.msg),
                exc_type.__name__ if exc_type is not None else "")
        now = self._clock()
        with self._lock:
            window = self._windows.get(kind)
            if window is not None and now - window.started < self.window_seconds:
                window.left_out += 1
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


def install(handlers: list[logging.Handler] | None = None) -> None:
    """One RepeatFilter on each of `handlers` (default: the root logger's) that has none."""
    for handler in handlers if handlers is not None else logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter())
