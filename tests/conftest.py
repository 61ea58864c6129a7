"""Fixtures and hooks shared by all test tiers: no test may leak a child process, and the
long tests run first."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked `slow` first, each group in its collected order. Run in parallel
    (`make test`: pytest-xdist), the processes then end on short tests together instead
    of one waiting for another's last minute-long run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _children() -> set[int]:
    """Child processes of the test process, less multiprocessing's session-long helpers."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            pids = {int(p) for p in f.read().split()}
    except OSError:
        return set()
    return {p for p in pids if not _is_session_helper(p)}


def _is_session_helper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"resource_tracker" in cmdline or b"forkserver" in cmdline


DYING_GRACE_SECONDS = 10.0
"""How long a child that is dying when the test returns (SIGKILLed by the test but not
reaped: the kernel may take a while to tear it down on a loaded machine) may take to
finish. A child still running and not dying was leaked: it fails the test at once."""

PF_EXITING = 0x4
"""The kernel's flag (in /proc/PID/stat) of a task inside exit."""


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Kill child processes a test left behind, then fail the test that leaked them."""
    before = _children()
    yield
    for proc in mp.active_children():
        proc.join(timeout=5)
    leaked = _children() - before
    alive = _running(leaked)
    still = {p for p in alive if not _dying(p)}
    dying = alive - still
    deadline = time.monotonic() + DYING_GRACE_SECONDS
    while dying and time.monotonic() < deadline:
        time.sleep(0.05)
        dying = _running(dying)
    still |= dying  # it did not finish dying within the grace
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in leaked:
        try:
            os.waitpid(pid, 0 if pid in still else os.WNOHANG)
        except ChildProcessError:
            pass
    assert not still, f"test leaked child processes {sorted(still)}"


def _running(pids: set[int]) -> set[int]:
    """Those of `pids` that are neither gone nor zombies (exited, not yet reaped)."""
    return {p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"}


def _dying(pid: int) -> bool:
    """Whether `pid` is on its way out: inside exit, or with a SIGKILL pending."""
    try:
        flags = int(_stat(pid)[6])
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f
                       if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, IndexError, ValueError):
        return True  # gone meanwhile
    return bool(flags & PF_EXITING) or any(p & (1 << (signal.SIGKILL - 1)) for p in pending)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first); OSError when
    the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _state(pid: int) -> str:
    try:
        return _stat(pid)[0]
    except OSError:
        return "Z"
