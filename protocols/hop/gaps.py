"""The check of a hop run against Table 1's bound on iteration gaps: the launcher replays
the workers' recorded iterations after a run (`summarise`, the spec's summary hook)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ripples.protocols.hop.settings import HopSettings

logger = logging.getLogger(__name__)


def graph_distances(out_neighbours: Mapping[int, Iterable[int]]) -> dict[tuple[int, int], int]:
    """Hops along directed edges from every worker to every worker it reaches (BFS)."""
    dist: dict[tuple[int, int], int] = {}
    for src in out_neighbours:
        seen, frontier = {src: 0}, deque([src])
        while frontier:
            u = frontier.popleft()
            for v in out_neighbours.get(u, ()):
                if v not in seen:
                    seen[v] = seen[u] + 1
                    frontier.append(v)
        dist.update({(src, v): d for v, d in seen.items()})
    return dist


@dataclass(kw_only=True)
class GapReport:
    """Every iteration gap observed in a run, checked against Table 1's bound."""

    events: int
    """Iteration changes replayed (every worker's, merged in time order)."""
    max_gap: int
    """The largest Iter(i) - Iter(j) seen over every ordered pair."""
    max_bound: int
    """The largest bound of any pair (how far the setting lets workers drift)."""
    tightest: float
    """The largest gap / bound seen (1.0: some pair reached its bound)."""
    num_violations: int
    """Gaps over their bound (per ordered pair and change; 0: Theorems 1-2 held)."""
    violations: list[str]
    """The first of them, described."""


def check_iteration_gaps(timelines: Mapping[int, Sequence[Sequence[float]]],
                         out_neighbours: Mapping[int, Sequence[int]],
                         settings: HopSettings, max_reported: int = 10) -> GapReport:
    """Replay the workers' iteration timelines, [(time, iteration entered), ...] on one
    clock, in time order and check after every change that Iter(i) - Iter(j) stays within
    settings.gap_bound for every ordered pair. Every worker starts at iteration 0.

    The runtime stamps an iteration before it sends the credits and updates that let
    others move on, so a gap the protocol holds can never appear larger in the replay."""
    dist = graph_distances(out_neighbours)
    workers = sorted(timelines)
    unreachable = 10**9  # hops to a worker no path reaches: nothing bounds that gap
    bounds = {(i, j): settings.gap_bound(dist.get((i, j), unreachable),
                                         dist.get((j, i), unreachable))
              for i in workers for j in workers if i != j}
    events = sorted((float(t), w, int(it)) for w, line in timelines.items() for t, it in line)
    now = dict.fromkeys(workers, 0)
    max_gap, tightest, num_violations = 0, 0.0, 0
    violations: list[str] = []
    for t, w, it in events:
        now[w] = it  # only w's lead over the others can have grown
        for j in workers:
            if j == w:
                continue
            gap, bound = it - now[j], bounds[(w, j)]
            max_gap = max(max_gap, gap)
            if bound > 0:
                tightest = max(tightest, gap / bound)
            if gap > bound:
                num_violations += 1
                if len(violations) < max_reported:
                    violations.append(f"t={t:.3f}: Iter({w}) - Iter({j}) = {it} - {now[j]} "
                                      f"= {gap} > bound {bound}")
    return GapReport(events=len(events), max_gap=max_gap,
                     max_bound=max(bounds.values(), default=0), tightest=tightest,
                     num_violations=num_violations, violations=violations)


WORKER_FIELDS = ("iteration", "jumps", "iterations_skipped", "stale_updates",
                 "updates_not_sent")
"""What summary.json shows of each worker's hop record (the timeline is too long)."""


def summarise(records: Mapping[int, Mapping[str, Any]], config: Any
              ) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """The launcher's hook: per rank the worker's hop counters, and for the run every
    iteration gap the workers' recorded timelines show, checked against Table 1's bound
    (the workers of a local run share the host's monotonic clock).

    Args:
        records: per rank, the record the worker's hop runtime wrote (`record()`).
        config: the run's RunConfig message.
    """
    per_worker = {rank: {k: rec[k] for k in WORKER_FIELDS} for rank, rec in records.items()}
    report = check_iteration_gaps(
        {r["worker_id"]: r["iteration_timeline"] for r in records.values()},
        {r["worker_id"]: r["out_neighbours"] for r in records.values()},
        HopSettings.of_config(config))
    if report.num_violations:
        logger.error("hop iteration gaps over Table 1's bound: %s", report.violations)
    return per_worker, {"hop_iteration_gaps": asdict(report)}
