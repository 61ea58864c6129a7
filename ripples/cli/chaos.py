"""`ripples chaos`: seeded fault-injection trials of real runs (the harness is
ripples.bench.chaos; this module is its command line)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ripples.bench.chaos import (
    ELASTIC_PROTOCOLS,
    FAULT_KINDS,
    LOCKSTEP_PROTOCOLS,
    ChaosConfig,
    format_summary,
    run_trials,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ChaosConfig()
    parser.add_argument("--trials", type=int, default=d.trials, help="trials to run (default: 1)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="trial i uses seed + i for its run and its faults (default: 0)")
    parser.add_argument("--workers", type=int, default=d.workers,
                        help=f"workers per run (default: {d.workers})")
    parser.add_argument("--iterations", type=int, default=d.iterations,
                        help=f"per-worker iteration budget (default: {d.iterations})")
    parser.add_argument("--lease-seconds", type=float, default=d.lease_seconds,
                        help=f"the runs' lease (default: {d.lease_seconds})")
    parser.add_argument("--faults", default=",".join(d.faults),
                        help=f"fault kinds, comma-separated, from: {', '.join(FAULT_KINDS)} "
                             f"(default: {','.join(d.faults)})")
    parser.add_argument("--faults-per-trial", type=int, default=d.faults_per_trial,
                        help=f"faults injected per trial (default: {d.faults_per_trial})")
    parser.add_argument("--min-accuracy", type=float, default=d.min_accuracy,
                        help=f"accuracy floor of the averaged final model "
                             f"(default: {d.min_accuracy})")
    parser.add_argument("--deadline-seconds", type=float, default=d.deadline_seconds,
                        help="every process of a trial must have exited by then, else HANG "
                             f"(default: {d.deadline_seconds:.0f})")
    parser.add_argument("--workdir", default="",
                        help="keep every trial's logs and models here (default: a temporary "
                             "folder; failing trials are kept and named)")
    parser.add_argument("--protocol", default=d.protocol,
                        help=f"{', '.join(ELASTIC_PROTOCOLS)} (replacements heal) or "
                             f"{', '.join(LOCKSTEP_PROTOCOLS)} (restart rounds) "
                             f"(default: {d.protocol})")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                        help="workers checkpoint every N steps, and every checkpoint must "
                             f"load at the end; 0: none (default: {d.checkpoint_every})")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_command(args: argparse.Namespace) -> int:
    try:
        config = ChaosConfig(
            trials=args.trials, seed=args.seed, workers=args.workers,
            iterations=args.iterations, lease_seconds=args.lease_seconds,
            faults=tuple(k.strip() for k in args.faults.split(",") if k.strip()),
            faults_per_trial=args.faults_per_trial, min_accuracy=args.min_accuracy,
            deadline_seconds=args.deadline_seconds, protocol=args.protocol,
            checkpoint_every=args.checkpoint_every,
            workdir=Path(args.workdir) if args.workdir else None)
    except ValueError as err:
        print(f"ripples chaos: error: {err}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    summary = run_trials(config, lambda r: print(r.line(), file=out, flush=True))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0 if summary["failed"] == 0 else 1
