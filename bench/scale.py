"""`python -m ripples.bench.scale`: one coordinator against shard coordinators, simulated.

Runs `ripples simulate`'s engine (the real coordinator core, simulated workers) flat and
sharded at each size, side by side with the same seed, and prints per run: simulated
seconds per epoch, wait fraction, consensus distance (averaged over the run's second
half), the core's decisions per second,
and the RPCs per second the busiest coordinator must serve, as a multiple of what the
gRPC service answers here (`--capacity`, measured with ripples.bench.coordinator_load).
With `--service-seconds` the coordinators also serve their RPCs one at a time, so an
overloaded one slows the run down in simulated time.

    python -m ripples.bench.scale                          # 1,000, 10,000, 100,000 workers
    python -m ripples.bench.scale --workers 1000,10000 --service-seconds 0.000097
    python -m ripples.bench.scale --markdown --plot docs/img/scale

Shards default to one per 1,000 workers (at least 4); `--plot PREFIX` writes
PREFIX-load.png (the busiest coordinator's RPCs/s against workers) and
PREFIX-consensus.png (consensus distance over simulated time, at the largest size with
runs of 30 iterations a worker at least).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ripples.sim.config import SimConfig, SimResult
from ripples.sim.engine import simulate
from ripples.sim.models import ComputeModel, ConsensusModel

CAPACITY_RPCS_PER_SECOND = 10_304.0
"""RPCs per second the gRPC coordinator answers on this 2-core machine: 2 x 5,152, the
group requests it answered per second at 1,024 streams back to back, each with its
release (ripples.bench.coordinator_load, docs/scale.md); a heartbeat is assumed to cost
as much as a release."""
WORKERS_PER_SHARD = 1_000


@dataclass(frozen=True, kw_only=True)
class ScaleRun:
    workers: int
    shards: int
    iterations: int
    data_blocks: int
    """Blocks of hosts whose data differ (with --data-skew): the sharded run's shards, for
    the flat run too, so that both see the same data."""


def default_runs(levels: list[int]) -> list[ScaleRun]:
    """Flat and sharded at each size; fewer iterations per worker at larger sizes (the
    simulation's cost grows with workers x iterations)."""
    runs = []
    for n in levels:
        iterations = max(4, min(60, 600_000 // n))
        sharded = max(4, n // WORKERS_PER_SHARD)
        for shards in (1, sharded):
            runs.append(ScaleRun(workers=n, shards=shards, iterations=iterations,
                                 data_blocks=sharded))
    return runs


def run_one(run: ScaleRun, base: SimConfig) -> SimResult:
    print(f"simulating {run.workers:,} workers, {run.shards} shard(s), {run.iterations} "
          "iterations ...", file=sys.stderr, flush=True)
    return simulate(replace(base, workers=run.workers, shards=run.shards,
                            iterations=run.iterations, data_blocks=run.data_blocks))


def format_rows(results: list[SimResult], capacity: float, *, markdown: bool) -> str:
    header = ["workers", "coordinators", "s/epoch", "wait", "consensus distance (mean)",
              "decisions/s (core)", "busiest coordinator RPC/s", "x service capacity"]
    rows = []
    for r in results:
        coordinators = "1 (flat)" if r.shards == 1 else f"{r.shards} shards + root"
        rows.append([f"{r.workers:,}", coordinators, f"{r.seconds_per_epoch:.1f}",
                     f"{r.wait_fraction:.1%}", f"{r.mean_consensus_distance:.3g}",
                     f"{r.decisions_per_second:,.0f}", f"{r.coordinator_rpcs_per_second:,.0f}",
                     f"{r.coordinator_rpcs_per_second / capacity:.2f}"])
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|"]
        return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
                     for r in table)


def write_plots(results: list[SimResult], capacity: float, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [Path(f"{prefix}-load.png"), Path(f"{prefix}-consensus.png")]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, pick in (("one coordinator", lambda r: r.shards == 1),
                        ("busiest shard coordinator", lambda r: r.shards > 1)):
        points = sorted((r.workers, r.coordinator_rpcs_per_second) for r in results if pick(r))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.axhline(capacity, color="grey", linestyle="--",
               label=f"the gRPC service here ({capacity:,.0f} RPCs/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("RPCs per second to serve")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    # The largest size whose runs are long enough for a curve (30 iterations a worker).
    long_enough = [r.workers for r in results if r.iterations >= 30 * r.workers]
    largest = max(long_enough or [r.workers for r in results])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in results:
        if r.workers == largest:
            label = "one coordinator" if r.shards == 1 else f"{r.shards} shards + root"
            ax.plot([t for t, _ in r.consensus_curve],
                    [max(d, 1e-12) for _, d in r.consensus_curve], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("consensus distance")
    ax.set_title(f"{largest:,} workers, ripples-smart")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1000,10000,100000")
    parser.add_argument("--protocol", default="ripples-smart",
                        choices=["ripples-smart", "ripples-random"])
    parser.add_argument("--workers-per-host", type=int, default=8)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--inter-period", type=int, default=4)
    parser.add_argument("--service-seconds", type=float, default=0.0,
                        help="coordinator time per RPC (0: instant; 0.000097 is the service "
                             "measured here)")
    parser.add_argument("--data-skew", type=float, default=0.0,
                        help="the share of the workers' data spread that each shard's hosts "
                             "have in common (0: none; 1: a shard's workers share one "
                             "optimum); the flat run at each size gets the same data")
    parser.add_argument("--capacity", type=float, default=CAPACITY_RPCS_PER_SECOND)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--plot", default="", metavar="PREFIX")
    args = parser.parse_args(argv)
    try:
        levels = [int(w) for w in args.workers.split(",") if w]
        base = SimConfig(protocol=args.protocol, workers_per_host=args.workers_per_host,
                         inter_period=args.inter_period, seed=args.seed,
                         service_seconds=args.service_seconds,
                         compute=ComputeModel(step_seconds=args.step_seconds),
                         consensus=ConsensusModel(data_skew=args.data_skew))
        runs = default_runs(levels)
        for run in runs:  # every configuration is checked before the first one runs
            replace(base, workers=run.workers, shards=run.shards, iterations=run.iterations)
        for run in runs:  # (the shards first: their error names what to change)
            replace(base, workers=run.workers, shards=run.shards, iterations=run.iterations,
                    data_blocks=run.data_blocks)
    except ValueError as err:
        parser.error(str(err))
    results = [run_one(run, base) for run in runs]
    print(format_rows(results, args.capacity, markdown=args.markdown))
    if args.plot:
        paths = write_plots(results, args.capacity, args.plot)
        print(f"wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
