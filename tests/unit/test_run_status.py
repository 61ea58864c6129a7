"""GetRunStatus stays O(workers): no n^2 edge list, no unbounded history (no sockets: the
reply the gRPC handler returns, built from a core driven with a fake clock)."""

from __future__ import annotations

import pytest

from ripples.bench import status as status_bench
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.progress import LOSS_CURVE_MAX_POINTS
from ripples.coordinator.service import CoordinatorService
from ripples.v1 import coordinator_pb2 as pb


def test_a_complete_graph_is_a_flag_and_the_curve_is_bounded() -> None:
    service = status_bench.training_service("allreduce", 40, run_seconds=600.0)
    status = service.run_status()
    assert status.topology_complete and status.edges_always_used
    assert len(status.topology_edges) == 0
    assert len(status.workers) == 40
    assert 0 < len(status.loss_curve) <= LOSS_CURVE_MAX_POINTS


def test_departed_workers_beyond_the_run_size_drop_out_of_the_status() -> None:
    core = CoordinatorCore(RunSettings.build(protocol="ripples-smart", num_workers=3,
                                             iterations=10**6), now=0.0)
    live = [core.register("node0", i, "cpu", i, 0.0) for i in range(3)]
    for wid in live:
        core.mark_ready(wid, 100, 0.0)
    departed = []
    for k in range(8):  # preemptible machines: each member is replaced in turn
        departed.append(live.pop(0))
        core.leave(departed[-1], None, "", 1.0 + k, "preempted")
        live.append(core.register(f"spare{k}", 0, "cpu", 100 + k, 1.0 + k))
        core.mark_ready(live[-1], 100, 1.0 + k)
    assert not core.stopped
    status = CoordinatorService(core, store_host="127.0.0.1", store_port=0,
                                clock=lambda: 10.0).run_status()
    shown = [w.worker_id for w in status.workers]
    assert shown == departed[-3:] + live  # the newest 3 departed, then the live ones
    assert {w.state for w in status.workers[:3]} == {pb.WORKER_STATE_LEFT}


def test_the_status_bench_reports_time_and_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert status_bench.main(["--workers", "4", "--protocols", "allreduce,ripples-smart",
                              "--run-seconds", "5", "--repeats", "2", "--polls", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["protocol", "workers", "build", "serialise", "size",
                                "dashboard", "view"]
    assert [line.split()[:2] for line in lines[1:]] == [["allreduce", "4"],
                                                         ["ripples-smart", "4"]]
    assert all(line.split()[4].endswith("kB") and line.split()[5].endswith("kB")
               for line in lines[1:])
    # The dashboard's snapshot of 4 workers after 3 polls: rows, curves of 3 points.
    assert all(float(line.split()[5].removesuffix("kB")) > 1 for line in lines[1:])


def test_the_dashboard_snapshot_of_a_thousand_workers_stays_bounded() -> None:
    service = status_bench.training_service("ripples-smart", 1000, run_seconds=60.0)
    kilobytes, _ = status_bench.dashboard_snapshot(service, 60.0, polls=20)
    assert kilobytes < 64


def test_a_status_lists_at_most_its_bound_of_rows_and_counts_them_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_STATUS_WORKERS the status lists the first rows and says how many there
    are (and their mean iteration); a request for all of them gets every row, and the
    CLI says how many rows it was not sent."""
    from ripples.cli.run_views import render_status
    from ripples.coordinator import status_view
    monkeypatch.setattr(status_view, "MAX_STATUS_WORKERS", 5)
    service = status_bench.training_service("ripples-smart", 12, run_seconds=10.0)
    status = service.run_status()
    assert len(status.workers) == 5 and status.num_worker_rows == 12
    assert status.num_live_workers == len(service.core.live()) > 5  # listed or not
    assert [w.worker_id for w in status.workers] == list(service.core.workers)[:5]
    iterations = [w.progress.iteration for w in service.core.workers.values()]
    assert status.mean_iterations == pytest.approx(sum(iterations) / 12)
    every = service.run_status(all_workers=True)
    assert len(every.workers) == every.num_worker_rows == 12
    status.run.CopyFrom(pb.RunInfo(run_id="r1", name="big", state=pb.RUN_STATE_RUNNING))
    assert "workers sent: the first 5 of 12" in render_status(status)
