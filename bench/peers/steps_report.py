"""Where a peer run's steps went: `python -m ripples.bench.peers.steps_report RUN_DIR...`.

From the workers' step logs (progress.py), per run: steps per second of a worker, the
share of the wall time spent inside the peer system's calls, and how those calls are
spread over steps (median, 99th percentile, the longest, and how many steps were blocked
for over a second, e.g. hivemind's step that waits for the averaging round at the end of
each of its epochs). It is how docs/benchmarks.md explains a peer's time to target.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from ripples.bench.peers.progress import StepRecord, read_step_logs

BLOCKED_SECONDS = 1.0


def per_step(records: list[StepRecord]) -> tuple[list[float], list[float]]:
    """One worker's compute and synchronisation seconds of each step."""
    compute, sync = [], []
    previous_c = previous_s = 0.0
    for r in sorted(records, key=lambda r: r.iteration):
        compute.append(r.compute_seconds - previous_c)
        sync.append(r.sync_seconds - previous_s)
        previous_c, previous_s = r.compute_seconds, r.sync_seconds
    return compute, sync


def report(directory: Path) -> dict[str, object]:
    summary = json.loads((directory / "summary.json").read_text())
    records = read_step_logs(directory, int(summary["num_workers"]))
    wall = float(summary["wall_seconds"]) or 1.0
    syncs: list[float] = []
    computes: list[float] = []
    sync_share = []
    for rank in sorted({r.rank for r in records}):
        compute, sync = per_step([r for r in records if r.rank == rank])
        syncs += sync
        computes += compute
        sync_share.append(sum(sync) / wall)
    ordered = sorted(syncs)
    return {
        "run": str(directory), "protocol": summary["protocol"],
        "steps_per_second_per_worker": len(syncs) / len(sync_share) / wall,
        "compute_median_seconds": statistics.median(computes),
        "sync_share_of_wall": statistics.mean(sync_share),
        "sync_median_seconds": statistics.median(ordered),
        "sync_p99_seconds": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "sync_max_seconds": ordered[-1],
        "blocked_steps": sum(s > BLOCKED_SECONDS for s in syncs),
        "blocked_seconds": sum(s for s in syncs if s > BLOCKED_SECONDS) / len(sync_share),
        "steps": len(syncs),
    }


def main(argv: list[str] | None = None) -> int:
    dirs = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not dirs:
        print("usage: python -m ripples.bench.peers.steps_report RUN_DIR...", file=sys.stderr)
        return 2
    print("| run | steps/s per worker | compute median | sync share of wall | sync median | "
          "sync p99 | sync max | steps blocked > 1 s | blocked s per worker |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in dirs:
        r = report(d)
        print(f"| {d.name} | {r['steps_per_second_per_worker']:.2f} | "
              f"{r['compute_median_seconds']:.3f} s | {r['sync_share_of_wall']:.0%} | "
              f"{r['sync_median_seconds']:.3f} s | {r['sync_p99_seconds']:.2f} s | "
              f"{r['sync_max_seconds']:.2f} s | {r['blocked_steps']} of {r['steps']} | "
              f"{r['blocked_seconds']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
