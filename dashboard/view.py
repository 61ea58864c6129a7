"""What the dashboard shows, computed from successive run-status replies (pure code).

`RunView.update(status, now)` turns one `RunStatus` from the coordinator into the JSON
snapshot the page and the API serve. The view keeps the little history the coordinator
does not: each worker's recent iterations (for its speed), each worker's loss curve, and
the pairs of workers that averaged together lately (the edges of the topology graph).

`to_json` is the one JSON encoding of everything the dashboard serves (the event stream
and the API): a number that is not finite (a worker's NaN or infinite report) becomes
null, since a browser's JSON.parse refuses NaN and a page fed one would freeze.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ripples.protocols.registry import PROTOCOLS
from ripples.run_records import natural_key, state_name
from ripples.v1 import coordinator_pb2 as pb

# A worker is flagged slow when its speed falls below this fraction of the median speed.
SLOW_FRACTION = 0.5
# Speed is measured over this window of status polls.
SPEED_WINDOW_SECONDS = 5.0
# Edges fade out this long after the pair last averaged together.
EDGE_MEMORY_SECONDS = 10.0
# Points kept per worker loss curve (one per poll with a new iteration).
MAX_CURVE_POINTS = 600
# A complete graph (the coordinator sends a flag, not its pairs) is drawn pair by pair up
# to this many live workers (496 pairs); beyond, a note replaces the unreadable mesh.
MAX_COMPLETE_GRAPH_WORKERS = 32
# Up to this many workers the page shows each one: a node of the topology, a row of the
# table, a loss curve. Past it the snapshot stays bounded (docs/scale.md): the topology
# aggregates workers by host, the table lists this many (the departed, the slow and the
# furthest behind first) and no per-worker curve is kept.
MAX_WORKER_DETAIL = 64
# Past a size, the topology's nodes are hosts; past this many hosts, runs of consecutive
# hosts (sorted by name) share a node.
MAX_HOST_NODES = 128

STATE_NAMES = {
    pb.WORKER_STATE_REGISTERED: "registered",
    pb.WORKER_STATE_COMPUTING: "computing",
    pb.WORKER_STATE_WAITING: "waiting",
    pb.WORKER_STATE_REDUCING: "reducing",
    pb.WORKER_STATE_LEFT: "left",
    pb.WORKER_STATE_EXPIRED: "expired",
    pb.WORKER_STATE_FAILED: "failed",
}
GONE_STATES = ("left", "expired", "failed")
GROUP_STATE_NAMES = {
    pb.GROUP_STATE_PENDING: "pending",
    pb.GROUP_STATE_EXECUTING: "executing",
    pb.GROUP_STATE_FINISHED: "finished",
}


@dataclass
class _WorkerHistory:
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))
    curve: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=MAX_CURVE_POINTS))


def _group(g: pb.Group) -> dict[str, Any]:
    return {"group_id": g.group_id, "members": list(g.members), "initiator": g.initiator,
            "state": GROUP_STATE_NAMES.get(g.state, "unknown"),
            "age_seconds": round(g.age_seconds, 3)}


class RunView:
    """History across polls of one coordinator, and the snapshot built from it."""

    def __init__(self) -> None:
        self._run_id = ""
        self._workers: dict[int, _WorkerHistory] = {}
        self._edges: dict[tuple[int, int], float] = {}  # pair -> last time seen averaging
        self.rows: dict[int, dict[str, Any]] = {}
        """Every worker's row of the last status, listed in the snapshot or not."""

    def _reset_if_new_run(self, run_id: str) -> None:
        """A coordinator restarted with a new run: forget the old run's history."""
        if run_id != self._run_id:
            self._run_id = run_id
            self._workers.clear()
            self._edges.clear()
            self.rows = {}

    def update(self, status: pb.RunStatus, now: float) -> dict[str, Any]:
        """Fold one status into the history; returns the snapshot (JSON-able)."""
        self._reset_if_new_run(status.config.run_id)
        detail = len(status.workers) <= MAX_WORKER_DETAIL
        speeds = self._record_progress(status, now, detail)
        self._record_groups(status, now)
        live_speeds = [speed for w in status.workers
                       if STATE_NAMES.get(w.state) not in GONE_STATES
                       and (speed := speeds.get(w.worker_id)) is not None]
        median = statistics.median(live_speeds) if len(live_speeds) >= 2 else None
        workers = []
        for w in sorted(status.workers, key=lambda x: x.worker_id):
            state = STATE_NAMES.get(w.state, "unknown")
            speed = speeds.get(w.worker_id)
            slow = bool(median and speed is not None and state not in GONE_STATES
                        and speed < SLOW_FRACTION * median)
            workers.append({
                "worker_id": w.worker_id, "host": w.host, "local_rank": w.local_rank,
                "rank": w.rank, "device": w.device, "state": state,
                "iteration": w.iteration, "planned_iterations": w.progress.planned_iterations,
                "loss": w.loss if w.iteration > 0 else None,
                "iterations_per_second": round(speed, 3) if speed is not None else None,
                "slow": slow, "request_count": w.request_count,
                "compute_seconds": round(w.progress.compute_seconds, 3),
                "wait_seconds": round(w.progress.wait_seconds, 3),
                "preduce_seconds": round(w.progress.preduce_seconds, 3),
                "error": w.error, "metrics_address": w.metrics_address,
            })
        self.rows = {w["worker_id"]: w for w in workers}
        live = sum(w["state"] not in GONE_STATES for w in workers)
        if detail:
            hosts: dict[str, list[int]] = {}
            for w in workers:
                hosts.setdefault(w["host"], []).append(w["worker_id"])
            topology: dict[str, Any] = {"mode": "workers", "nodes": [], "edges": []}
            listed, workers_note = workers, ""
        else:
            hosts = {}
            topology = self._host_topology(status, workers, now)
            listed = sorted(workers, key=_notable)[:MAX_WORKER_DETAIL]
            workers_note = (f"{len(listed)} of {len(workers):,} workers listed: the departed, "
                            "the slow and the furthest behind first (/api/workers/ID shows "
                            "any one)")
            if status.num_worker_rows > len(workers):  # the status lists at most 2,000
                workers_note += (f"; the coordinator sent the first {len(workers):,} of "
                                 f"{status.num_worker_rows:,} workers' rows")
        c = status.config
        return {
            "connected": True,
            "error": "",
            "run": {
                "run_id": c.run_id, "name": status.run.name,
                "state": state_name(status.run.state) if status.HasField("run") else "",
                "protocol": c.protocol, "task": c.task or " ".join(status.run.command),
                "num_workers": c.num_workers, "workers_per_node": c.workers_per_node,
                "group_size": c.group_generator.group_size,
                "target_loss": c.target_loss or None,
                "started": status.started, "stopped": status.stopped,
                "stop_reason": status.stop_reason,
                "elapsed_seconds": round(status.elapsed_seconds, 3),
                "mean_loss": (status.mean_loss if status.mean_loss else
                              status.loss_curve[-1].loss if status.loss_curve else None),
                "time_to_target_seconds": (status.time_to_target_seconds
                                           if status.time_to_target_seconds >= 0 else None),
                "groups_formed": status.num_groups_formed,
                "groups_executing": status.num_groups_executing,
                "groups_pending": status.num_groups_pending,
                "conflicts": status.num_conflicts,
                "pending_waits": status.num_pending_waits,
                "groups_cancelled": status.num_groups_cancelled,
                "groups_failed": status.num_groups_failed,
                "lease_expirations": status.num_lease_expirations,
                "restarts": status.num_restarts,
                "restarting": status.restarting,
                "metrics_address": status.metrics_address,
            },
            "workers": listed,
            "workers_total": max(status.num_worker_rows, len(workers)),
            "workers_live": status.num_live_workers or live,  # the rows: older statuses
            "workers_note": workers_note,
            "hosts": [{"host": h, "worker_ids": ids} for h, ids in hosts.items()],
            "edges": self._edge_list(status, now) if detail else [],
            "edges_note": _edges_note(status) if detail else topology.pop("note"),
            "topology": topology,
            "active_groups": [_group(g) for g in status.active_groups],
            "recent_groups": [_group(g) for g in list(status.recent_groups)[-16:]],
            "groups_note": _groups_note(c.protocol),
            "loss_curve": [{"seconds": round(p.seconds, 3), "loss": p.loss}
                           for p in status.loss_curve],
            "worker_loss_curves": {
                str(wid): [{"seconds": s, "loss": v} for s, v in h.curve]
                for wid, h in self._workers.items()} if detail else {},
        }

    def _host_topology(self, status: pb.RunStatus, workers: list[dict[str, Any]],
                       now: float) -> dict[str, Any]:
        """The topology past MAX_WORKER_DETAIL workers: one node per host (or per run of
        consecutive hosts past MAX_HOST_NODES), edges between nodes whose workers
        averaged together lately or share an edge of the run's graph."""
        names = sorted({w["host"] for w in workers}, key=natural_key)
        per_node = -(-len(names) // MAX_HOST_NODES)
        node_of = {h: i // per_node for i, h in enumerate(names)}
        nodes: list[dict[str, Any]] = []
        for i in range(0, len(names), per_node):
            chunk = names[i:i + per_node]
            nodes.append({"label": chunk[0] if len(chunk) == 1 else f"{chunk[0]} … {chunk[-1]}",
                          "hosts": len(chunk), "workers": 0, "live": 0, "slow": 0,
                          "min_iteration": None, "mean_iteration": 0.0, "mean_loss": None})
        loss_sums = [[0.0, 0] for _ in nodes]
        node_by_worker: dict[int, int] = {}
        for w in workers:
            i = node_of[w["host"]]
            node_by_worker[w["worker_id"]] = i
            n = nodes[i]
            n["workers"] += 1
            if w["state"] in GONE_STATES:
                continue
            n["live"] += 1
            n["slow"] += w["slow"]
            n["mean_iteration"] += w["iteration"]
            it = n["min_iteration"]
            n["min_iteration"] = w["iteration"] if it is None else min(it, w["iteration"])
            if w["loss"] is not None:
                loss_sums[i][0] += w["loss"]
                loss_sums[i][1] += 1
        for n, (total, count) in zip(nodes, loss_sums, strict=True):
            n["mean_iteration"] = round(n["mean_iteration"] / n["live"], 1) if n["live"] else 0.0
            n["mean_loss"] = total / count if count else None
        weights: dict[tuple[int, int], list[float]] = {}

        def add(a: int, b: int, weight: float) -> None:
            na, nb = node_by_worker.get(a), node_by_worker.get(b)
            if na is None or nb is None or na == nb:
                return
            key = (min(na, nb), max(na, nb))
            entry = weights.setdefault(key, [0.0, 0])
            entry[0] = max(entry[0], weight)
            entry[1] += 1

        everything = status.topology_complete and status.edges_always_used
        if not everything:
            for e in status.topology_edges:
                add(e.a, e.b, 1.0 if status.edges_always_used else self._recency((e.a, e.b), now))
            listed = {(min(e.a, e.b), max(e.a, e.b)) for e in status.topology_edges}
            for pair in self._edges:
                if pair not in listed:
                    add(*pair, self._recency(pair, now))
        unit = "host" if per_node == 1 else f"run of {per_node} hosts"
        note = f"{len(workers):,} workers drawn by {unit} ({len(nodes)} nodes)"
        if everything:
            note += "; every worker averages with every other each iteration"
        elif not status.topology_edges:
            if status.num_topology_edges:  # past the coordinator's MAX_STATUS_EDGES
                note += (f"; the graph's {status.num_topology_edges:,} edges are too many "
                         "to draw in full")
            note += (f"; lines: workers of two nodes averaged together in the last "
                     f"{EDGE_MEMORY_SECONDS:.0f} s")
        return {"mode": "hosts", "note": note, "nodes": nodes,
                "edges": [{"a": a, "b": b, "weight": round(w, 3), "pairs": k}
                          for (a, b), (w, k) in sorted(weights.items())]}

    def _record_progress(self, status: pb.RunStatus, now: float,
                         detail: bool) -> dict[int, float | None]:
        """Per worker: the iterations/s over the last SPEED_WINDOW_SECONDS (None until two
        polls have seen it training), and a loss-curve point per poll with a new iteration
        (with `detail`: up to MAX_WORKER_DETAIL workers).
        Workers the status no longer lists (long departed) are forgotten."""
        listed = {w.worker_id for w in status.workers}
        for wid in self._workers.keys() - listed:
            del self._workers[wid]
        if not detail:  # past MAX_WORKER_DETAIL workers, no per-worker loss curve
            for h in self._workers.values():
                h.curve.clear()
        speeds: dict[int, float | None] = {}
        for w in status.workers:
            h = self._workers.setdefault(w.worker_id, _WorkerHistory())
            gone = STATE_NAMES.get(w.state) in GONE_STATES
            if w.iteration == 0 or gone:
                h.samples.clear()  # not training: no speed, and no pre-start baseline
                speeds[w.worker_id] = None
                continue
            new_iteration = not h.samples or h.samples[-1][1] != w.iteration
            if new_iteration or now - h.samples[-1][0] > 1:
                h.samples.append((now, w.iteration))
            while len(h.samples) > 2 and now - h.samples[1][0] >= SPEED_WINDOW_SECONDS:
                h.samples.popleft()
            (t0, i0), i1 = h.samples[0], h.samples[-1][1]
            speeds[w.worker_id] = (i1 - i0) / (now - t0) if now - t0 > 0.2 else None
            if (detail and new_iteration
                    and (not h.curve or h.curve[-1][0] < status.elapsed_seconds)):
                h.curve.append((round(status.elapsed_seconds, 3), w.loss))
        return speeds

    def _record_groups(self, status: pb.RunStatus, now: float) -> None:
        for g in [*status.recent_groups, *status.active_groups]:
            members = sorted(g.members)
            for i, a in enumerate(members):
                for b in members[i + 1:]:
                    self._edges[(a, b)] = max(self._edges.get((a, b), 0.0),
                                              now - g.age_seconds)
        for pair, seen in list(self._edges.items()):
            if now - seen > EDGE_MEMORY_SECONDS:
                del self._edges[pair]

    def _edge_list(self, status: pb.RunStatus, now: float) -> list[dict[str, Any]]:
        """Edges of the topology graph: who averages with whom.

        The coordinator lists the edges to draw (`topology_edges`: the graph's, the static
        schedule's pairs) or says the graph is complete (`topology_complete`: every pair of
        live workers, drawn up to MAX_COMPLETE_GRAPH_WORKERS). When the protocol uses every
        edge every iteration (`edges_always_used`) they are drawn at full weight; otherwise
        an edge is as bright as its pair averaged lately (recent groups), and pairs that
        averaged without an edge listed (none listed, or too many to draw) are drawn too."""
        live = sorted(_live_ids(status))
        if status.topology_complete and len(live) <= MAX_COMPLETE_GRAPH_WORKERS:
            pairs = [(a, b) for i, a in enumerate(live) for b in live[i + 1:]]
        else:
            alive = set(live)
            pairs = [(e.a, e.b) for e in status.topology_edges if e.a in alive and e.b in alive]
        if pairs:
            return [{"a": a, "b": b,
                     "weight": 1.0 if status.edges_always_used else self._recency((a, b), now)}
                    for a, b in pairs]
        return [{"a": a, "b": b, "weight": self._recency((a, b), now)}
                for a, b in sorted(self._edges)]

    def _recency(self, pair: tuple[int, int], now: float) -> float:
        """1 if the pair averaged together just now, fading to 0 over EDGE_MEMORY_SECONDS."""
        seen = self._edges.get(pair)
        if seen is None:
            return 0.0
        return round(max(0.0, 1 - (now - seen) / EDGE_MEMORY_SECONDS), 3)


def _notable(worker: dict[str, Any]) -> tuple[int, int, int]:
    """Order of the listed workers past MAX_WORKER_DETAIL: the departed, then the slow,
    then the furthest behind."""
    rank = 0 if worker["state"] in GONE_STATES else 1 if worker["slow"] else 2
    return rank, worker["iteration"], worker["worker_id"]


def _live_ids(status: pb.RunStatus) -> set[int]:
    return {w.worker_id for w in status.workers if STATE_NAMES.get(w.state) not in GONE_STATES}


def _edges_note(status: pb.RunStatus) -> str:
    """What the topology drawing leaves out: a complete graph's pairs above
    MAX_COMPLETE_GRAPH_WORKERS live workers ("" when everything is drawn)."""
    n = len(_live_ids(status))
    if not status.topology_complete or n <= MAX_COMPLETE_GRAPH_WORKERS:
        return ""
    if status.edges_always_used:
        return (f"all {n} workers average together every iteration; their "
                f"{n * (n - 1) // 2:,} pairs are not drawn")
    return (f"any two of the {n} workers may average; only the pairs that averaged in the "
            f"last {EDGE_MEMORY_SECONDS:.0f} s are drawn")


def disconnected(error: str, last: dict[str, Any] | None) -> dict[str, Any]:
    """The snapshot while the coordinator cannot be reached: the last known state, marked
    with `error` (which names the coordinator)."""
    snapshot = dict(last) if last else {"run": None, "workers": [], "workers_total": 0,
                                        "workers_live": 0, "workers_note": "",
                                        "topology": {"mode": "workers", "nodes": [],
                                                     "edges": []},
                                        "hosts": [], "edges": [],
                                        "edges_note": "", "active_groups": [],
                                        "recent_groups": [], "loss_curve": [],
                                        "worker_loss_curves": {}}
    snapshot["connected"] = False
    snapshot["error"] = error
    return snapshot


def _groups_note(protocol: str) -> str:
    """What the list of groups says while it is empty: the protocol's hint when it forms
    its groups without the coordinator (its spec's groups_note), else "none yet"."""
    spec = PROTOCOLS.get(protocol)
    return (spec.groups_note if spec is not None else "") or "none yet"


def finite(value: Any) -> Any:
    """`value` (JSON-able: dicts, lists, scalars) with every float that is not finite
    replaced by None (null: "not known"), at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """Strict JSON of `value` (compact), non-finite numbers as null: what every response
    and event of the dashboard is encoded with. allow_nan=False: a NaN that got past
    `finite` fails here, loudly, rather than in every viewer's browser."""
    return json.dumps(finite(value), allow_nan=False, separators=(",", ":"))
