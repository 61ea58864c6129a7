"""A lock-step peer that is alive but busy is waited for; a dead one is found by its lease;
a collective that really times out says which one, whom it waited for and how to raise
the timeout. Real worker processes (the probe script, gloo) and a real coordinator."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import REPO, ripples_cli, running_coordinator, wait_for

from ripples.coordinator.server import CoordinatorServer
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient

pytestmark = pytest.mark.slow

PROBE = str(REPO / "tests" / "integration" / "scripts" / "probe_train.py")
LEASE = {"lease_seconds": 2.0, "heartbeat_interval_seconds": 0.5}


@contextmanager
def _probes(server: CoordinatorServer, *args: str, num_workers: int = 2
            ) -> Iterator[list[subprocess.Popen[str]]]:
    """The probe script as `num_workers` workers of the coordinator's run, killed if still
    running at the end."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RIPPLES_", "SLURM_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    procs = [subprocess.Popen(
        [sys.executable, PROBE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=REPO,
        env={**env, "RIPPLES_COORDINATOR": server.address, "RIPPLES_HOST": "node0",
             "LOCAL_RANK": str(i), "RIPPLES_METRICS_PORT": "-1", "RIPPLES_NUM_THREADS": "1"})
        for i in range(num_workers)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _outputs(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    return [p.communicate(timeout=timeout)[0] for p in procs]


def test_a_busy_peer_is_waited_for_while_its_heartbeats_keep_it_alive() -> None:
    """Rank 0 pauses 8 s between two steps (a rank-0-only evaluation) while rank 1 waits
    in the gradient all-reduce: four leases of 2 s pass, and under the lock-step default
    collective timeout (torch's 30 minutes) nothing fails: the heartbeats say rank 0 is
    alive. (test_a_collective_that_times_out_... is the same pause under a 3 s timeout.)"""
    with running_coordinator(num_workers=2, workers_per_node=2, protocol="allreduce",
                             **LEASE) as server, \
            _probes(server, "--steps", "8", "--pause-rank", "0", "--pause-at", "3",
                    "--pause-seconds", "8") as procs:
        outs = _outputs(procs, timeout=180)
        assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
        client = CoordinatorClient(server.address)
        try:
            status = client.run_status()
        finally:
            client.close()
    assert status.config.collective_timeout_seconds == 1800
    assert status.num_lease_expirations == 0
    assert [(w.state, w.iteration, w.error) for w in status.workers] == [
        (pb.WORKER_STATE_LEFT, 8, "")] * 2
    assert not any("timed out" in o for o in outs)


def test_a_collective_that_times_out_names_itself_the_busy_peer_and_the_option(
        tmp_path: Path) -> None:
    """The same pause under `--collective-timeout-seconds 3`: the run fails, and the
    worker's error (and `ripples run`'s) names the gradient all-reduce and its step, the
    busy peer, and the option to raise; no coordinator refusal hides it."""
    proc = ripples_cli("run", "--workers", "2", "--protocol", "allreduce",
                       "--collective-timeout-seconds", "3", "--output", str(tmp_path),
                       "--", "python", PROBE, "--steps", "20", "--pause-rank", "0",
                       "--pause-at", "3", "--pause-seconds", "8")
    assert proc.returncode != 0
    failed = [line for line in proc.stderr.splitlines() if line.startswith("ripples run:")]
    assert failed, proc.stderr[-3000:]
    line = failed[-1]
    assert "the gradient all-reduce of step 4 timed out after 3 s" in line, line
    # Worker ids go by registration, ranks by host and local rank.
    assert re.search(r"worker \d \(rank 0, host node0\), done with step 3: alive "
                     r"\(heartbeating\)", line), line
    assert "--collective-timeout-seconds" in line and "collective_timeout_seconds" in line
    assert "FAILED_PRECONDITION" not in proc.stderr
    assert "Got the following error" not in line


def test_a_frozen_peer_is_found_by_its_lease_and_its_waiting_peer_ends() -> None:
    """A peer whose process freezes (SIGSTOP: its sockets stay open, so gloo sees no
    error) stops heartbeating: the coordinator expires it after its 2 s lease and, with no
    checkpoint to restart from, stops the run; the worker waiting for it in the gradient
    all-reduce ends within seconds, saying why, instead of waiting 30 minutes."""
    with running_coordinator(num_workers=2, workers_per_node=2, protocol="allreduce",
                             **LEASE) as server, \
            _probes(server, "--steps", "100000") as procs:
        client = CoordinatorClient(server.address)
        try:
            wait_for(lambda: min((w.iteration for w in client.run_status().workers),
                                 default=0) >= 3, "the workers to train", timeout=120)
            procs[0].send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            out = _outputs(procs[1:], timeout=90)[0]
            ended_after = time.monotonic() - frozen_at
            status = client.run_status()
        finally:
            client.close()
            procs[0].kill()  # a stopped process takes SIGKILL
    assert procs[1].returncode == 1, out[-3000:]
    assert ended_after < 60, ended_after
    assert "lease expired" in status.stop_reason
    waiting = next(w for w in status.workers if w.state == pb.WORKER_STATE_FAILED)
    assert "while this worker waited" in waiting.error, waiting.error
    assert "in the gradient all-reduce of step" in waiting.error
    assert "lease expired" in waiting.error
