"""What one GetRunStatus costs the coordinator, against the number of workers.

The dashboard asks for the run status every 0.5 s and `ripples run` every 0.25 s; the
reply is built on the coordinator's event loop, the same loop that answers group
requests, so its cost is taken from the hot path. This builds a coordinator core with N
registered, training workers (no sockets: the very code the gRPC handler runs) after a
simulated run of `--run-seconds` of progress reports, then times building the reply and
serialising it, and measures its size.

    python -m ripples.bench.status                            # 64 and 1,000 workers
    python -m ripples.bench.status --workers 64,1000,4000 --protocols allreduce

Prints, per protocol and number of workers, the median milliseconds to build the reply
(`run_status()`) and to serialise it, and the serialised size in kB; then the dashboard's
side: after `--polls` polls of a run in which every worker makes an iteration between
two polls, the size of the snapshot the dashboard sends to each open page at every poll
(JSON) and the median milliseconds of folding one status into it (`RunView.update`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, Progress
from ripples.coordinator.service import CoordinatorService
from ripples.dashboard.view import RunView

WORKERS_PER_NODE = 8
POLL_SECONDS = 0.5
"""The dashboard's poll interval (DashboardConfig.poll_interval_seconds)."""
REPORT_SECONDS = 0.1
"""Simulated time between two progress reports (each from the next worker in turn)."""


@dataclass(kw_only=True)
class StatusCost:
    protocol: str
    workers: int
    build_ms: float
    serialise_ms: float
    kilobytes: float
    snapshot_kilobytes: float = 0.0
    view_ms: float = 0.0


def training_service(protocol: str, num_workers: int, run_seconds: float) -> CoordinatorService:
    """A service over a core whose `num_workers` workers have trained for `run_seconds`
    (progress reported in turn, every REPORT_SECONDS); a group protocol also has a group
    executing for every group-size workers and its recent groups released."""
    settings = RunSettings.build(protocol=protocol, num_workers=num_workers,
                                 workers_per_node=WORKERS_PER_NODE, iterations=10**9,
                                 lease_seconds=7 * 24 * 3600.0, heartbeat_interval_seconds=1.0)
    core = CoordinatorCore(settings, now=0.0)
    ids = [core.register(f"node{i // WORKERS_PER_NODE}", i % WORKERS_PER_NODE, "cpu", i, 0.0)
           for i in range(num_workers)]
    for wid in ids:
        core.mark_ready(wid, 10**9, 0.0)
    steps = int(run_seconds / REPORT_SECONDS)
    for step in range(max(steps, num_workers)):
        now = step * REPORT_SECONDS
        wid = ids[step % num_workers]
        iteration = step // num_workers + 1
        core.heartbeat(wid, Progress(iteration=iteration, loss=2.0 / iteration,
                                     samples=32 * iteration, compute_seconds=now), now)
    if core.role.forms_groups:
        now = steps * REPORT_SECONDS
        for wid in ids:
            core.request_group(wid, core.workers[wid].progress.iteration + 1, now)
        for group in core.table.unfinished()[: len(ids) // 4]:  # some finished, some not
            for member in group.members:
                core.release(member, group.group_id, True, "", now)
    return CoordinatorService(core, store_host="127.0.0.1", store_port=0,
                              clock=lambda: run_seconds)


def measure(protocol: str, num_workers: int, run_seconds: float,
            repeats: int = 20, polls: int = 0) -> StatusCost:
    service = training_service(protocol, num_workers, run_seconds)
    build, serialise = [], []
    size = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        status = service.run_status()
        t1 = time.perf_counter()
        size = len(status.SerializeToString())
        t2 = time.perf_counter()
        build.append(t1 - t0)
        serialise.append(t2 - t1)
    snapshot_kb, view_ms = dashboard_snapshot(service, run_seconds, polls)
    return StatusCost(protocol=protocol, workers=num_workers,
                      build_ms=statistics.median(build) * 1e3,
                      serialise_ms=statistics.median(serialise) * 1e3, kilobytes=size / 1e3,
                      snapshot_kilobytes=snapshot_kb, view_ms=view_ms)


def dashboard_snapshot(service: CoordinatorService, run_seconds: float,
                       polls: int) -> tuple[float, float]:
    """The dashboard's snapshot (kB of JSON) after `polls` polls, every worker one
    iteration further at each, and the median ms of one `RunView.update`."""
    core = service.core
    view = RunView()
    snapshot: dict[str, object] = {}
    times = []
    for poll in range(polls):
        now = run_seconds + poll * POLL_SECONDS
        for w in core.live():
            iteration = w.progress.iteration + 1
            core.heartbeat(w.worker_id, Progress(iteration=iteration, loss=2.0 / iteration,
                                                 samples=32 * iteration, compute_seconds=now),
                           now)
        status = service.run_status()
        t0 = time.perf_counter()
        snapshot = view.update(status, now)
        times.append(time.perf_counter() - t0)
    return (len(json.dumps(snapshot, separators=(",", ":"))) / 1e3,
            statistics.median(times) * 1e3 if times else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.status",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="64,1000",
                        help="comma-separated numbers of workers (default 64,1000)")
    parser.add_argument("--protocols", default="allreduce,ripples-smart",
                        help="comma-separated protocols (default allreduce,ripples-smart: "
                             "lock-step and group generator)")
    parser.add_argument("--run-seconds", type=float, default=3600.0,
                        help="simulated training time before the status is taken (default "
                             "3600: the loss curve of an hour's run)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls (median)")
    parser.add_argument("--polls", type=int, default=600,
                        help="dashboard polls before its snapshot is measured (default 600: "
                             "5 minutes at the dashboard's 0.5 s; 0: skip the dashboard)")
    args = parser.parse_args(argv)
    try:
        levels = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if (any(w < 2 for w in levels) or args.run_seconds < 0 or args.repeats < 1
            or args.polls < 0):
        parser.error("need >= 2 workers per level, --run-seconds >= 0, --repeats >= 1 and "
                     "--polls >= 0")
    print(f"{'protocol':<14} {'workers':>7} {'build':>10} {'serialise':>10} {'size':>10} "
          f"{'dashboard':>10} {'view':>10}")
    for protocol in args.protocols.split(","):
        for level in levels:
            c = measure(protocol, level, args.run_seconds, args.repeats, args.polls)
            print(f"{c.protocol:<14} {c.workers:>7} {c.build_ms:>8.2f}ms "
                  f"{c.serialise_ms:>8.2f}ms {c.kilobytes:>8.1f}kB "
                  f"{c.snapshot_kilobytes:>8.1f}kB {c.view_ms:>8.2f}ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
