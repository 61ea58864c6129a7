"""Who is in the run: registration, ranks, the tensors averaged, and leases.

On a real `CoordinatorCore` (the clock given by hand): ranks are fixed when the last
worker registers (nodes in natural host order) and the clock starts when all are ready;
the coordinator lists the edges a protocol always uses; a worker that averages other
tensors is refused, naming the first difference; a member lost before the start stops the
run; a starting worker gets a grace beyond its lease; and a worker whose stream broke
loses its lease after SUSPECT_HEARTBEATS heartbeat intervals unless it heartbeats.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from coordinator_simulation import make_schema

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import SUSPECT_HEARTBEATS, CoordinatorCore, CoordinatorError
from ripples.coordinator.registry import STARTUP_LEASE_FACTOR


def _registered(run: RunSettings, hosts: Sequence[str]) -> tuple[CoordinatorCore, list[int]]:
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register(host, sum(h == host for h in hosts[:i]), "cpu", i, 0.0)
           for i, host in enumerate(hosts)]
    return core, ids


@pytest.mark.parametrize(("options", "pairs"), [
    # Lock-step protocols use every pair: a flag says so, not n(n-1)/2 edges.
    ({"protocol": "allreduce"}, None),
    ({"protocol": "lpp-sgd"}, None),
    ({"protocol": "hop", "topology": "ring"}, {(0, 1), (1, 2), (2, 3), (0, 3)}),
    # The static schedule on 2 nodes of 2: intra-node pairs and the cross-node pairings.
    ({"protocol": "ripples-static", "workers_per_node": 2}, {(0, 1), (2, 3), (0, 2), (1, 3)}),
    # ... and on 4 nodes of 1: every pair, so a flag again.
    ({"protocol": "ripples-static", "workers_per_node": 1}, None),
])
def test_the_coordinator_lists_the_edges_a_protocol_always_uses(
        options: dict[str, object], pairs: set[tuple[int, int]] | None) -> None:
    hosts = (["node0", "node0", "node1", "node1"] if options.get("workers_per_node", 2) == 2
             else ["node0", "node1", "node2", "node3"])
    core, _ = _registered(RunSettings.build(num_workers=4, iterations=10, **options), hosts)
    assert core.membership_formed and not core.stopped
    assert core.graph.edges_always_used
    assert core.graph.complete is (pairs is None)
    assert set(core.graph.edges) == (pairs or set())


def test_group_protocols_draw_only_the_groups_they_form() -> None:
    core, _ = _registered(RunSettings(protocol="ripples-smart", num_workers=3, iterations=10),
                          ["a", "a", "b"])
    assert not core.graph.edges_always_used


def test_ranks_are_fixed_when_the_last_worker_registers_and_the_clock_at_ready() -> None:
    core, ids = _registered(RunSettings(num_workers=3, iterations=10), ["node10", "node2", "node2"])
    assert core.membership_formed and core.started_at is None
    # Nodes by host name in natural order: node2 (two workers) before node10.
    assert [core.workers[w].rank for w in ids] == [2, 0, 1]
    with pytest.raises(CoordinatorError, match="already has its 3 workers"):
        core.register("node3", 0, "cpu", 9, 0.0)
    assert not core.mark_ready(ids[0], 10, 1.0)
    assert not core.mark_ready(ids[1], 10, 2.0)
    assert core.mark_ready(ids[2], 10, 3.0) and core.started_at == 3.0


def test_a_worker_averaging_other_tensors_is_refused_naming_the_first_difference() -> None:
    core, ids = _registered(RunSettings(num_workers=3, iterations=10), ["a", "a", "a"])
    good = make_schema(("param:0.weight", (8, 4), "float32"), ("param:0.bias", (8,), "float32"))
    core.mark_ready(ids[0], 10, 0.0, good)
    core.mark_ready(ids[1], 10, 0.0, good)
    bad = make_schema(("param:0.weight", (8, 5), "float32"), ("param:0.bias", (8,), "float32"))
    with pytest.raises(CoordinatorError, match=r"tensor 0 is 'param:0.weight' float32 \[8, 5\] "
                                               r"here but 'param:0.weight' float32 \[8, 4\]"):
        core.mark_ready(ids[2], 10, 0.0, bad)
    assert core.started_at is None
    core.check_schema(ids[2], good)  # after the first step: the reference of that stage
    short = make_schema(("param:0.weight", (8, 4), "float32"))
    with pytest.raises(CoordinatorError, match="lacks 1 tensor"):
        core.check_schema(ids[1], short)
    # The refused worker leaves with its error: the run can never start, so it stops.
    core.leave(ids[2], None, "schema refused", 1.0)
    assert core.stopped and "before training started" in core.stop_reason


def test_a_member_lost_before_the_start_stops_the_run_with_its_reason() -> None:
    core, ids = _registered(RunSettings(num_workers=2, iterations=10, lease_seconds=5),
                            ["a", "a"])
    core.mark_ready(ids[0], 10, 0.0)
    core.expire_leases(6.0)
    assert core.stopped and "lease expired" in core.stop_reason


def test_a_starting_worker_gets_a_grace_beyond_its_lease() -> None:
    """Its start-up (imports, data, model) can starve its heartbeat thread on a loaded
    host; a chaos trial saw starting workers expire under a 2 s lease."""
    core, ids = _registered(RunSettings(num_workers=2, iterations=10, lease_seconds=5),
                            ["a", "a"])
    core.expire_leases(6.0)
    assert not core.stopped and len(core.live()) == 2
    core.expire_leases(5.0 * STARTUP_LEASE_FACTOR + 1)
    assert core.stopped and "lease expired" in core.stop_reason


def test_a_worker_whose_stream_broke_loses_its_lease_unless_it_heartbeats() -> None:
    """A SIGKILLed worker's connection closes at once: its groups are cancelled after
    SUSPECT_HEARTBEATS heartbeat intervals, not a whole lease later; a live worker whose
    stream broke renews its whole lease with its next heartbeat."""
    run = RunSettings(num_workers=3, iterations=100, lease_seconds=10,
                      heartbeat_interval_seconds=0.5)
    core, ids = _registered(run, ["a", "a", "a"])
    for wid in ids:
        core.mark_ready(wid, 100, 0.0)
    for wid in ids:
        core.heartbeat(wid, None, 1.0)  # leases end at 11.0
    assert core.suspect(ids[0], 2.0) == pytest.approx(2.0 + SUSPECT_HEARTBEATS * 0.5)
    assert core.suspect(ids[1], 2.0) is not None
    core.heartbeat(ids[1], None, 2.4)  # alive after all: its whole lease again
    core.expire_leases(2.0 + SUSPECT_HEARTBEATS * 0.5 + 0.01)
    assert [w.worker_id for w in core.live()] == ids[1:]
    gone = core.registry.workers[ids[0]]
    assert "connection closed and no heartbeat followed within 1.5 s" in gone.error
    core.expire_leases(11.5)  # worker 2's plain lease (no heartbeat since 1.0)
    assert "no heartbeat for 10.0 s" in core.registry.workers[ids[2]].error
    # Unknown, departed or not yet started workers: nothing to cut.
    assert core.suspect(ids[0], 13.0) is None and core.suspect(999, 13.0) is None


def test_a_stream_that_breaks_after_the_heartbeats_stopped_leaves_the_lease_whole() -> None:
    """A cut link: the worker went silent first and its transport gave up seconds later
    (keepalive). That break is the path's, not a process death, so the worker keeps its
    whole lease and a link that comes back within it is ridden over; a break while its
    heartbeats still arrive cuts the lease as before."""
    run = RunSettings(num_workers=2, iterations=100, lease_seconds=15,
                      heartbeat_interval_seconds=0.5)
    core, ids = _registered(run, ["a", "b"])
    for wid in ids:
        core.mark_ready(wid, 100, 0.0)
        core.heartbeat(wid, None, 1.0)  # leases end at 16.0
    core.heartbeat(ids[1], None, 8.0)
    window = SUSPECT_HEARTBEATS * 0.5
    assert core.suspect(ids[0], 1.0 + window + 0.1) is None  # silent past the window
    assert core.suspect(ids[1], 8.0 + window - 0.1) == pytest.approx(8.0 + 2 * window - 0.1)
    core.expire_leases(15.0)
    assert [w.worker_id for w in core.live()] == [ids[0]]
    core.heartbeat(ids[0], None, 15.5)  # reconnected within its lease
    core.expire_leases(20.0)
    assert [w.worker_id for w in core.live()] == [ids[0]]
