"""Helpers for integration tests: a real coordinator on port 0, real worker processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.server import CoordinatorServer, ServerConfig

REPO = Path(__file__).resolve().parents[2]
UNBOUNDED_ITERATIONS = 10**9
"""A budget out of reach, for a run that a test stops once it has seen what it checks: a
budget used as a clock runs out early on a loaded machine, or long after the check on an
idle one."""


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


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (any of its threads may start one): its own children
    only, so a test never looks at another test's processes."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def wait_for(condition: Callable[[], object], what: str, timeout: float = 90.0) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def start_three_then_a_fourth(address: str, core: CoordinatorCore,
                              workers: list[subprocess.Popen[str]], *, trained: int) -> None:
    """Start three workers (hosts node0-2) of a run whose max_workers is 4; once it has
    trained `trained` mean iterations, a fourth (node3), which joins the running run.
    Each process is appended to `workers` as soon as it starts (the caller kills them)."""
    for r in range(3):
        workers.append(start_worker(address, "--host", f"node{r}", "--metrics-port", "-1"))
    wait_for(lambda: core.started_at is not None and core.mean_iterations() > trained,
             "the run to train")
    workers.append(start_worker(address, "--host", "node3", "--metrics-port", "-1"))


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


def doc_block(path: str, heading: str) -> str:
    """The first ```bash block after `heading` in the document at `path` (from the repo)."""
    text = (REPO / path).read_text()
    found = re.search(r"```bash\n(.*?)```", text[text.index(heading):], re.S)
    assert found is not None, f"{path} lost its bash block under {heading!r}"
    return found.group(1)


def run_block(block: str, cwd: Path, timeout: float) -> tuple[int, str]:
    """Run a documented bash block as written, with the venv's `ripples` first on PATH;
    (exit code, output). If a line fails, its background processes end with it; a block
    still running after `timeout` s is killed, and the test fails saying so."""
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env.pop("RIPPLES_COORDINATOR", None)
    script = ("set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n"
              + block)
    process = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"the block did not end in {timeout:.0f} s:\n{output[-4000:]}"
                             ) from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output
