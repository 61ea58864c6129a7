"""What a run looks like from outside: its RunStatus and its Prometheus targets.

`run_status` builds the reply of GetRunStatus (the dashboard, `ripples status`, a shard's
root watch) from the core, on the event loop that answers group requests: it is bounded
(the workers' rows up to MAX_STATUS_WORKERS unless a request asks for all of them, a
complete graph is a flag, a larger graph's edges are counted past MAX_STATUS_EDGES
instead of listed, the loss curve and the recent groups are bounded by the core).
`discovery` lists the scrape targets of Prometheus' HTTP service discovery.
"""

from __future__ import annotations

import math

from ripples.coordinator.core import GONE, CoordinatorCore, WorkerState
from ripples.coordinator.groups import GroupRecord, GroupState
from ripples.coordinator.http import SdTargets
from ripples.coordinator.registry import WorkerRecord
from ripples.coordinator.wire import progress_to_proto
from ripples.v1 import coordinator_pb2 as pb

STATES = {
    WorkerState.REGISTERED: pb.WORKER_STATE_REGISTERED,
    WorkerState.COMPUTING: pb.WORKER_STATE_COMPUTING,
    WorkerState.WAITING: pb.WORKER_STATE_WAITING,
    WorkerState.REDUCING: pb.WORKER_STATE_REDUCING,
    WorkerState.LEFT: pb.WORKER_STATE_LEFT,
    WorkerState.EXPIRED: pb.WORKER_STATE_EXPIRED,
    WorkerState.FAILED: pb.WORKER_STATE_FAILED,
}
"""A worker's state as the wire names it."""
MAX_STATUS_EDGES = 20_000
"""A run status lists the graph's edges up to this many (RunStatus.num_topology_edges):
every graph of 1,000 workers but a "file" one (an exponential one has ~10,000), and a few
hundred kB; an exponential graph of 100,000 workers (1.7M edges) would make every status
20 MB and take seconds of the loop that answers group requests."""
MAX_STATUS_WORKERS = 2_000
"""A run status lists the rows of this many workers (RunStatus.num_worker_rows counts
them all; RunStatusRequest.all_workers lists every one): all of a 1,000-worker run's; at
100,000 workers every row took 0.7-0.8 s of the event loop per status
(python -m ripples.bench.loop_hold)."""
GROUP_STATES = {
    GroupState.PENDING: pb.GROUP_STATE_PENDING,
    GroupState.EXECUTING: pb.GROUP_STATE_EXECUTING,
}


def run_status(core: CoordinatorCore, now: float, *, metrics_address: str,
               metrics_targets: dict[int, str], all_workers: bool = False) -> pb.RunStatus:
    """The run's status now: settings, the shown workers, groups, progress, topology.

    Args:
        core: the run's core.
        now: the coordinator's clock.
        metrics_address: the coordinator's own metrics HOST:PORT ("" if none).
        metrics_targets: each worker's metrics HOST:PORT, by worker id.
        all_workers: list every shown worker's row, not the first MAX_STATUS_WORKERS.
    """
    mean = core.mean_loss()
    distance = core.consensus_distance()
    shown = shown_workers(core)
    listed = shown if all_workers else shown[:MAX_STATUS_WORKERS]
    workers = [
        pb.WorkerStatus(
            worker_id=w.worker_id, host=w.host, local_rank=w.local_rank, device=w.device,
            rank=max(w.rank, 0), state=STATES[w.state], iteration=w.progress.iteration,
            request_count=w.request_count,
            loss=w.progress.loss if math.isfinite(w.progress.loss) else 0.0,
            progress=progress_to_proto(w.progress), error=w.error,
            metrics_address=metrics_targets.get(w.worker_id, ""))
        for w in listed
    ]
    return pb.RunStatus(
        config=core.settings.to_proto(), workers=workers, elapsed_seconds=core.elapsed(now),
        started=core.started_at is not None, stopped=core.stopped,
        stop_reason=core.stop_reason, num_groups_formed=core.table.num_formed,
        num_groups_executing=core.table.num_executing,
        num_groups_pending=core.table.num_pending, num_conflicts=core.table.num_conflicts,
        num_pending_waits=core.groups.num_pending_waits,
        pending_wait_seconds=core.groups.pending_wait_seconds,
        num_groups_cancelled=core.groups.num_cancelled,
        num_groups_failed=core.groups.num_failed,
        mean_loss=mean if mean is not None else 0.0,
        time_to_target_seconds=core.time_to_target if core.time_to_target is not None else -1,
        loss_curve=[pb.LossPoint(seconds=s, loss=v, mean_iterations=i)
                    for s, v, i in core.loss_curve],
        recent_groups=[group_view(core, g, now, finished=True) for g in core.recent_groups],
        active_groups=[group_view(core, g, now) for g in core.table.unfinished()],
        metrics_address=metrics_address,
        num_lease_expirations=core.num_lease_expirations,
        iterations_to_target=(core.iterations_to_target
                              if core.iterations_to_target is not None else -1),
        topology_edges=[pb.TopologyEdge(a=a, b=b) for a, b in shown_edges(core)],
        num_topology_edges=core.graph.num_edges,
        edges_always_used=core.graph.edges_always_used,
        topology_complete=core.graph.complete,
        spectral_gap=core.graph.spectral_gap,
        consensus_distance=distance if distance is not None else -1.0,
        num_restarts=core.restarts,
        restarting=core.restart_reason if core.restart_began_at is not None else "",
        num_worker_rows=len(shown),
        num_live_workers=len(core.live()),
        mean_iterations=(sum(w.progress.iteration for w in shown) / len(shown)
                         if shown else 0.0),
    )


def shown_edges(core: CoordinatorCore) -> list[tuple[int, int]]:
    """The graph's edges a run status lists: all of them up to MAX_STATUS_EDGES, none
    past it (the status says how many there are: views draw what the workers did)."""
    graph = core.graph
    return graph.edges if graph.num_edges <= MAX_STATUS_EDGES else []


def shown_workers(core: CoordinatorCore) -> list[WorkerRecord]:
    """The workers a run status lists: every one but departed workers beyond the newest
    `num_workers` of them. Replacements of departed members (elastic runs) would
    otherwise pile up over a long run; this keeps the status O(workers) while a run whose
    workers all left still shows each of them."""
    workers = core.workers.values()  # in registration order
    gone = [w.worker_id for w in workers if w.state in GONE]
    dropped = set(gone[:-core.settings.num_workers])
    return [w for w in workers if w.worker_id not in dropped]


def group_view(core: CoordinatorCore, g: GroupRecord, now: float, *,
               finished: bool = False) -> pb.Group:
    """A group as a status shows it (`finished`: from the recent groups, FINISHED once
    it is no longer in the group table)."""
    live = core.table.get(g.group_id) is g
    state = GROUP_STATES[g.state] if live or not finished else pb.GROUP_STATE_FINISHED
    return pb.Group(group_id=g.group_id, members=g.members, initiator=g.initiator,
                    comm_id=g.comm_id, state=state, age_seconds=max(0.0, now - g.created_at))


def discovery(core: CoordinatorCore, *, metrics_address: str,
              metrics_targets: dict[int, str]) -> SdTargets:
    """Prometheus HTTP service discovery: the coordinator and each live worker."""
    groups: SdTargets = []
    if metrics_address:
        groups.append({"targets": [metrics_address], "labels": {"role": "coordinator"}})
    for w in core.live():
        target = metrics_targets.get(w.worker_id)
        if target:
            groups.append({"targets": [target], "labels": {
                "role": "worker", "__meta_ripples_worker": str(w.worker_id),
                "__meta_ripples_host": w.host}})
    return groups
