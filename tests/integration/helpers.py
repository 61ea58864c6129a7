"""Helpers for integration tests: a real coordinator on port 0, real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
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
