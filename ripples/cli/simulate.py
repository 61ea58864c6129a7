"""`ripples simulate`: run simulated runs side by side and print what they measured.

    ripples simulate --workers 1000 --protocol ripples-smart --scenario slow-5x
    ripples simulate --workers 64,1000 --protocol allreduce,ripples-smart,adpsgd --json
    ripples simulate --workers 1000 --protocol ripples-smart,adpsgd --plot consensus.png
    ripples simulate --workers 10000 --shards 1,10 --service-seconds 0.0002  # flat vs sharded
    ripples simulate --workers 1000 --protocol allreduce,ripples-smart \
        --set local_steps=16 --set outer_optimizer=nesterov --set outer_lr=0.7   # DiLoCo's form

Every (protocol, workers, shards) is one simulated run of the same scenario and seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from ripples.cli.arguments import add_dataclass_arguments, dataclass_from_args, scalar
from ripples.sim.config import SimConfig, SimResult, sim_protocols

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("protocol", "protocol", "{}"),
    ("workers", "workers", "{}"),
    ("shards", "shards", "{}"),
    ("s/epoch", "seconds_per_epoch", "{:.3f}"),
    ("s/iter", "seconds_per_iteration", "{:.4f}"),
    ("wait", "wait_fraction", "{:.1%}"),
    ("comm", "comm_fraction", "{:.1%}"),
    ("conflict", "conflict_fraction", "{:.1%}"),
    ("group size", "mean_group_size", "{:.2f}"),
    ("consensus", "consensus_distance", "{:.3g}"),
    ("consensus 2nd half", "mean_consensus_distance", "{:.3g}"),
    ("sync B/iter", "bytes_per_worker_iteration", "{:.3g}"),
    ("decisions/s", "decisions_per_second", "{:,.0f}"),
    ("coord RPC/s", "coordinator_rpcs_per_second", "{:,.0f}"),
    ("coord busy", "coordinator_utilization", "{:.0%}"),
    ("heartbeats/s", "heartbeats_per_second", "{:,.0f}"),
    ("B/worker", "core_bytes_per_worker", "{:,.0f}"),
    ("wall s", "wall_seconds", "{:.1f}"),
)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one number")
    return values


def _protocol_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in sim_protocols()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown protocol(s) {', '.join(unknown) or '(none)'}; the simulator runs "
            f"{', '.join(sim_protocols())}")
    return names


def _run_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.replace("-", "_"), scalar(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--protocol", type=_protocol_list, default=["ripples-smart"],
                        help=f"protocol(s), comma-separated, from {', '.join(sim_protocols())} "
                             "(default: ripples-smart)")
    parser.add_argument("--workers", type=_int_list, default=[64],
                        help="simulated workers, comma-separated for a sweep (default: 64)")
    parser.add_argument("--set", dest="run_options", action="append", type=_run_option,
                        default=[], metavar="KEY=VALUE",
                        help="a run option as `ripples run` takes it (group_size=4, "
                             "topology=ring, rate_com=2, heartbeat_interval_seconds=1, "
                             "local_steps=16, outer_optimizer=nesterov, outer_lr=0.7, "
                             "outer_momentum=0.5); repeatable")
    parser.add_argument("--shards", type=_int_list, default=[1],
                        help="1: one coordinator (flat); S: S shard coordinators and a root "
                             "one of their heads (docs/scale.md); comma-separated to compare "
                             "(default: 1)")
    add_dataclass_arguments(parser, SimConfig,
                            skip={"protocol", "workers", "run_options", "shards"})
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (one object with a list `runs`)")
    parser.add_argument("--plot", default="",
                        help="write the consensus distance over simulated time to this PNG")


def configs(args: argparse.Namespace) -> list[SimConfig]:
    base: SimConfig = dataclass_from_args(SimConfig, args, protocol=args.protocol[0],
                                          workers=args.workers[0], shards=args.shards[0],
                                          run_options=dict(args.run_options))
    return [replace(base, protocol=p, workers=n, shards=s)
            for n in args.workers for s in args.shards for p in args.protocol]


def format_table(results: list[SimResult]) -> str:
    rows = [[header for header, _, _ in COLUMNS]]
    for r in results:
        data = r.summary()
        rows.append([fmt.format(data[key]) for _, key, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in rows]
    return "\n".join(lines)


def write_plot(results: list[SimResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        xs = [t for t, _ in r.consensus_curve]
        ys = [max(d, 1e-12) for _, d in r.consensus_curve]
        shards = f", {r.shards} shards" if r.shards > 1 else ""
        ax.plot(xs, ys, label=f"{r.protocol} ({r.workers} workers{shards})")
    ax.set_yscale("log")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("consensus distance")
    ax.set_title(f"scenario {results[0].scenario}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_command(args: argparse.Namespace) -> int:
    from ripples.sim.engine import simulate

    try:
        runs = configs(args)
        for config in runs:  # every configuration is checked before the first run starts
            config.settings()
    except ValueError as err:
        print(f"ripples simulate: error: {err}", file=sys.stderr)
        return 2
    results = []
    for config in runs:
        if not args.json:
            shards = f" in {config.shards} shards" if config.shards > 1 else ""
            print(f"simulating {config.protocol} with {config.workers} workers{shards} "
                  f"({config.compute.scenario}) ...", file=sys.stderr, flush=True)
        results.append(simulate(config))
    if args.plot:
        write_plot(results, args.plot)
    if args.json:
        print(json.dumps({"runs": [r.summary() for r in results]}))
    else:
        print(format_table(results))
        for r in results:
            if r.stop_reason.startswith("stalled"):
                print(f"{r.protocol} ({r.workers} workers): {r.stop_reason}")
        if args.plot:
            print(f"consensus distance plot: {args.plot}")
    return 1 if any(r.stop_reason.startswith("stalled") for r in results) else 0
