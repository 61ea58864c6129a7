"""A large run must not block the coordinator's event loop: its run status
lists the graph's edges only up to MAX_STATUS_EDGES (and says how many there are), and
the graph of a run is built ahead, off the loop (run_graph.prepare), so that the
registration that forms the membership only maps it to worker ids."""

from __future__ import annotations

from ripples.coordinator import run_graph, status_view
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.dashboard.view import RunView


def _formed(settings: RunSettings, *, prepare: bool) -> CoordinatorCore:
    core = CoordinatorCore(settings, now=0.0)
    if prepare:
        core.prepared_graph = run_graph.prepare(settings)
    for i in range(settings.num_workers):
        core.register(f"node{i // 8}", i % 8, "cpu", i, 0.0)
    assert core.membership_formed and not core.stopped
    return core


def test_a_small_graph_is_listed_in_full() -> None:
    core = _formed(RunSettings.build(protocol="adpsgd", num_workers=8, topology="ring"),
                   prepare=True)
    status = status_view.run_status(core, 1.0, metrics_address="", metrics_targets={})
    assert status.num_topology_edges == 8
    assert {(e.a, e.b) for e in status.topology_edges} == set(core.graph.edges)


def test_a_graph_past_the_limit_is_counted_not_listed() -> None:
    n = status_view.MAX_STATUS_EDGES + 1  # a ring of n workers has n edges
    settings = RunSettings.build(protocol="adpsgd", num_workers=n, topology="ring",
                                 workers_per_node=8)
    core = _formed(settings, prepare=True)
    # The forming used the graph built ahead (not one built on the loop).
    assert core.graph.ranks is core.prepared_graph
    status = status_view.run_status(core, 1.0, metrics_address="", metrics_targets={})
    assert status.num_topology_edges == n and len(status.topology_edges) == 0
    assert len(status.SerializeToString()) < 100 * n  # the edges alone would be ~10 B each
    # The dashboard says the graph is too large to draw in full.
    snapshot = RunView().update(status, now=1.0)
    assert snapshot["topology"]["mode"] == "hosts"
    assert f"the graph's {n:,} edges are too many to draw in full" in snapshot["edges_note"]


def test_the_prepared_graph_is_the_one_built_on_the_loop() -> None:
    settings = RunSettings.build(protocol="a2cid2", num_workers=64, topology="exponential")
    ahead, on_loop = _formed(settings, prepare=True), _formed(settings, prepare=False)
    assert ahead.graph.edges == on_loop.graph.edges
    assert ahead.graph.gossip == on_loop.graph.gossip
    assert ahead.graph.spectral_gap == on_loop.graph.spectral_gap
    first = ahead.graph.by_rank[0]
    assert ahead.neighbours_of(first) == on_loop.neighbours_of(first)
