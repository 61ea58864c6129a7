"""Hop's settings, Table 1's bound on iteration gaps, and the check of a run against it.

Pure code shared by the coordinator (validation), the worker (worker/protocols/hop/) and
the launcher, which replays the workers' recorded iterations against the bound after a
run (`summarise`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ripples.protocols.settings import ProtocolSettings

logger = logging.getLogger(__name__)

HOP_MODES = ("standard", "backup", "staleness")


@dataclass(frozen=True, kw_only=True)
class HopSettings(ProtocolSettings):
    """Hop's knobs; every field is validated by validate()."""

    proto_field = "hop"
    cli_names = {"mode": "hop_mode"}

    mode: str = "standard"
    """hop: standard (every in-neighbour's update each iteration), backup (backup workers:
    backup_workers updates may be missing) or staleness (updates up to `staleness`
    iterations old count, weighted by age)."""
    max_ig: int = 4
    """hop: token queues keep a worker at most this many iterations ahead of an
    out-neighbour."""
    backup_workers: int = 1
    """hop backup mode: updates per iteration a worker may go without (N_buw)."""
    staleness: int = 5
    """hop staleness mode: the oldest usable update is from iteration k - staleness."""
    max_jump: int = 0
    """hop: a straggler may skip up to this many iterations at once (0: never; needs
    backup or staleness mode, at most max_ig)."""
    skip_threshold: int = 2
    """hop: skip only when more than this many iterations behind every out-neighbour."""

    def validate(self) -> None:
        if self.mode not in HOP_MODES:
            raise ValueError(f"unknown hop mode {self.mode!r}; choose one of "
                             f"{', '.join(HOP_MODES)}")
        if self.max_ig < 1:
            raise ValueError(f"max_ig must be at least 1, got {self.max_ig}")
        if self.mode == "backup" and self.backup_workers < 1:
            raise ValueError(f"backup mode needs backup_workers >= 1, got {self.backup_workers}")
        if self.mode == "staleness" and self.staleness < 0:
            raise ValueError(f"staleness must be at least 0, got {self.staleness}")
        if self.max_jump < 0 or self.skip_threshold < 0:
            raise ValueError("max_jump and skip_threshold must be at least 0")
        if self.max_jump > 0 and self.mode == "standard":
            raise ValueError("skipping iterations needs backup workers or bounded staleness "
                             "(§5): in standard mode the neighbours would wait forever for the "
                             "updates of the skipped iterations")
        if self.max_jump > self.max_ig:
            raise ValueError(f"max_jump ({self.max_jump}) may not exceed max_ig "
                             f"({self.max_ig}): a longer jump could wait for updates that "
                             "the tokens keep the neighbours from sending")

    def gap_bound(self, hops_ahead: int, hops_behind: int) -> int:
        """Table 1: the most Iter(i) may exceed Iter(j), where j is `hops_ahead` hops
        downstream of i (i -> ... -> j) and i is `hops_behind` hops downstream of j.
        Tokens give max_ig per hop from i to j (Theorem 2, every mode); a Recv that waits
        for every in-neighbour gives b0 per hop from j to i (Theorem 1: 1 in standard
        mode, s + 1 with bounded staleness; backup workers give no such bound, and with
        skipping a worker enters an iteration before the Recv that would hold it)."""
        bound = self.max_ig * hops_ahead
        b0 = {"standard": 1, "staleness": self.staleness + 1}.get(self.mode)
        if b0 is None or self.max_jump > 0:  # a jump enters k before its Recv(k - 1)
            return bound
        return min(bound, b0 * hops_behind)


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
