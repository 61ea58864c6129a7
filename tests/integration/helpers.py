"""Helpers for integration tests: a real coordinator on port 0, real worker processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def running_coordinator(**settings: object) -> Iterator[CoordinatorServer]:
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0,
                                            run=RunSettings.build(**settings)))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def ripples_cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """Run the real `ripples` entry point in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ripples.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=REPO)


def start_worker(address: str, *extra: str, env: dict[str, str] | None = None
                 ) -> subprocess.Popen[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "ripples.cli", "worker", "run",
                             "--coordinator", address, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=REPO)


def free_port() -> int:
    """A TCP port free on loopback now (for a process that must be told its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], object], what: str, timeout: float = 90.0) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Each process's output once it exited; all are killed if one outlives `timeout`."""
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out or "")
    return outputs



@contextmanager
def explained_on_failure(procs: list[subprocess.Popen[str]], core: object, *,
                         label: str = "worker", tail: int = 3000) -> Iterator[None]:
    """Kill every process of `procs` (a list that may grow inside) still running at the
    end; on an AssertionError inside, kill them all and raise it again with the
    coordinator's stop reason and each process's last output."""
    try:
        yield
    except AssertionError as err:
        for p in procs:
            p.kill()
        said = "\n".join(f"--- {label} {i}:\n{p.communicate()[0][-tail:]}"
                         for i, p in enumerate(procs))
        reason = getattr(core, "stop_reason", "")
        raise AssertionError(f"{err}; core.stop_reason={reason!r}\n{said}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
