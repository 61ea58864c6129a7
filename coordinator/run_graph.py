"""Who may average with whom in a run, on worker ids (pure code).

Built once, when the membership is formed, in two parts. The heavy one is on ranks
(`RankGraph`): the run's topology (topology.py), its spectral gap, what the protocol's
role derives from the graph (constants its workers receive, a passive side), the edges
the dashboard draws. It depends only on the settings, the number of ranks and (the
hierarchical topology) each rank's host, so the service prepares it off the event loop
when the run is activated (`prepare`, in the thread that checks the run's options): at
100,000 workers an exponential graph has 1.7M edges and takes seconds to build, and
A2CiD2's constants on a graph without a closed form need a dense pseudo-inverse. The
light part, `RunGraph`, maps ranks to worker ids in O(workers) when the membership
forms; the edges on worker ids are derived only when a view asks (`edges`), and a run
status lists them only up to MAX_STATUS_EDGES (coordinator/status_view.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ripples.coordinator.config import RunSettings
from ripples.coordinator.registry import WorkerRecord
from ripples.coordinator.topology import Topology, build_topology
from ripples.protocols.spec import Coordination, GraphExtras
from ripples.static_schedule import PERIOD, static_groups
from ripples.v1 import coordinator_pb2 as pb

Edge = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class RankGraph:
    """The run's graph on ranks 0..n-1 and what is derived from it (immutable: built in
    a worker thread, then handed to the core on the loop)."""

    num_workers: int
    nodes: tuple[int, ...] | None
    """Each rank's node, when the topology depends on it (hierarchical); else None."""
    topology: Topology
    spectral_gap: float
    extras: GraphExtras | None
    rank_edges: tuple[Edge, ...] | None
    """The edges to draw, on ranks i < j, sorted: the topology's, or for the static
    schedule the pairs of one period; None on a complete graph."""

    @classmethod
    def build(cls, settings: RunSettings, num_workers: int,
              nodes: list[int] | None = None) -> RankGraph:
        """The graph on `num_workers` ranks (`nodes`: each rank's node, for the
        hierarchical topology); ValueError if the topology does not fit."""
        key = tuple(nodes) if nodes is not None and needs_nodes(settings) else None
        topology = build_topology(settings.topology, num_workers, nodes=key,
                                  edges=settings.topology_edges)
        settings.check_topology(topology)
        role = settings.role
        ranks = list(range(num_workers))
        edges: list[Edge] | None = None
        if role.coordination is Coordination.STATIC:
            edges = _static_edges(settings.workers_per_node, ranks)
        elif not topology.complete:
            edges = sorted(topology.edges())
        n = num_workers
        if (topology.complete and role.coordination is not Coordination.STATIC) or (
                edges is not None and n >= 2 and len(edges) == n * (n - 1) // 2):
            edges = None
        extras = (role.graph_extras(topology, settings.settings)
                  if role.graph_extras is not None else None)
        return cls(num_workers=n, nodes=key, topology=topology,
                   spectral_gap=topology.spectral_gap(), extras=extras,
                   rank_edges=tuple(edges) if edges is not None else None)

    def fits(self, settings: RunSettings, nodes: list[int]) -> bool:
        """It is the graph of these ranks (their number, and their nodes if it matters)."""
        key = tuple(nodes) if needs_nodes(settings) else None
        return self.num_workers == len(nodes) and self.nodes == key


def needs_nodes(settings: RunSettings) -> bool:
    """The topology depends on each rank's host (known only once every worker
    registered), so it cannot be prepared before the membership forms."""
    return settings.topology == "hierarchical"


def prepare(settings: RunSettings) -> RankGraph | None:
    """The graph of a run's full membership, ahead of its forming (in a worker thread,
    when the run is activated): None when it needs the hosts (hierarchical), or when the
    topology does not fit (the forming then stops the run with the reason)."""
    if needs_nodes(settings):
        return None
    try:
        return RankGraph.build(settings, settings.num_workers)
    except ValueError:
        return None


@dataclass(kw_only=True)
class RunGraph:
    """The run's graph on worker ids. An empty graph (before the membership is formed)
    lets everyone average with everyone."""

    ranks: RankGraph | None = None
    """The graph on ranks (None: the empty graph)."""
    by_rank: list[int] = field(default_factory=list)
    """The worker id that holds each rank in the graph."""
    complete: bool = False
    """Every pair of members is an edge (the complete topology, which lock-step
    protocols use; a static schedule on one worker per node): views derive the pairs from
    the members instead of a list that grows as n^2."""
    everyone: bool = True
    """Everyone may average with everyone (the complete topology, or no graph yet)."""
    edges_always_used: bool = False
    """Every edge carries traffic every iteration (lock-step, static, peer to peer)."""
    spectral_gap: float = 0.0
    gossip: pb.GossipConstants | None = None
    """What the protocol's role gives every worker with its membership (None: nothing)."""
    passive: frozenset[int] = frozenset()
    """Workers that only answer partners, never initiate (the role's passive ranks)."""
    _rank_of: dict[int, int] = field(default_factory=dict)
    _edges: list[Edge] | None = None  # `edges`, once a view asked

    @classmethod
    def build(cls, settings: RunSettings, ordered: list[WorkerRecord],
              prepared: RankGraph | None = None) -> RunGraph:
        """The graph for the members in rank order (`prepared`: the graph on ranks built
        ahead, used if it fits them); ValueError if the topology does not fit them (e.g.
        a bipartite pairing on an odd ring)."""
        nodes = [w.node for w in ordered]
        ranks = (prepared if prepared is not None and prepared.fits(settings, nodes)
                 else RankGraph.build(settings, len(ordered), nodes))
        by_rank = [w.worker_id for w in ordered]
        graph = cls(ranks=ranks, by_rank=by_rank, complete=ranks.rank_edges is None,
                    everyone=settings.topology == "complete",
                    edges_always_used=settings.role.needs_every_worker,
                    spectral_gap=ranks.spectral_gap,
                    _rank_of={w: r for r, w in enumerate(by_rank)})
        if ranks.extras is not None:
            graph.gossip = ranks.extras.gossip
            graph.passive = frozenset(by_rank[r] for r in ranks.extras.passive_ranks)
        return graph

    @property
    def num_edges(self) -> int:
        """How many edges `edges` lists (0 on a complete graph)."""
        edges = self.ranks.rank_edges if self.ranks is not None else None
        return len(edges) if edges is not None else 0

    @property
    def edges(self) -> list[Edge]:
        """The edges the dashboard draws, as worker ids a < b: the topology's, or for the
        static schedule the pairs of one period; empty when `complete`. O(edges) the
        first time after a change: a status lists them only up to MAX_STATUS_EDGES."""
        if self._edges is None:
            by_rank = self.by_rank
            rank_edges = self.ranks.rank_edges if self.ranks is not None else None
            self._edges = sorted((min(by_rank[i], by_rank[j]), max(by_rank[i], by_rank[j]))
                                 for i, j in rank_edges or ())
        return self._edges

    @property
    def neighbours(self) -> Mapping[int, tuple[int, ...]] | None:
        """Worker id -> the ids it may average with; None on a complete graph (the
        policies' view: each entry is mapped from the ranks when asked)."""
        if self.everyone or self.ranks is None:
            return None
        return _Neighbours(self)

    def replace_worker(self, old: int, new: int) -> None:
        """Worker `new` takes departed worker `old`'s place (its rank) in the graph."""
        rank = self._rank_of.pop(old, None)
        if rank is not None:
            self.by_rank[rank] = new
            self._rank_of[new] = rank
            self._edges = None
        if old in self.passive:
            self.passive = (self.passive - {old}) | {new}

    def neighbours_of(self, worker_id: int, live: list[int]) -> tuple[int, ...]:
        """The live workers `worker_id` may average with (all others on a complete graph)."""
        others = [w for w in live if w != worker_id]
        if self.everyone or self.ranks is None:
            return tuple(others)
        allowed = set(self.neighbours_of_member(worker_id))
        return tuple(w for w in others if w in allowed)

    def neighbours_of_member(self, worker_id: int) -> tuple[int, ...]:
        """The ids of the graph's neighbours of `worker_id` (live or not; () if it
        holds no rank; everyone's on a complete graph is not listed: see `neighbours`)."""
        rank = self._rank_of.get(worker_id)
        if rank is None or self.ranks is None:
            return ()
        by_rank = self.by_rank
        return tuple(by_rank[j] for j in self.ranks.topology.neighbours_of(rank))


class _Neighbours(Mapping[int, tuple[int, ...]]):
    """RunGraph.neighbours: the members' neighbours, mapped from ranks on demand (no
    dict of every worker's neighbours, 1.7M ids at 100,000 workers, built on the loop)."""

    def __init__(self, graph: RunGraph) -> None:
        self._graph = graph

    def __getitem__(self, worker_id: int) -> tuple[int, ...]:
        if worker_id not in self._graph._rank_of:
            raise KeyError(worker_id)
        return self._graph.neighbours_of_member(worker_id)

    def __iter__(self) -> Iterator[int]:
        return iter(self._graph.by_rank)

    def __len__(self) -> int:
        return len(self._graph.by_rank)


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
