"""What storing a registration costs at scale: a whole rewrite against an incremental save.

A coordinator with a state dir stores every registration before it answers (a restarted
coordinator must know every worker it named). It used to rewrite the whole run, every
worker's row, at each Register: at 2,000 workers each call took 40 times as long as
at the start. It now stores the new worker's row and the run's changed keys
(coordinator/state_store.py). This bench registers `--workers` workers into one run's
core twice, side by side in one process, timing each registration with its save:

- whole: the core's registration, a snapshot of every worker, every row written (the
  former save);
- incremental: the registration, a snapshot of the new worker alone, the rows that
  changed written (StateStore.save with snapshot.take's `only`, as Register does now).

    python -m ripples.bench.state_store                  # 2,000 workers
    python -m ripples.bench.state_store --workers 500

Prints the mean milliseconds per call over the first and the last 100 registrations of
each, and the ratio whole / incremental at the last ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ripples.coordinator import snapshot
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.state_store import SCHEMA, StateStore, open_database

WINDOW = 100
"""Registrations averaged at the start and at the end."""


def _whole_rewrite(path: Path) -> Callable[[dict[str, Any]], None]:
    """The former StateStore.save: every run key and every worker row, each time."""
    db = open_database(path, SCHEMA, "bench the whole rewrite")

    def save(data: dict[str, Any]) -> None:
        run = [(key, json.dumps(value)) for key, value in data.items() if key != "workers"]
        workers = [(w["worker_id"], json.dumps(w)) for w in data["workers"]]
        with db:
            db.executemany("INSERT OR REPLACE INTO run VALUES (?, ?)", run)
            db.executemany("INSERT OR REPLACE INTO workers VALUES (?, ?)", workers)

    return save


def register_all(workers: int, directory: Path, *, whole: bool) -> list[float]:
    """Seconds per registration (with its save) of `workers` workers into a new run."""
    # More expected workers than register: the membership never forms (no full save).
    settings = RunSettings.build(num_workers=workers + 1, task="digits")
    core = CoordinatorCore(settings, now=0.0)
    store = StateStore(directory / ("whole" if whole else "incremental"))
    rewrite = _whole_rewrite(directory / "whole.db") if whole else None
    times = []
    for i in range(workers):
        began = time.perf_counter()
        worker_id = core.register(f"host{i // 8}", i % 8, "cpu", 1000 + i, 0.0)
        if rewrite is not None:
            rewrite(snapshot.take(core, 0.0, 0.0))
        else:
            store.save(snapshot.take(core, 0.0, 0.0, only=[worker_id]))
        times.append(time.perf_counter() - began)
    store.close()
    return times


def _ms(times: list[float]) -> float:
    return 1000 * sum(times) / len(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.state_store",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2000,
                        help=f"registrations per run (at least {2 * WINDOW})")
    args = parser.parse_args(argv)
    if args.workers < 2 * WINDOW:
        parser.error(f"--workers: give at least {2 * WINDOW}")
    with tempfile.TemporaryDirectory(prefix="ripples-bench-state-") as tmp:
        results = {whole: register_all(args.workers, Path(tmp), whole=whole)
                   for whole in (True, False)}
    print(f"ms per Register with its save ({args.workers} workers; first / last {WINDOW}):")
    for whole, name in ((True, "whole rewrite"), (False, "incremental")):
        times = results[whole]
        print(f"  {name:14} {_ms(times[:WINDOW]):7.2f} / {_ms(times[-WINDOW:]):7.2f}")
    ratio = _ms(results[True][-WINDOW:]) / _ms(results[False][-WINDOW:])
    print(f"  ratio whole / incremental at {args.workers} workers: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
