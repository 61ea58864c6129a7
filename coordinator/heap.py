"""The coordinator's heap during a run: its long-lived objects kept out of the collector.

A run's worker records, registry indexes and run graph live as long as the run. Python's
cyclic garbage collector still walks every one of them in each full collection, and at
10,000+ workers those walks, not the decisions, were most of the core's time
(`ripples simulate --workers 30000`: 10,700 decisions per second with them, 35,200
once the heap is frozen: docs/scale.md). So when a run starts training, everything
alive is frozen (`gc.freeze`: moved to a permanent generation the collector skips), and
unfrozen when the run's service closes, so that a finished run's objects can be
collected again. Groups and decisions made during the run are collected as usual.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Training starts: collect once, then keep everything alive out of collections."""
    gc.collect()
    gc.freeze()


def release() -> None:
    """The run is over: its objects are the collector's again."""
    gc.unfreeze()
