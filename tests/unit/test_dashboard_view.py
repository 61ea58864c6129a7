"""The dashboard's view of a run, built from run-status replies with a fake clock."""

from __future__ import annotations

import json

from ripples.dashboard.view import (
    EDGE_MEMORY_SECONDS,
    MAX_COMPLETE_GRAPH_WORKERS,
    MAX_HOST_NODES,
    MAX_WORKER_DETAIL,
    RunView,
    disconnected,
    to_json,
)
from ripples.v1 import coordinator_pb2 as pb


def _status(iterations: dict[int, int], *, protocol: str = "ripples-smart", run_id: str = "r1",
            gone: tuple[int, ...] = (), groups: list[tuple[int, ...]] | None = None,
            age: float = 0.0, elapsed: float = 1.0, workers_per_node: int = 2) -> pb.RunStatus:
    workers = [
        pb.WorkerStatus(worker_id=wid, host=f"node{wid // workers_per_node}",
                        local_rank=wid % workers_per_node, rank=wid, iteration=it,
                        loss=2.0 / (1 + it),
                        state=pb.WORKER_STATE_LEFT if wid in gone else pb.WORKER_STATE_COMPUTING)
        for wid, it in iterations.items()]
    return pb.RunStatus(
        config=pb.RunConfig(run_id=run_id, protocol=protocol, num_workers=len(iterations),
                            workers_per_node=workers_per_node),
        workers=workers, started=True, elapsed_seconds=elapsed,
        recent_groups=[pb.Group(group_id=i + 1, members=list(g), age_seconds=age,
                                state=pb.GROUP_STATE_FINISHED)
                       for i, g in enumerate(groups or [])])


def _run(view: RunView, rates: dict[int, int], seconds: int, **kw: object) -> dict:
    snapshot: dict = {}
    for t in range(seconds + 1):
        snapshot = view.update(_status({w: r * t for w, r in rates.items()}, elapsed=t,
                                       **kw), now=float(t))  # type: ignore[arg-type]
    return snapshot


def test_a_worker_under_half_the_median_speed_is_flagged_slow() -> None:
    snapshot = _run(RunView(), {0: 10, 1: 10, 2: 9, 3: 2}, seconds=6)
    by_id = {w["worker_id"]: w for w in snapshot["workers"]}
    assert by_id[0]["iterations_per_second"] == 10
    assert by_id[3]["iterations_per_second"] == 2
    assert [w["slow"] for w in snapshot["workers"]] == [False, False, False, True]


def test_workers_that_left_are_neither_flagged_nor_counted_in_the_median() -> None:
    # Two gone workers at speed 0 would pull the median down to the slow worker's speed.
    snapshot = _run(RunView(), {0: 10, 1: 10, 2: 3, 3: 0, 4: 0}, seconds=6, gone=(3, 4))
    slow = {w["worker_id"] for w in snapshot["workers"] if w["slow"]}
    assert slow == {2}


def test_edges_are_pairs_that_averaged_lately_and_fade_out() -> None:
    view = RunView()
    s = view.update(_status({0: 1, 1: 1, 2: 1}, groups=[(0, 1, 2)]), now=100.0)
    assert {(e["a"], e["b"]) for e in s["edges"]} == {(0, 1), (0, 2), (1, 2)}
    assert all(e["weight"] == 1.0 for e in s["edges"])
    half = view.update(_status({0: 2, 1: 2, 2: 2}), now=100.0 + EDGE_MEMORY_SECONDS / 2)
    assert all(e["weight"] == 0.5 for e in half["edges"])
    gone = view.update(_status({0: 3, 1: 3, 2: 3}), now=101.0 + EDGE_MEMORY_SECONDS)
    assert gone["edges"] == []


def test_edges_the_protocol_always_uses_are_drawn_at_full_weight() -> None:
    # A lock-step protocol's graph is complete: the coordinator says so with a flag (not
    # n(n-1)/2 edges) and that its edges are always in use: no group history.
    status = _status({0: 1, 1: 1, 2: 1, 3: 1}, protocol="allreduce", gone=(3,))
    status.topology_complete = True
    status.edges_always_used = True
    view = RunView().update(status, now=0.0)
    assert {(e["a"], e["b"]) for e in view["edges"]} == {(0, 1), (0, 2), (1, 2)}
    assert all(e["weight"] == 1.0 for e in view["edges"])
    assert view["edges_note"] == ""


def test_a_complete_graph_too_large_to_draw_gets_a_note_instead() -> None:
    n = MAX_COMPLETE_GRAPH_WORKERS + 1
    status = _status(dict.fromkeys(range(n), 1), protocol="allreduce")
    status.topology_complete = True
    status.edges_always_used = True
    view = RunView().update(status, now=0.0)
    assert view["edges"] == []
    assert view["edges_note"] == (f"all {n} workers average together every iteration; their "
                                  f"{n * (n - 1) // 2:,} pairs are not drawn")
    # A group protocol on the complete graph: the pairs that averaged lately, and a note.
    smart = _status(dict.fromkeys(range(n), 1), groups=[(0, 1, 2)])
    smart.topology_complete = True
    view = RunView().update(smart, now=0.0)
    assert {(e["a"], e["b"]) for e in view["edges"]} == {(0, 1), (0, 2), (1, 2)}
    assert view["edges_note"].startswith(f"any two of the {n} workers may average")


def test_a_small_complete_graph_shows_every_pair_brightest_where_groups_formed() -> None:
    status = _status({0: 1, 1: 1, 2: 1}, groups=[(0, 1)])
    status.topology_complete = True
    edges = {(e["a"], e["b"]): e["weight"] for e in RunView().update(status, now=0.0)["edges"]}
    assert edges == {(0, 1): 1.0, (0, 2): 0.0, (1, 2): 0.0}


def test_workers_the_status_no_longer_lists_are_forgotten() -> None:
    view = RunView()
    _run(view, {0: 5, 1: 5, 2: 5}, seconds=2)
    later = view.update(_status({1: 20, 2: 20}, elapsed=3.0), now=3.0)
    assert set(later["worker_loss_curves"]) == {"1", "2"}


def test_a_new_run_on_the_same_dashboard_starts_a_fresh_history() -> None:
    view = RunView()
    first = _run(view, {0: 5, 1: 5}, seconds=3)
    assert len(first["worker_loss_curves"]["0"]) == 3
    second = view.update(_status({0: 0, 1: 0}, run_id="r2", elapsed=0.0), now=10.0)
    assert second["worker_loss_curves"] == {"0": [], "1": []}
    assert second["run"]["run_id"] == "r2"


def test_disconnected_keeps_the_last_state_and_says_why() -> None:
    last = RunView().update(_status({0: 1}), now=0.0)
    down = disconnected("coordinator at h:1 is unreachable", last)
    assert down["connected"] is False and down["error"].startswith("coordinator at h:1")
    assert down["workers"] == last["workers"] and last["connected"] is True
    empty = disconnected("coordinator at h:1 not asked yet", None)
    assert empty["run"] is None and empty["workers"] == []


def test_curves_and_speeds_only_follow_workers_that_train() -> None:
    view = RunView()
    waiting = view.update(_status({0: 0, 1: 0}, elapsed=0.0), now=0.0)
    assert [w["iterations_per_second"] for w in waiting["workers"]] == [None, None]
    # Started at t=10: the first speed counts from the first poll that saw it training,
    # not from the registration at t=0.
    view.update(_status({0: 5, 1: 5}, elapsed=1.0), now=10.0)
    s = view.update(_status({0: 25, 1: 25}, elapsed=2.0), now=11.0)
    assert [w["iterations_per_second"] for w in s["workers"]] == [20, 20]
    left = view.update(_status({0: 25, 1: 25}, gone=(0, 1), elapsed=3.0), now=12.0)
    later = view.update(_status({0: 25, 1: 25}, gone=(0, 1), elapsed=4.0), now=13.0)
    assert left["worker_loss_curves"] == later["worker_loss_curves"]
    assert len(later["worker_loss_curves"]["0"]) == 2
    assert [w["iterations_per_second"] for w in later["workers"]] == [None, None]


def test_a_sparse_topology_shows_every_edge_brightest_where_pairs_averaged() -> None:
    view = RunView()
    status = _status({0: 1, 1: 1, 2: 1, 3: 1}, protocol="a2cid2", groups=[(0, 1)])
    status.topology_edges.extend(pb.TopologyEdge(a=a, b=b)
                                 for a, b in [(0, 1), (0, 3), (1, 2), (2, 3)])
    edges = {(e["a"], e["b"]): e["weight"] for e in view.update(status, now=0.0)["edges"]}
    assert edges == {(0, 1): 1.0, (0, 3): 0.0, (1, 2): 0.0, (2, 3): 0.0}
    # hop exchanges with every graph neighbour each iteration: every edge at full weight.
    hop = _status({0: 1, 1: 1, 2: 1, 3: 1}, protocol="hop")
    hop.topology_edges.extend(status.topology_edges)
    hop.edges_always_used = True
    assert {e["weight"] for e in RunView().update(hop, now=0.0)["edges"]} == {1.0}


def _big_status(n: int, per_host: int, *, failed: tuple[int, ...] = (),
                groups: list[tuple[int, ...]] | None = None) -> pb.RunStatus:
    workers = [pb.WorkerStatus(worker_id=w, host=f"h{w // per_host:04d}",
                               local_rank=w % per_host, rank=w, iteration=100 + w % 7, loss=1.0,
                               error="boom" if w in failed else "",
                               state=pb.WORKER_STATE_FAILED if w in failed
                               else pb.WORKER_STATE_COMPUTING)
               for w in range(n)]
    return pb.RunStatus(config=pb.RunConfig(run_id="big", protocol="ripples-smart",
                                            num_workers=n, workers_per_node=per_host),
                        workers=workers, started=True, elapsed_seconds=10.0,
                        topology_complete=True,
                        recent_groups=[pb.Group(group_id=i + 1, members=list(g),
                                                state=pb.GROUP_STATE_FINISHED)
                                       for i, g in enumerate(groups or [])])


def test_past_the_detail_limit_the_snapshot_is_by_host_and_bounded() -> None:
    import json

    view = RunView()
    small = view.update(_big_status(MAX_WORKER_DETAIL, 8), now=0.0)
    assert small["topology"]["mode"] == "workers" and len(small["workers"]) == MAX_WORKER_DETAIL
    # 1,000 workers on 125 hosts of 8: one node per host, lines between hosts whose workers
    # averaged together, the table bounded with the failed worker first, no worker curves.
    status = _big_status(1000, 8, failed=(517,), groups=[(0, 9, 10), (16, 17)])
    for t in range(3):
        snapshot = view.update(status, now=float(t))
    topology = snapshot["topology"]
    assert topology["mode"] == "hosts" and len(topology["nodes"]) == 125
    assert topology["nodes"][0] == {"label": "h0000", "hosts": 1, "workers": 8, "live": 8,
                                    "slow": 0, "min_iteration": 100, "mean_iteration": 102.6,
                                    "mean_loss": 1.0}
    assert topology["nodes"][64]["live"] == 7  # worker 517 failed
    assert topology["edges"] == [{"a": 0, "b": 1, "weight": 1.0, "pairs": 2}]  # (0,9), (0,10)
    assert snapshot["hosts"] == [] and snapshot["edges"] == []
    assert snapshot["edges_note"].startswith("1,000 workers drawn by host (125 nodes)")
    assert snapshot["workers_total"] == 1000 and snapshot["workers_live"] == 999
    assert len(snapshot["workers"]) == MAX_WORKER_DETAIL
    assert snapshot["workers"][0]["worker_id"] == 517
    assert snapshot["workers_note"].startswith(f"{MAX_WORKER_DETAIL} of 1,000 workers listed")
    assert snapshot["worker_loss_curves"] == {}
    assert view.rows[999]["iteration"] == 100 + 999 % 7  # every worker still answers the API
    assert len(json.dumps(snapshot)) < 64_000
    # 5,000 workers, one per host: runs of hosts share a node, at most MAX_HOST_NODES.
    huge = RunView().update(_big_status(5000, 1), now=0.0)
    nodes = huge["topology"]["nodes"]
    assert len(nodes) <= MAX_HOST_NODES and sum(n["workers"] for n in nodes) == 5000
    assert nodes[0]["label"] == "h0000 … h0039" and nodes[0]["hosts"] == 40
    assert huge["edges_note"].startswith("5,000 workers drawn by run of 40 hosts")
    assert len(json.dumps(huge)) < 64_000


def test_host_nodes_follow_the_natural_order_of_host_names() -> None:
    status = _big_status(MAX_WORKER_DETAIL + 6, 1)
    for w in status.workers:
        w.host = f"h{w.worker_id}"  # h2 before h10, as the registry numbers nodes
    labels = [n["label"] for n in RunView().update(status, now=0.0)["topology"]["nodes"]]
    assert labels[:12] == [f"h{i}" for i in range(12)]


def test_numbers_that_are_not_finite_are_served_as_null() -> None:
    """A coordinator that passes on a worker's NaN or infinity (the dashboard does not
    count on the coordinator to drop them) still yields strict JSON: a browser parses it."""
    nan, inf = float("nan"), float("inf")
    status = _status({0: 3, 1: 4})
    status.workers[0].loss = nan
    status.workers[0].progress.compute_seconds = nan
    status.workers[0].progress.wait_seconds = inf
    status.workers[1].progress.preduce_seconds = -inf
    status.mean_loss = nan
    status.loss_curve.add(seconds=1.0, loss=inf)
    status.elapsed_seconds = nan
    text = to_json(RunView().update(status, now=1.0))

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    snapshot = json.loads(text, parse_constant=refuse)
    w0, w1 = snapshot["workers"]
    assert (w0["loss"], w0["compute_seconds"], w0["wait_seconds"]) == (None, None, None)
    assert w1["preduce_seconds"] is None and w1["loss"] == 0.4
    assert snapshot["run"]["mean_loss"] is None and snapshot["run"]["elapsed_seconds"] is None
    assert snapshot["loss_curve"] == [{"seconds": 1.0, "loss": None}]
