"""Fixtures shared by all test tiers: no test may leak a child process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator

import pytest


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


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Kill child processes a test left behind, then fail the test that leaked them."""
    before = _children()
    yield
    for proc in mp.active_children():
        proc.join(timeout=5)
    leaked = _children() - before
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Zombies that already exited are reaped by the kill/wait above; anything still
    # listed was running after the test returned.
    still = {p for p in leaked if os.path.exists(f"/proc/{p}") and _state(p) != "Z"}
    for pid in leaked:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    assert not still, f"test leaked child processes {sorted(still)}"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
