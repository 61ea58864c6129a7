"""Who may average with whom in a run, on worker ids (pure code).

Built once, when the membership is formed: the run's topology on ranks (topology.py)
mapped to worker ids, its spectral gap, what the protocol's role derives from the graph
(constants its workers receive, a passive side), and the edges the dashboard draws (or,
for a complete graph, a flag: its n(n-1)/2 pairs would be 500k edges in every run status
at 1,000 workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ripples.coordinator.config import RunSettings
from ripples.coordinator.registry import WorkerRecord
from ripples.coordinator.topology import build_topology
from ripples.protocols.spec import Coordination
from ripples.static_schedule import PERIOD, static_groups
from ripples.v1 import coordinator_pb2 as pb

Edge = tuple[int, int]


@dataclass(kw_only=True)
class RunGraph:
    """The run's graph on worker ids. An empty graph (before the membership is formed)
    lets everyone average with everyone."""

    neighbours: dict[int, tuple[int, ...]] | None = None
    """Worker id -> the ids it may average with; None on a complete graph."""
    edges: list[Edge] = field(default_factory=list)
    """The edges the dashboard draws, as worker ids a < b: the topology's, or for the
    static schedule the pairs of one period; empty when `complete`."""
    complete: bool = False
    """Every pair of members is an edge (the complete topology, which lock-step
    protocols use; a static schedule on one worker per node): views derive the pairs from
    the members instead of a list that grows as n^2."""
    edges_always_used: bool = False
    """Every edge carries traffic every iteration (lock-step, static, peer to peer)."""
    spectral_gap: float = 0.0
    gossip: pb.GossipConstants | None = None
    """What the protocol's role gives every worker with its membership (None: nothing)."""
    passive: frozenset[int] = frozenset()
    """Workers that only answer partners, never initiate (the role's passive ranks)."""

    @classmethod
    def build(cls, settings: RunSettings, ordered: list[WorkerRecord]) -> RunGraph:
        """The graph for the members in rank order; ValueError if the topology does not
        fit them (e.g. a bipartite pairing on an odd ring)."""
        topology = build_topology(settings.topology, len(ordered),
                                  nodes=[w.node for w in ordered],
                                  edges=settings.topology_edges)
        settings.check_topology(topology)
        by_rank = [w.worker_id for w in ordered]
        role = settings.role
        graph = cls(spectral_gap=topology.spectral_gap(),
                    edges_always_used=role.needs_every_worker)
        static = role.coordination is Coordination.STATIC
        if static:
            graph.edges = _static_edges(settings.workers_per_node, by_rank)
        elif not topology.complete:
            graph.edges = sorted((min(by_rank[i], by_rank[j]), max(by_rank[i], by_rank[j]))
                                 for i, j in topology.edges())
        n = len(by_rank)
        if (topology.complete and not static) or (
                n >= 2 and len(graph.edges) == n * (n - 1) // 2):
            graph.complete, graph.edges = True, []
        if settings.topology != "complete":
            graph.neighbours = {by_rank[r]: tuple(by_rank[j] for j in ns)
                                for r, ns in enumerate(topology.neighbours)}
        if role.graph_extras is not None:
            extras = role.graph_extras(topology, settings.settings)
            graph.gossip = extras.gossip
            graph.passive = frozenset(by_rank[r] for r in extras.passive_ranks)
        return graph

    def replace_worker(self, old: int, new: int) -> None:
        """Worker `new` takes departed worker `old`'s place (its rank) in the graph."""
        def swap(w: int) -> int:
            return new if w == old else w

        if self.neighbours is not None:
            self.neighbours = {swap(w): tuple(swap(n) for n in ns)
                               for w, ns in self.neighbours.items()}
        self.edges = sorted((min(swap(a), swap(b)), max(swap(a), swap(b)))
                            for a, b in self.edges)
        if old in self.passive:
            self.passive = (self.passive - {old}) | {new}

    def neighbours_of(self, worker_id: int, live: list[int]) -> tuple[int, ...]:
        """The live workers `worker_id` may average with (all others on a complete graph)."""
        others = [w for w in live if w != worker_id]
        if self.neighbours is None:
            return tuple(others)
        allowed = self.neighbours.get(worker_id, ())
        return tuple(w for w in others if w in allowed)


def _static_edges(workers_per_node: int, by_rank: list[int]) -> list[Edge]:
    """Every pair that shares a group in one period of the static schedule (as worker ids);
    none when the layout does not fit the schedule (the run then fails to start)."""
    k = max(1, workers_per_node)
    num_nodes = len(by_rank) // k
    if num_nodes * k != len(by_rank):
        return []
    pairs: set[Edge] = set()
    for iteration in range(PERIOD):
        for group in static_groups(iteration, num_nodes, k):
            members = sorted(by_rank[r] for r in group)
            pairs.update((a, b) for i, a in enumerate(members) for b in members[i + 1:])
    return sorted(pairs)


def static_layout_error(settings: RunSettings, live: list[WorkerRecord]) -> str | None:
    """Why the static schedule cannot run on the registered workers, or None (None too
    for the runs of other coordinations)."""
    if settings.role.coordination is not Coordination.STATIC:
        return None
    per_node: dict[int, int] = {}
    for w in live:
        per_node[w.node] = per_node.get(w.node, 0) + 1
    k = settings.workers_per_node
    if any(n != k for n in per_node.values()):
        return (
            f"the static schedule needs exactly {k} workers on every host (workers per "
            f"node), got {sorted(per_node.values())}; set workers_per_node to match"
        )
    return None
