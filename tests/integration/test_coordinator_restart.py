"""The coordinator is SIGKILLed in the middle of a run and started again on the same
address and state dir: no worker exits, the run resumes where it was (its iteration
counts and loss curve go on, not restart) and ends cleanly when stopped. The run takes
local steps with the outer optimizer, and a worker trains on alone for no more than the
run's outage bound in steps (each unanswered ask stands for a round of H steps)."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ripples.coordinator.state_store import DB_NAME
from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import REPO, free_port, start_worker, wait_for

pytestmark = pytest.mark.slow

DEADLINE_SECONDS = 180
LOCAL_STEPS = 4
OUTAGE_LOCAL_STEPS = 2 * LOCAL_STEPS


def _serve(port: int, state_dir: str, *run: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ripples.cli", "coordinator", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--metrics-port", "0", "--state-dir", state_dir,
         "--exit-when-done", *run],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ})


def _status(client: CoordinatorClient) -> pb.RunStatus | None:
    try:
        return client.run_status()
    except CoordinatorCallError:
        return None


def _wait_for(client: CoordinatorClient, condition, what: str,  # type: ignore[no-untyped-def]
              timeout: float = 90.0) -> pb.RunStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = _status(client)
        if status is not None and condition(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _saved_curve(state_dir: str, run_id: str) -> list[list[float]]:
    """The loss curve the coordinator last saved to its state dir (read-only: it writes
    on meanwhile; WAL lets a reader in)."""
    db = Path(state_dir) / "runs" / run_id / DB_NAME
    if not db.exists():
        return []
    connection = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        row = connection.execute("SELECT value FROM run WHERE key = 'progress'").fetchone()
    except sqlite3.OperationalError:  # the schema is being made
        return []
    finally:
        connection.close()
    return [] if row is None else json.loads(row[0])["curve"]


def _mean_iterations(status: pb.RunStatus) -> float:
    return sum(w.iteration for w in status.workers) / max(1, len(status.workers))


def test_workers_ride_over_a_coordinator_restart_and_the_run_resumes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    address = f"127.0.0.1:{port}"
    state = str(tmp_path / "state")
    run = ("--workers", "3", "--protocol", "ripples-smart", "--task", "digits",
           "--iterations", "200000", "--lease-seconds", "3", "--seed", "2",
           "--local-steps", str(LOCAL_STEPS), "--outer-optimizer", "nesterov",
           "--outage-local-steps", str(OUTAGE_LOCAL_STEPS))
    coordinator = _serve(port, state, *run)
    workers: list[subprocess.Popen[str]] = []
    client = CoordinatorClient(address, rpc_timeout_seconds=2.0)
    try:
        client.wait_until_reachable(30)
        workers = [start_worker(address, "--host", f"node{r}", "--metrics-port", "-1")
                   for r in range(3)]
        before = _wait_for(client, lambda s: s.started and _mean_iterations(s) > 150
                           and len(s.loss_curve) > 0, "the run to train")
        # A save every 0.5 s, when the machine lets the saver run: the kill comes after
        # one that holds a part of the curve (else nothing of it is the restart's to keep).
        wait_for(lambda: _saved_curve(state, before.config.run_id),
                 "the state dir to hold a loss curve")
        saved = _saved_curve(state, before.config.run_id)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
        killed_at = time.monotonic()
        time.sleep(2.0)  # an outage: the workers train on without averaging
        coordinator = _serve(port, state)  # no run options: the state dir's run goes on
        restarted_at = time.monotonic()
        _wait_for(client, lambda s: True, "the restarted coordinator to answer")
        answered_at = time.monotonic()  # its start-up (imports, the state dir) is over
        after = _wait_for(client, lambda s: s.num_groups_formed > before.num_groups_formed
                          and _mean_iterations(s) > _mean_iterations(before), "groups again")
        resumed_in = time.monotonic() - restarted_at
        assert after.config.run_id == before.config.run_id
        # The counts go on from where they were, and the loss curve keeps its first part.
        assert after.elapsed_seconds >= before.elapsed_seconds
        # The curve keeps its part up to the last save before the kill (the save seen
        # above, or a later one), and goes on from the time the workers trained through
        # the outage.
        kept = [(p.seconds, p.loss) for p in after.loss_curve if p.seconds <= saved[-1][0]]
        assert kept == [(s, v) for s, v, _ in saved], (kept, saved)
        seen = [(p.seconds, p.loss) for p in before.loss_curve]
        assert kept[:len(seen)] == seen[:len(kept)]
        assert after.elapsed_seconds > before.elapsed_seconds + 2.0  # the outage counts
        assert {w.worker_id for w in after.workers} == {w.worker_id for w in before.workers}
        client.stop_run("the test saw the run resume")
        alone: list[tuple[int, int, int]] = []
        for p in workers:
            out, _ = p.communicate(timeout=DEADLINE_SECONDS)
            assert p.returncode == 0, out[-3000:]
            # It noticed the outage: its heartbeat saw the new incarnation, or (when the
            # stop reached it through its group stream first) the stream broke meanwhile.
            assert ("the coordinator restarted" in out
                    or "while the coordinator is unreachable" in out), out[-3000:]
            alone += [(int(n), int(a), int(b)) for n, a, b in re.findall(
                r"(\d+) steps without the coordinator \(steps (\d+) to (\d+)\)", out)]
        # The outage (2 s and the new coordinator's start-up) outlasted the bound, at
        # digits' milliseconds a step: a worker that reached it trained the bound's steps
        # alone (two rounds of H), not one round per unanswered ask (that was 8 rounds).
        assert alone, "no worker reached the outage bound"
        assert all(n == OUTAGE_LOCAL_STEPS and b - a == n for n, a, b in alone), alone
        out, _ = coordinator.communicate(timeout=30)
        assert coordinator.returncode == 0, out[-3000:]
        assert "resumed run" in out and "the test saw the run resume" in out, out[-3000:]
        print(f"groups formed again {resumed_in:.1f} s after the restart command, "
              f"{resumed_in - (answered_at - restarted_at):.1f} s after the new coordinator "
              f"first answered ({time.monotonic() - killed_at:.1f} s after the kill)")
    finally:
        client.close()
        for p in [*workers, coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait(30)
