"""Sums over the live workers, kept in O(1) per report (pure code).

Two checks run at every report of every worker: the iteration budget (stop.py) and a
watched target loss (progress.py). Summing n workers' numbers at each of n workers'
reports costs O(n) per report: at 10,000 workers, most of the core's time. So each check
keeps running sums over the live workers instead: a report replaces its worker's values
in them, and they are summed afresh whenever the live set changes (the registry's
`version`) and, for float values, after `resum_every` x n updates, so that no rounding
drift builds up. The sums only say when the exact check is worth running; the check
itself stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ripples.coordinator.registry import WorkerRecord

Values = tuple[float, ...]


class LiveSums:
    """Per-component sums of `values(w)` over the live workers, less the workers whose
    values are `missing` (counted apart, as `missing`)."""

    def __init__(self, values: Callable[[WorkerRecord], Values],
                 missing: Callable[[Values], bool], *, width: int,
                 resum_every: int = 0) -> None:
        self._values = values
        self._missing = missing
        self._width = width
        self._resum_every = resum_every
        self._version = -1
        self._seen: dict[int, Values] = {}
        self._updates = 0
        self.totals: list[float] = [0] * width  # ints stay exact (iteration budgets)
        self.missing = 0
        """Live workers whose values are missing (not in the totals)."""

    @property
    def count(self) -> int:
        """Live workers, missing ones included."""
        return len(self._seen)

    def refresh(self, version: int, live: Callable[[], Iterable[WorkerRecord]],
                touched: WorkerRecord | None,
                is_live: Callable[[int], bool] | None = None) -> None:
        """`touched`'s values may have changed; `version` is the live set's. `is_live`:
        whether `touched` counts though the last sum did not hold it (a worker that
        became live without a new version; default: only the workers summed)."""
        drifted = self._resum_every and self._updates > self._resum_every * len(self._seen)
        if version != self._version or drifted:
            self._version, self._updates = version, 0
            self._seen.clear()
            self.totals = [0] * self._width
            self.missing = 0
            for w in live():
                self._add(w.worker_id, self._values(w))
        elif touched is not None and (touched.worker_id in self._seen if is_live is None
                                      else is_live(touched.worker_id)):
            self._updates += 1
            self._add(touched.worker_id, self._values(touched),
                      self._seen.get(touched.worker_id))

    def _add(self, worker_id: int, values: Values, old: Values | None = None) -> None:
        if old is not None:
            if self._missing(old):
                self.missing -= 1
            else:
                for i, v in enumerate(old):
                    self.totals[i] -= v
        self._seen[worker_id] = values
        if self._missing(values):
            self.missing += 1
        else:
            for i, v in enumerate(values):
                self.totals[i] += v
