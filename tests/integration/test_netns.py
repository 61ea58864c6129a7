"""A worker whose link is cut and restored: three simulated hosts (network
namespaces on a bridge in a hub namespace, ripples/netshape.py), a real coordinator process
serving the hub's address (`ripples coordinator serve --netns`, the test talking to it on
its loopback port) and a real `ripples worker run` process inside each host's namespace,
gloo bound to the namespace's veth. Host 1's cable is pulled (its veth set down) and plugged
back in:

- for less than the lease: a third of it, TCP retransmits and nothing fails; 7 s of a
  15 s lease, past gRPC's keepalive timeout, the worker logs that the coordinator is
  unreachable, trains on alone and reconnects. Either way the cut one never expires and
  trains on, and every worker ends cleanly when the run is stopped;
- for longer than the lease (and shorter than the outage window): the coordinator expires
  it and cancels its groups, the two others go on, and when the link is back the cut
  worker hears it is no longer part of the run (NOT_FOUND) and exits non-zero naming
  that, without hanging; a replacement started on a fresh host takes its rank, heals and
  trains on with the survivors until the run is stopped.

The runs' budgets are beyond reach: a run ends when the test has seen what it waits for
(`ripples stop`'s call), never by a budget a loaded machine might spend before the cut.

Skipped where namespaces cannot be made (not root, no `ip`, no veth/bridge support).
Timings are printed (`pytest -s`), never asserted tightly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ripples.netshape import NetworkUnavailable, ShapedCluster
from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import REPO, UNBOUNDED_ITERATIONS

pytestmark = pytest.mark.slow

LEASE_SECONDS = 4.0
HEARTBEAT_SECONDS = 0.5
COLLECTIVE_TIMEOUT_SECONDS = 10.0
"""A peer inside a P-Reduce with the cut worker waits this long (gloo sees no reset on a
pulled cable, only silence), then fails the group and trains on."""
OUTAGE_SECONDS = 60.0
"""The run's --coordinator-outage-seconds (the default): a worker rides over this long
without its coordinator; every cut here is shorter."""
START_TIMEOUT = 120.0
"""Imports of four torch processes on a loaded two-core machine."""
EXIT_DEADLINE = 120.0
CUT_HOST = 1


def _worker(status: pb.RunStatus, host: str) -> pb.WorkerStatus:
    """The worker of `host` (an empty record before it registered)."""
    return next((w for w in status.workers if w.host == host), pb.WorkerStatus())


class NetRun:
    """One run on the cluster: the coordinator serving the hub's address, workers in host
    namespaces; every process's output goes to a log file in `logs`."""

    def __init__(self, cluster: ShapedCluster, logs: Path) -> None:
        self.cluster = cluster
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.reaped: set[str] = set()  # exits the test waited for
        self.address = ""
        self.client: CoordinatorClient | None = None

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def start_coordinator(self, iterations: int, lease_seconds: float) -> None:
        host = self.cluster.coordinator_address
        proc = self._start("coordinator", [
            sys.executable, "-m", "ripples.cli", "coordinator", "serve", "--host", host,
            "--port", "0", "--metrics-port", "0", "--netns", self.cluster.hub,
            "--workers", "3", "--min-workers", "2", "--protocol", "ripples-smart",
            "--task", "digits", "--seed", "1", "--iterations", str(iterations),
            "--lease-seconds", str(lease_seconds),
            "--heartbeat-interval-seconds", str(HEARTBEAT_SECONDS),
            "--collective-timeout-seconds", str(COLLECTIVE_TIMEOUT_SECONDS),
            "--coordinator-outage-seconds", str(OUTAGE_SECONDS), "--exit-when-done"])
        deadline = time.monotonic() + START_TIMEOUT
        listening = r"listening on [\d.]+:(\d+) in network namespace \S+, and on ([\d.:]+) here"
        while not (found := re.search(listening, self.log("coordinator"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the coordinator did not start:\n"
                                     f"{self.log('coordinator')[-3000:]}")
            time.sleep(0.1)
        self.address = f"{host}:{found.group(1)}"  # the workers'
        self.client = CoordinatorClient(found.group(2), rpc_timeout_seconds=5.0)

    def start_worker(self, i: int, name: str) -> None:
        host = self.cluster.hosts[i]
        self._start(name, self.cluster.argv(
            i, sys.executable, "-m", "ripples.cli", "worker", "run",
            "--coordinator", self.address, "--host", name, "--metrics-port", "-1",
            "--save-model", str(self.logs / f"{name}.pt"),
            "--save-record", str(self.logs / f"{name}.json")),
            env={"GLOO_SOCKET_IFNAME": host.ifname})

    def stop(self, reason: str) -> None:
        """Stop the run, as `ripples stop` does: every worker ends its loop and exits."""
        assert self.client is not None
        self.client.stop_run(reason)

    def status(self) -> pb.RunStatus | None:
        assert self.client is not None
        try:
            return self.client.run_status()
        except CoordinatorCallError:
            return None

    def wait_for(self, condition: Callable[[pb.RunStatus], bool], what: str,
                 timeout: float) -> pb.RunStatus:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status is not None and condition(status):
                return status
            dead = [n for n, p in self.procs.items()
                    if n not in self.reaped and p.poll() is not None]
            if time.monotonic() > deadline or dead:
                why = f"{', '.join(dead)} exited" if dead else f"{timeout:.0f} s passed"
                raise AssertionError(f"{why} while waiting for {what}\n{self.tails()}")
            time.sleep(0.1)

    def wait_exit(self, names: list[str], timeout: float) -> dict[str, int]:
        """Exit codes of `names`, which must all exit within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(max(0.1, deadline - time.monotonic()))
                self.reaped.add(name)  # an exit the test waited for, not a crash
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not exit within {timeout:.0f} s (a hang)\n"
                                     f"{self.tails()}") from None
        return codes

    def record(self, name: str) -> dict[str, object]:
        value = json.loads((self.logs / f"{name}.json").read_text())
        assert isinstance(value, dict)
        return value

    def tails(self) -> str:
        return "\n".join(f"--- {name} (rc {p.poll()}):\n{self.log(name)[-2500:]}"
                         for name, p in self.procs.items())

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(10)
        if self.client is not None:
            self.client.close()


@pytest.fixture
def cluster() -> Iterator[ShapedCluster]:
    try:
        net = ShapedCluster(3)
    except NetworkUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err}")
    try:
        yield net
    finally:
        problems = net.destroy()
        assert not problems, f"could not clean up: {problems}"


@pytest.fixture
def run(cluster: ShapedCluster, tmp_path: Path) -> Iterator[NetRun]:
    """A run on the cluster; its processes are killed (before the cluster is deleted)
    whatever the test's outcome."""
    net_run = NetRun(cluster, tmp_path)
    try:
        yield net_run
    finally:
        net_run.kill_all()


def _start_training(run: NetRun, iterations: int, lease_seconds: float = LEASE_SECONDS
                    ) -> int:
    """Coordinator and three workers (host0..host2); returns the cut host's worker id
    once every worker trains."""
    run.start_coordinator(iterations, lease_seconds)
    for i in range(3):
        run.start_worker(i, f"host{i}")
    status = run.wait_for(
        lambda s: s.started and len(s.workers) == 3 and min(w.iteration for w in s.workers) > 100,
        "the run to train", START_TIMEOUT)
    return _worker(status, f"host{CUT_HOST}").worker_id


# A third of the lease: TCP retransmits once the link is back, no call fails. 7 s of a
# 15 s lease: longer than gRPC's keepalive timeout (5 s, ripples/rpc.py, which gRPC also
# sets as the connection's TCP_USER_TIMEOUT), so the worker's calls fail "unreachable"
# and it reconnects when the link is back, as after a coordinator restart.
@pytest.mark.parametrize(("lease_seconds", "cut_for"), [(LEASE_SECONDS, LEASE_SECONDS / 3),
                                                        (15.0, 7.0)],
                         ids=["a-third-of-the-lease", "past-the-grpc-keepalive"])
def test_a_link_cut_shorter_than_the_lease_is_ridden_over(
        run: NetRun, cluster: ShapedCluster, lease_seconds: float, cut_for: float) -> None:
    cut_id = _start_training(run, iterations=UNBOUNDED_ITERATIONS, lease_seconds=lease_seconds)
    before = run.status()
    assert before is not None and not before.stopped
    cut_iteration = next(w.iteration for w in before.workers if w.worker_id == cut_id)
    cut_at = time.monotonic()
    cluster.cut(CUT_HOST)
    time.sleep(cut_for)
    cluster.restore(CUT_HOST)
    cut_seconds = time.monotonic() - cut_at
    after = run.wait_for(lambda s: s.stopped or next(
        w.iteration for w in s.workers if w.worker_id == cut_id) > cut_iteration + 20,
        "the cut worker to train on", 60)
    recovered = time.monotonic() - cut_at
    states = {w.host: pb.WorkerState.Name(w.state) for w in after.workers}
    assert after.num_lease_expirations == 0, states
    run.stop("the cut worker trained on")
    names = [f"host{i}" for i in range(3)]
    codes = run.wait_exit(names, EXIT_DEADLINE)
    assert codes == dict.fromkeys(names, 0), run.tails()
    assert run.wait_exit(["coordinator"], 30) == {"coordinator": 0}, run.tails()
    for name in names:
        record = run.record(name)
        assert "the cut worker trained on" in str(record["stop_reason"]), record
    cut_record = run.record(f"host{CUT_HOST}")
    assert isinstance(cut_record["iterations"], int)
    assert cut_record["iterations"] > cut_iteration + 20
    log = run.log(f"host{CUT_HOST}")
    notes = [line for line in log.splitlines()
             if "unreachable" in line or "heartbeat failed" in line or "failed" in line]
    if cut_for > 5.0:  # past the keepalive timeout: it noticed, and went on
        assert any("unreachable" in line for line in notes), log[-3000:]
    print(f"\nlink cut for {cut_seconds:.1f} s (lease {lease_seconds:.0f} s) at iteration "
          f"{cut_iteration}; the cut worker trained on {recovered:.1f} s after the cut and "
          f"ended at {cut_record['iterations']} iterations; its log says:\n  "
          + ("\n  ".join(notes) or "(nothing about the cut)"))


# With a replacement on a fresh host: the same cut without one only skips the join (a run
# that shrinks and finishes is test_elastic's and the chaos trials').
def test_a_link_cut_longer_than_the_lease_expires_the_worker_which_then_exits(
        run: NetRun, cluster: ShapedCluster) -> None:
    cut_name = f"host{CUT_HOST}"
    survivors = [f"host{i}" for i in range(3) if i != CUT_HOST]
    cut_id = _start_training(run, iterations=UNBOUNDED_ITERATIONS)
    cut_at = time.monotonic()
    cluster.cut(CUT_HOST)
    expired = run.wait_for(
        lambda s: _worker(s, cut_name).state == pb.WORKER_STATE_EXPIRED,
        "the coordinator to expire the cut worker", 30)
    expired_after = time.monotonic() - cut_at
    # Its groups were cancelled: none still pending or executing holds it.
    assert not [g for g in expired.active_groups if cut_id in g.members], expired
    at_expiry = {w.host: w.iteration for w in expired.workers}
    host = cluster.add_host()  # a fresh machine for its replacement
    run.start_worker(host.index, "host1b")
    # The survivors go on without it (a P-Reduce the cut froze fails after the collective
    # timeout). The link stays cut at least this long; the worker's outage window, 60 s,
    # is far longer, so it waits for its coordinator instead of giving up on its own.
    progressed = run.wait_for(lambda s: all(
        _worker(s, h).iteration > at_expiry[h] + 50 for h in survivors),
        "the survivors to train on", 60)
    survivors_on = time.monotonic() - cut_at
    assert not progressed.stopped, progressed.stop_reason
    cluster.restore(CUT_HOST)
    restored_at = time.monotonic()
    cut_seconds = restored_at - cut_at
    code = run.wait_exit([cut_name], 60)[cut_name]
    exited_after = time.monotonic() - restored_at
    log = run.log(cut_name)
    assert code != 0, log[-3000:]
    failure = [line for line in log.splitlines() if "failed:" in line and "worker" in line]
    assert any("NOT_FOUND" in line and "no longer part of the run" in line
               for line in failure), log[-3000:]
    # The replacement took the cut worker's rank, healed from a survivor and trains.
    rank = _worker(expired, cut_name).rank
    # It reports the iteration it joined at before its first averaging, so its status
    # alone cannot tell that it healed; its log says so once a survivor's model landed.
    run.wait_for(lambda s: _worker(s, "host1b").iteration > 0,
                 "the replacement to register", START_TIMEOUT)
    run.wait_for(lambda _: "healed from worker" in run.log("host1b"),
                 "the replacement to heal from a survivor", START_TIMEOUT)
    run.stop("the replacement trains with the survivors")
    finishers = [*survivors, "host1b"]
    codes = run.wait_exit(finishers, EXIT_DEADLINE)
    assert codes == dict.fromkeys(finishers, 0), run.tails()
    assert run.wait_exit(["coordinator"], 30) == {"coordinator": 0}, run.tails()
    for name in finishers:
        record = run.record(name)
        assert "the replacement trains with the survivors" in str(record["stop_reason"]), record
    joined = run.log("host1b")
    assert f"replaces rank {rank} of the running run" in joined, joined[-3000:]
    assert "healed from worker" in joined, joined[-3000:]
    print(f"\nlink cut for {cut_seconds:.1f} s (lease {LEASE_SECONDS:.0f} s): expired "
          f"{expired_after:.1f} s after the cut, the survivors trained on "
          f"{survivors_on:.1f} s after it; the cut worker exited (code {code}) "
          f"{exited_after:.1f} s after the link came back:\n  {failure[-1]}")
