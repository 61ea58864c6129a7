"""Communication graphs for gossip and group generation, and the numbers that judge them.

Pure code on ranks 0..n-1 (ranks are ordered by node, then local rank). A topology says
which workers may average together; the coordinator maps ranks to worker ids when the
run starts. Every graph is checked to be connected: gossip on a disconnected graph never
reaches consensus.

The spectral quantities follow the papers:

- Pairwise gossip where a uniformly random worker i averages with a uniformly random
  neighbour j applies W = I - (e_i - e_j)(e_i - e_j)^T / 2, and W^T W = W, so the
  AD-PSGD paper's rho = lambda_2(E[W^T W]) is lambda_2(E[W]) with
  E[W] = I - L / n, where L is the Laplacian with edge weight (1/d_i + 1/d_j) / 2 (the
  rate at which edge (i, j) is used when every worker averages once per unit time).
  `spectral_gap` is 1 - rho = lambda_2(L) / n: the fraction of disagreement one
  averaging per worker removes, in expectation. It is 0 exactly when the graph is
  disconnected.
- `algebraic_connectivity` (lambda_2 of L) and `max_half_resistance` (the largest half
  effective resistance over edges) are what a protocol's constants need of the graph
  (A2CiD2's: protocols/gossip/coordinator.py).
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ripples.files import read_regular_file

TOPOLOGIES = ("complete", "ring", "ring-based", "double-ring", "exponential",
              "hierarchical", "file")
"""Names accepted by `build_topology` ("file": a list of edges, see checked_edges)."""

Edge = tuple[int, int]


@dataclass(frozen=True)
class Topology:
    """An undirected connected graph on ranks 0..n-1.

    Invariant: `neighbours[i]` is sorted, excludes i, and j in neighbours[i] iff i in
    neighbours[j]; the graph is connected (build_topology and from_edges check it).
    """

    name: str
    neighbours: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] | None = None
    """A circulant graph (ring, ring-based, exponential): rank i's neighbours are
    i +- each offset (mod n). Its spectrum has a closed form (a discrete Fourier
    transform), so the spectral gap and the effective resistances cost O(n) instead of a dense
    n x n eigendecomposition (minutes and gigabytes at 10,000 workers)."""

    @property
    def num_workers(self) -> int:
        return len(self.neighbours)

    @property
    def complete(self) -> bool:
        """Every pair of ranks is an edge."""
        return False

    def neighbours_of(self, rank: int) -> tuple[int, ...]:
        return self.neighbours[rank]

    def edges(self) -> list[Edge]:
        return [(i, j) for i, ns in enumerate(self.neighbours) for j in ns if i < j]

    def degree(self, rank: int) -> int:
        return len(self.neighbours[rank])

    def laplacian(self) -> np.ndarray:
        """L with edge weight (1/d_i + 1/d_j) / 2: the rate of edge (i, j) when every worker
        averages once per unit time with a uniformly chosen neighbour."""
        n = self.num_workers
        lap = np.zeros((n, n))
        for i, j in self.edges():
            w = 0.5 * (1.0 / self.degree(i) + 1.0 / self.degree(j))
            lap[i, j] -= w
            lap[j, i] -= w
            lap[i, i] += w
            lap[j, j] += w
        return lap

    def spectral_gap(self) -> float:
        """1 - lambda_2(E[W]) of uniform pairwise gossip (module docstring)."""
        return float(max(0.0, self.algebraic_connectivity()) / self.num_workers)

    def algebraic_connectivity(self) -> float:
        """lambda_2 of `laplacian()` (0 exactly when the graph is disconnected)."""
        if self.offsets is not None:
            return float(_circulant_spectrum(self.num_workers, self.offsets)[1:].min())
        if self.num_workers > DENSE_SPECTRUM_LIMIT:
            return self._sparse_lambda_2()
        return float(np.linalg.eigvalsh(self.laplacian())[1])

    def _sparse_lambda_2(self) -> float:
        """lambda_2 of a large graph without a closed form: the sparse Laplacian's two
        eigenvalues nearest 0 (shift-invert: one sparse factorisation)."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.linalg import eigsh

        n = self.num_workers
        rows, cols, weights = [], [], []
        degree = [len(ns) for ns in self.neighbours]
        for i, j in self.edges():
            w = 0.5 * (1.0 / degree[i] + 1.0 / degree[j])
            rows += [i, j, i, j]
            cols += [j, i, i, j]
            weights += [-w, -w, w, w]
        lap = coo_matrix((weights, (rows, cols)), shape=(n, n)).tocsc()
        values = eigsh(lap, k=2, sigma=-1e-3, which="LM", return_eigenvectors=False)
        return float(max(values))

    def max_half_resistance(self) -> float:
        """The largest half effective resistance of `laplacian()` over the edges."""
        if self.offsets is not None:
            return max(_circulant_half_resistance(self.num_workers, self.offsets, s)
                       for s in self.offsets)
        self._check_dense()
        pinv = np.linalg.pinv(self.laplacian(), hermitian=True)
        return max(0.5 * float(pinv[i, i] + pinv[j, j] - 2 * pinv[i, j])
                   for i, j in self.edges())

    def _check_dense(self) -> None:
        if self.num_workers > DENSE_SPECTRUM_LIMIT:
            raise ValueError(
                f"the {self.name} topology with {self.num_workers} workers: its effective "
                "resistances need a dense pseudo-inverse of the n x n Laplacian; above "
                f"{DENSE_SPECTRUM_LIMIT} workers use complete, ring, ring-based or "
                "exponential (closed forms)")

    def is_bipartite(self) -> bool:
        return self.two_colouring() is not None

    def two_colouring(self) -> tuple[int, ...] | None:
        """Colour 0/1 per rank with every edge joining two colours, or None if there is
        none (an odd cycle). Rank 0 gets colour 0."""
        colour = [-1] * self.num_workers
        for start in range(self.num_workers):
            if colour[start] >= 0:
                continue
            colour[start] = 0
            stack = [start]
            while stack:
                i = stack.pop()
                for j in self.neighbours[i]:
                    if colour[j] < 0:
                        colour[j] = 1 - colour[i]
                        stack.append(j)
                    elif colour[j] == colour[i]:
                        return None
        return tuple(colour)

    @classmethod
    def from_edges(cls, name: str, num_workers: int, edges: Sequence[Edge], *,
                   offsets: tuple[int, ...] | None = None) -> Topology:
        """A topology from undirected edges; ValueError if an edge is out of range, a self
        loop, or the graph is disconnected. Duplicate edges count once."""
        if num_workers < 2:
            raise ValueError(f"a topology needs at least 2 workers, got {num_workers}")
        sets: list[set[int]] = [set() for _ in range(num_workers)]
        for i, j in edges:
            if not (0 <= i < num_workers and 0 <= j < num_workers):
                raise ValueError(f"{name}: edge ({i}, {j}) names a rank outside "
                                 f"0..{num_workers - 1}")
            if i == j:
                raise ValueError(f"{name}: edge ({i}, {j}) is a self loop")
            sets[i].add(j)
            sets[j].add(i)
        topology = cls(name=name, neighbours=tuple(tuple(sorted(s)) for s in sets),
                       offsets=offsets)
        components = topology.components()
        if len(components) > 1:
            shown = "; ".join(
                "{" + ", ".join(map(str, c[:8])) + (", ..." if len(c) > 8 else "") + "}"
                for c in components[:4])
            raise ValueError(
                f"{name} topology on {num_workers} workers is disconnected "
                f"({len(components)} components: {shown}); gossip would never reach "
                "consensus: add edges that join them")
        return topology

    def components(self) -> list[list[int]]:
        seen = [False] * self.num_workers
        found = []
        for start in range(self.num_workers):
            if seen[start]:
                continue
            seen[start] = True
            stack, members = [start], []
            while stack:
                i = stack.pop()
                members.append(i)
                for j in self.neighbours[i]:
                    if not seen[j]:
                        seen[j] = True
                        stack.append(j)
            found.append(sorted(members))
        return found


DENSE_SPECTRUM_LIMIT = 4096
"""Above this many workers, a topology without a closed-form spectrum gets its spectral
gap from a sparse solver, and A2CiD2's constants (a dense pseudo-inverse of n x n: 4096
takes ~30 s here) are refused, saying so."""


class CompleteTopology(Topology):
    """The complete graph, held as its size: its n(n-1) neighbour entries are listed
    only on request (`neighbours`, `edges`: small graphs); the coordinator asks
    `complete` instead (100,000 workers have 5e9 pairs). With every degree n - 1 the
    Laplacian is (n I - J) / (n - 1): lambda_2 = n / (n - 1); its pseudo-inverse is
    (n - 1) / n x (I - J / n), so every half effective resistance is (n - 1) / n."""

    def __init__(self, num_workers: int) -> None:
        object.__setattr__(self, "name", "complete")
        object.__setattr__(self, "offsets", None)
        object.__setattr__(self, "_n", num_workers)

    @property
    def num_workers(self) -> int:
        return int(self._n)  # type: ignore[attr-defined]

    @property
    def complete(self) -> bool:
        return True

    @property  # type: ignore[misc]
    def neighbours(self) -> tuple[tuple[int, ...], ...]:  # type: ignore[override]
        """Every other rank, for each rank: O(n^2), for small graphs (tests, tools)."""
        return tuple(self.neighbours_of(i) for i in range(self.num_workers))

    def neighbours_of(self, rank: int) -> tuple[int, ...]:
        return tuple(r for r in range(self.num_workers) if r != rank)

    def edges(self) -> list[Edge]:
        n = self.num_workers
        return [(i, j) for i in range(n) for j in range(i + 1, n)]

    def degree(self, rank: int) -> int:
        return self.num_workers - 1

    def algebraic_connectivity(self) -> float:
        n = self.num_workers
        return n / (n - 1)

    def max_half_resistance(self) -> float:
        n = self.num_workers
        return (n - 1) / n

    def two_colouring(self) -> tuple[int, ...] | None:
        return (0, 1) if self.num_workers == 2 else None

    def components(self) -> list[list[int]]:
        return [list(range(self.num_workers))]

    def __repr__(self) -> str:
        return f"CompleteTopology({self.num_workers})"


def _circulant_spectrum(n: int, offsets: tuple[int, ...]) -> np.ndarray:
    """Eigenvalues of `laplacian()` of the circulant graph with these offsets (each
    worker has degree d = 2 |offsets|, or one less for offset n / 2): for k = 0..n-1,
    lambda_k = (1/d) sum over its neighbours' offsets s of (1 - cos(2 pi k s / n))."""
    k = np.arange(n)
    degree = sum(1 if 2 * s == n else 2 for s in offsets)
    total = np.zeros(n)
    for s in offsets:
        term = 1.0 - np.cos(2.0 * np.pi * k * s / n)
        total += term if 2 * s == n else 2.0 * term
    return total / degree


def _circulant_half_resistance(n: int, offsets: tuple[int, ...], s: int) -> float:
    """Half the effective resistance between ranks i and i + s of that graph:
    R = (1/n) sum over k != 0 of (2 - 2 cos(2 pi k s / n)) / lambda_k."""
    spectrum = _circulant_spectrum(n, offsets)[1:]
    k = np.arange(1, n)
    resistance = float(((2.0 - 2.0 * np.cos(2.0 * np.pi * k * s / n)) / spectrum).sum() / n)
    return 0.5 * resistance


def _ring(ranks: Sequence[int]) -> list[Edge]:
    n = len(ranks)
    return [(ranks[i], ranks[(i + 1) % n]) for i in range(n)] if n > 1 else []


def _ring_based(ranks: Sequence[int]) -> list[Edge]:
    """A ring plus, for each node, an edge to the node furthest round the ring."""
    n = len(ranks)
    far = [(ranks[i], ranks[(i + n // 2) % n]) for i in range(n)] if n > 2 else []
    return _ring(ranks) + far


MAX_TOPOLOGY_EDGES = 500_000
"""The most edges a "file" topology may list (an average degree of 10 at 100,000
workers): the coordinator checks, stores and builds the graph of a submission, so its
size is bounded."""
MAX_TOPOLOGY_FILE_BYTES = 32 * 1024 * 1024
"""The largest edge-list file a command reads (MAX_TOPOLOGY_EDGES lines and comments)."""
_EDGE_EXCERPT = re.compile(r"[-+0-9\s,]{1,40}")
"""A line short enough, and made of nothing but numbers, to be quoted in an error."""


def parse_edge_list(text: str, source: str = "topology file") -> list[Edge]:
    """Edges from text: one `i j` pair of ranks per line; `#` starts a comment.

    An error names the line and quotes it only if it is a short line of numbers: a file
    that is no edge list (a token, an environment) is never echoed."""
    edges = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        try:
            if len(parts) != 2:
                raise ValueError
            edges.append((int(parts[0]), int(parts[1])))
        except ValueError:
            shown = (f"got {line!r}" if _EDGE_EXCERPT.fullmatch(line)
                     else "got something else (not quoted)")
            raise ValueError(f"{source} line {number}: expected two ranks 'i j', "
                             f"{shown}") from None
        if len(edges) > MAX_TOPOLOGY_EDGES:
            raise ValueError(f"{source} lists more than {MAX_TOPOLOGY_EDGES} edges")
    if not edges:
        raise ValueError(f"{source} holds no edges")
    return edges


def read_edge_list(path: str) -> list[Edge]:
    """The edges of an edge-list file, read by the command that submits a run (the CLI,
    the simulator): the coordinator takes the edges (RunSettings.topology_edges) and
    never opens a path a client names. Refuses at once, saying so, what is not a regular
    file (a FIFO would block the read) and a file over MAX_TOPOLOGY_FILE_BYTES.

    Raises:
        ValueError: naming the file and what to fix.
    """
    source = f"topology file {path}"
    data = read_regular_file(path, MAX_TOPOLOGY_FILE_BYTES, what="topology file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{source} is not UTF-8 text: give one 'i j' pair of ranks "
                         "per line") from None
    return parse_edge_list(text, source)


def _quote(value: object) -> str:
    """A client's value quoted in an error, short whatever its size or nesting."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple = 2, 3, 3
    short.maxstring, short.maxlong, short.maxother = 20, 12, 20
    return short.repr(value)


def checked_edges(value: object, num_workers: int) -> list[Edge]:
    """`value` (JSON's list of [i, j] lists, or a list of pairs) as a list of edges whose
    ranks are in 0..num_workers-1; ValueError naming the first bad entry (quoted short:
    reprlib bounds its length and depth)."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"topology_edges must be a list of [i, j] rank pairs, got "
                         f"{type(value).__name__}")
    if len(value) > MAX_TOPOLOGY_EDGES:
        raise ValueError(f"topology_edges lists {len(value)} edges; at most "
                         f"{MAX_TOPOLOGY_EDGES}")
    edges: list[Edge] = []
    for index, pair in enumerate(value):
        if (not isinstance(pair, list | tuple) or len(pair) != 2
                or not all(type(r) is int for r in pair)):
            raise ValueError(f"topology_edges[{index}]: expected a pair of ranks [i, j], "
                             f"got {_quote(pair)}")
        i, j = pair
        if not (0 <= i < num_workers and 0 <= j < num_workers):
            raise ValueError(f"topology_edges[{index}]: {_quote(pair)} names a rank "
                             f"outside 0..{num_workers - 1} (num_workers {num_workers})")
        edges.append((i, j))
    return edges


def build_topology(name: str, num_workers: int, *, nodes: Sequence[int] | None = None,
                   edges: Sequence[Edge] = ()) -> Topology:
    """The named graph on `num_workers` ranks.

    Args:
        name: one of TOPOLOGIES.
        num_workers: ranks 0..num_workers-1.
        nodes: node index per rank (hierarchical; default: every rank its own node).
        edges: the edge list of the "file" topology (see checked_edges).
    """
    n = num_workers
    if n < 2:
        raise ValueError(f"a topology needs at least 2 workers, got {n}")
    ranks = list(range(n))
    offsets: tuple[int, ...] | None = None
    if name == "complete":
        return CompleteTopology(n)
    elif name == "ring":
        found = _ring(ranks)
        offsets = (1,) if n > 2 else None
    elif name == "ring-based":
        found = _ring_based(ranks)
        offsets = (1, n // 2) if n > 4 else None
    elif name == "double-ring":
        if n % 2 or n < 4:
            raise ValueError(f"double-ring joins two equal rings node to node: it needs an "
                             f"even number of workers >= 4, got {n}")
        half = n // 2
        found = (_ring_based(ranks[:half]) + _ring_based(ranks[half:])
                 + [(i, i + half) for i in range(half)])
    elif name == "exponential":
        # Each rank links to the ranks 2^k hops away in both directions, each neighbour
        # once however many k reach it (the gossip constants use this simple graph).
        found = []
        distance = 1
        while distance < n:
            found += [(i, (i + distance) % n) for i in ranks]
            distance *= 2
        # Offsets s and n - s are the same edges: the circulant's set is the smaller ones.
        hops = {min(1 << k, n - (1 << k)) for k in range(n.bit_length()) if 1 << k < n}
        offsets = tuple(sorted(hops))
    elif name == "hierarchical":
        node_of = list(nodes) if nodes is not None else ranks
        if len(node_of) != n:
            raise ValueError(f"hierarchical: {len(node_of)} node indices for {n} workers")
        by_node: dict[int, list[int]] = {}
        for rank, node in enumerate(node_of):
            by_node.setdefault(node, []).append(rank)
        groups = [by_node[k] for k in sorted(by_node)]
        found = [(a, b) for g in groups for a in g for b in g if a < b]
        if len(groups) > 1:
            # Hosts in a ring: the l-th worker of a host links to the l-th (modulo size)
            # worker of the next host.
            for k, g in enumerate(groups):
                nxt = groups[(k + 1) % len(groups)]
                if len(groups) == 2 and k == 1:
                    break
                found += [(g[i], nxt[i % len(nxt)]) for i in range(len(g))]
    elif name == "file":
        found = list(edges)
    else:
        raise ValueError(f"unknown topology {name!r}; choose one of {', '.join(TOPOLOGIES)}")
    return Topology.from_edges(name, n, found, offsets=offsets)
