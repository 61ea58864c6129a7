"""Rule-based, conflict-free static schedule of synchronization groups (paper section 4.2).

Instead of asking the Group Generator, every worker computes its group for an iteration
from its rank with a pure function, so all members of a group agree on it without any
communication, and no two groups of one iteration overlap (no P-Reduce ever waits on
another). Global rank = ``node * workers_per_node + local_rank``; "LW i" below is local
worker i of a node, N the number of nodes and K the workers per node.

The schedule repeats every ``PERIOD = 4`` iterations; phase = iteration % 4:

* Phases 1 and 3 (intra-node): the K workers of each node form one group.
* Phase 0: LW0 of every node form one inter-node group. LW1 does not sync. LW2..LW(K-1)
  pair consecutively, (2, 3), (4, 5), ...; an unpaired last worker does not sync.
* Phase 2: LW1 pairs with LW1 of the opposite node on the ring. LW0 pairs with LW(K-1).
  LW2 does not sync. LW3..LW(K-2) pair consecutively, (3, 4), (5, 6), ...; an unpaired
  last worker does not sync.

With K = 4 this is exactly Figure 10 of the paper, and with N = 4 it gives Figure 9.

Generalisation to any N >= 1 and K >= 1:

* Opposite node: with N even, node n pairs with ``(n + N/2) % N``. With N odd, nodes
  0..N-2 use that rule on a ring of N-1 nodes and node N-1 does not pair (a perfect
  matching of an odd ring is impossible); with N = 1 there is no opposite node.
* K = 1: LW0 takes LW1's role in phase 2 (it pairs with the opposite node), so a
  one-worker-per-node cluster still has two inter-node exchanges per period.
* K = 2: LW0 would pair with LW(K-1) = LW1, which is busy with the inter-node pair, so
  LW0 does not sync in phase 2.
* K = 3: LW(K-1) is LW2, so LW2 pairs with LW0 rather than skipping.
* Groups of one worker are dropped: a worker in no group skips synchronization in that
  iteration (like the "-" cells of Figure 9).

Every period connects all workers: phases 1/3 join the workers of each node and the
phase-0 LW0 group joins the nodes, so gossip averaging reaches the whole cluster.
"""

from __future__ import annotations

PERIOD = 4


def _check(iteration: int, num_nodes: int, workers_per_node: int) -> None:
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if workers_per_node < 1:
        raise ValueError(f"workers_per_node must be >= 1, got {workers_per_node}")


def _opposite_node(node: int, num_nodes: int) -> int | None:
    """The node whose inter-node worker pairs with this node's in phase 2, or None."""
    if num_nodes % 2 == 0:
        return (node + num_nodes // 2) % num_nodes
    ring_size = num_nodes - 1  # even; the last node sits out
    if node == ring_size or ring_size == 0:
        return None
    return (node + ring_size // 2) % ring_size


def _inter_node_local_rank(workers_per_node: int) -> int:
    """The local worker that pairs across nodes in phase 2 (LW1, or LW0 when K == 1)."""
    return 1 if workers_per_node >= 2 else 0


def static_groups(iteration: int, num_nodes: int, workers_per_node: int) -> list[tuple[int, ...]]:
    """All synchronization groups of one iteration.

    Args:
        iteration: Training iteration, >= 0.
        num_nodes: Number of nodes N, >= 1.
        workers_per_node: Workers per node K, >= 1.

    Returns:
        Disjoint groups, each a sorted tuple of >= 2 global ranks, sorted by first rank.
        Ranks in no group skip synchronization in this iteration.

    Raises:
        ValueError: If an argument is out of range.
    """
    _check(iteration, num_nodes, workers_per_node)
    k = workers_per_node
    phase = iteration % PERIOD
    groups: list[tuple[int, ...]] = []
    if phase in (1, 3):
        if k >= 2:
            groups = [tuple(range(n * k, (n + 1) * k)) for n in range(num_nodes)]
    elif phase == 0:
        if num_nodes >= 2:
            groups.append(tuple(n * k for n in range(num_nodes)))
        for n in range(num_nodes):
            groups += [(n * k + lw, n * k + lw + 1) for lw in range(2, k - 1, 2)]
    else:
        lw_inter = _inter_node_local_rank(k)
        for n in range(num_nodes):
            other = _opposite_node(n, num_nodes)
            if other is not None and other > n:
                groups.append((n * k + lw_inter, other * k + lw_inter))
            if k >= 3:
                groups.append((n * k, n * k + k - 1))
            groups += [(n * k + lw, n * k + lw + 1) for lw in range(3, k - 2, 2)]
    return sorted(groups)


def _consecutive_partner(local_rank: int, first: int, last: int) -> int | None:
    """Partner of ``local_rank`` when ``first..last`` pair up as (first, first+1), ..."""
    partner = local_rank + 1 if (local_rank - first) % 2 == 0 else local_rank - 1
    return partner if partner <= last else None


def _local_partner(phase: int, local_rank: int, workers_per_node: int) -> int | None:
    """Intra-node partner of a local worker in phase 0 or 2, or None if it has none."""
    k = workers_per_node
    if phase == 0:
        return _consecutive_partner(local_rank, 2, k - 1) if local_rank >= 2 else None
    if k < 3:  # K == 2: LW(K-1) is LW1, busy across nodes; K == 1: nobody local
        return None
    if local_rank == 0:
        return k - 1
    if local_rank == k - 1:  # before the LW2 rule: with K == 3, LW2 is LW(K-1)
        return 0
    if local_rank == 2:
        return None
    return _consecutive_partner(local_rank, 3, k - 2)


def static_group_of(
    iteration: int, rank: int, num_nodes: int, workers_per_node: int
) -> tuple[int, ...] | None:
    """The group of one worker in one iteration, computed from that worker's rule alone.

    Agrees with :func:`static_groups` (the tests check it) but costs O(group size).

    Args:
        iteration: Training iteration, >= 0.
        rank: Global rank, ``node * workers_per_node + local_rank``.
        num_nodes: Number of nodes N, >= 1.
        workers_per_node: Workers per node K, >= 1.

    Returns:
        The sorted group containing ``rank``, or None if the worker skips this iteration.

    Raises:
        ValueError: If an argument is out of range.
    """
    _check(iteration, num_nodes, workers_per_node)
    k = workers_per_node
    if not 0 <= rank < num_nodes * k:
        raise ValueError(f"rank must be in [0, {num_nodes * k}), got {rank}")
    node, local_rank = divmod(rank, k)
    phase = iteration % PERIOD
    if phase in (1, 3):
        return tuple(range(node * k, (node + 1) * k)) if k >= 2 else None
    if phase == 0 and local_rank == 0:
        return tuple(n * k for n in range(num_nodes)) if num_nodes >= 2 else None
    if phase == 2 and local_rank == _inter_node_local_rank(k):
        other = _opposite_node(node, num_nodes)
        return None if other is None else tuple(sorted((rank, other * k + local_rank)))
    partner = _local_partner(phase, local_rank, k)
    return None if partner is None else tuple(sorted((rank, node * k + partner)))


def schedule(num_nodes: int, workers_per_node: int, iterations: int) -> list[list[list[int]]]:
    """The groups of iterations ``0..iterations-1``, JSON-ready.

    Args:
        num_nodes: Number of nodes N, >= 1.
        workers_per_node: Workers per node K, >= 1.
        iterations: Number of iterations, >= 0.

    Returns:
        One entry per iteration: the list of its groups, each a sorted list of global ranks.

    Raises:
        ValueError: If an argument is out of range.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    _check(0, num_nodes, workers_per_node)
    return [
        [list(group) for group in static_groups(i, num_nodes, workers_per_node)]
        for i in range(iterations)
    ]
