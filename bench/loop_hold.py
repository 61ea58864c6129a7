"""How long the coordinator's event loop is held per state save and per run status.

At the largest allowed run (MAX_WORKERS: 100,000 workers) a periodic save took its whole
snapshot on the loop (1.6 s, every 0.5 s) and one GetRunStatus built every worker's row
(0.7-0.8 s). Now a save copies the values on the loop (snapshot.capture) and makes the
JSON rows in the saver's thread, every save_interval (10 s at 100,000 workers); a status
lists MAX_STATUS_WORKERS rows and counts the rest. This builds a training a2cid2 core on
an exponential graph (8 workers per host; no sockets), freezes its heap as the service
does at the start, then times, side by side:

- snapshot, before: snapshot.take on the loop (its rows made with dataclasses.asdict);
- snapshot, now: snapshot.capture on the loop (the rows follow in the saver's thread);
- status, before: every worker's row (all_workers, what every status was);
- status, now: the default, bounded status.

    python -m ripples.bench.loop_hold                    # 100,000 workers
    python -m ripples.bench.loop_hold --workers 10000

Prints the median milliseconds of each over --repeats calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from ripples.coordinator import heap, run_graph, snapshot, status_view
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, Progress
from ripples.coordinator.registry import WorkerRecord

WORKERS_PER_NODE = 8


def training_core(num_workers: int) -> CoordinatorCore:
    """A2CiD2 on an exponential graph, every worker registered, ready and one progress
    report in; the heap frozen (heap.settle, as at a run's start)."""
    settings = RunSettings.build(protocol="a2cid2", topology="exponential",
                                 num_workers=num_workers, workers_per_node=WORKERS_PER_NODE,
                                 iterations=10**9, lease_seconds=7 * 24 * 3600.0)
    core = CoordinatorCore(settings, now=0.0)
    core.prepared_graph = run_graph.prepare(settings)
    ids = [core.register(f"node{i // WORKERS_PER_NODE}", i % WORKERS_PER_NODE, "cpu", i, 0.0)
           for i in range(num_workers)]
    for wid in ids:
        core.mark_ready(wid, 10**9, 0.0)
    for wid in ids:
        core.heartbeat(wid, Progress(iteration=1, loss=1.0, samples=32, compute_seconds=1.0),
                       1.0)
    heap.settle()
    return core


def _asdict_row(w: WorkerRecord) -> dict[str, Any]:
    """The former snapshot._worker: a deep copy of the record, field by field."""
    fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)
              if f.name not in snapshot._TRANSIENT}
    fields["state"] = w.state.value
    fields["progress"] = dataclasses.asdict(w.progress)
    fields["own_base"] = list(w.own_base)
    return fields


def _before_take(core: CoordinatorCore) -> dict[str, Any]:
    data = snapshot.capture(core, 2.0, 2.0, only=())
    return {**data.run, "workers": [_asdict_row(w) for w in core.workers.values()]}


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - began)
        del result  # freed outside the timed part, as the saver's thread frees it
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.loop_hold",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=100_000, help="workers in the run")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (median)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.repeats < 1:
        parser.error("--workers and --repeats: give at least 1")
    core = training_core(args.workers)
    one = next(iter(core.workers))

    def status(all_workers: bool) -> object:
        return status_view.run_status(core, 2.0, metrics_address="", metrics_targets={},
                                      all_workers=all_workers)

    rows = [
        ("snapshot (whole)", lambda: _before_take(core),
         lambda: snapshot.capture(core, 2.0, 2.0)),
        ("snapshot (one worker)", lambda: snapshot.take(core, 2.0, 2.0, only=[one]),
         lambda: snapshot.capture(core, 2.0, 2.0, only=[one])),
        ("run status", lambda: status(True), lambda: status(False)),
    ]
    print(f"ms the event loop is held ({args.workers:,} workers, a2cid2, exponential; "
          f"median of {args.repeats}):")
    print(f"  {'':22} {'before':>9} {'now':>9}")
    for name, before, now in rows:
        print(f"  {name:22} {_median_ms(before, args.repeats):9.1f} "
              f"{_median_ms(now, args.repeats):9.1f}")
    heap.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
