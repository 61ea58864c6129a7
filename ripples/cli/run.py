"""`ripples run`: a coordinator and N local worker processes, from the start of a run to
its summary; and the run options every command that makes a run shares (`ripples run`,
`ripples coordinator serve`, `ripples submit`).

The options are RunSettings' fields, then every protocol's settings (flat: --group-size,
--hop-mode, ...), each documented once, on its field. Building them imports no torch;
the local cluster is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ripples.cli.arguments import (
    add_dataclass_arguments,
    dataclass_from_args,
    port,
    setup_logging,
)

if TYPE_CHECKING:
    from ripples.coordinator.config import RunSettings

_RUN_SKIP = {"run_id", "protocol_settings", "topology_edges"}
"""Fields of RunSettings that the CLI sets under other names or not at all (the edges:
from --topology-file)."""

SCRIPT_RUN_DEFAULTS: dict[str, object] = {"task": None, "epochs": None}
"""Defaults of the commands that take a script: unset, so that a script run can refuse
--task and --epochs (see run_settings)."""

SUMMARY_SERIES = ("loss_curve", "loss_curve_iterations", "consensus_distance_curve", "workers")
"""The entries of summary.json that grow with the run (a point a second, an entry a
worker): the file keeps them, the terminal shows the rest."""


RANKS_PER_WORKER_HELP = ("processes per worker (default: 1): G ranks that shard the "
                         "script's model with FSDP2 over worker.mesh; rank r of each group "
                         "member averages its own shard (docs/library.md)")


def add_run_arguments(parser: argparse.ArgumentParser,
                      defaults: dict[str, object] | None = None) -> None:
    """The options of a run: RunSettings' fields, then every protocol's settings."""
    from ripples.coordinator.config import RunSettings
    from ripples.protocols.registry import SETTINGS_CLASSES

    add_dataclass_arguments(parser, RunSettings, skip=_RUN_SKIP,
                            rename={"num_workers": "workers"}, defaults=defaults)
    parser.add_argument("--topology-file", default="", metavar="FILE",
                        help="topology 'file': its edges, one `i j` pair of ranks per line "
                             "(# comments), read here and sent to the coordinator as "
                             "topology_edges")
    for settings_cls in SETTINGS_CLASSES:
        add_dataclass_arguments(parser, settings_cls, option_names=settings_cls.cli_names)


def run_option_dests() -> set[str]:
    """The argument names of the run options (`coordinator serve`: were any given?)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_run_arguments(parser)
    return {a.dest for a in parser._actions}


def run_settings(args: argparse.Namespace, script: list[str] | None = None) -> RunSettings:
    """The run's settings from its options. `ripples run` leaves --task and --epochs unset
    (None) so that a script run can refuse them: a script trains its own model for its
    own epochs (cap it with --iterations)."""
    from ripples.coordinator.config import RunSettings, option_names
    from ripples.protocols.registry import SETTINGS_CLASSES

    names = {f for cls in SETTINGS_CLASSES for f in option_names(cls)}
    base = dataclass_from_args(RunSettings, args, build=False)
    options = {**base, **{name: getattr(args, name) for name in names if hasattr(args, name)}}
    if script is not None:
        if script and options.get("task") is not None:
            raise ValueError("give --task or a script after --, not both")
        if script and options.get("epochs") is not None:
            raise ValueError("a script runs its own epochs: drop --epochs (cap the run with "
                             "--iterations or --target-loss)")
        defaults = RunSettings.__dataclass_fields__
        options["task"] = "" if script else (options.get("task") or defaults["task"].default)
        options["epochs"] = 0.0 if script else (options["epochs"] if options.get("epochs")
                                                is not None else defaults["epochs"].default)
    topology_file = getattr(args, "topology_file", "")
    if topology_file:
        from ripples.coordinator.topology import read_edge_list

        if options.get("topology") != "file":
            raise ValueError("--topology-file is given: set --topology file to use it")
        options["topology_edges"] = read_edge_list(topology_file)
    return RunSettings.build(**options)


def cmd_run(args: argparse.Namespace) -> int:
    from ripples.cli.local_cluster import INTERRUPTED, LocalRunConfig, parse_slowdowns, run_local
    from ripples.protocols.registry import check_ranks_per_worker
    from ripples.worker.devices import plan_devices
    from ripples.worker.launch_env import CheckpointOptions

    setup_logging(args.verbose)
    script: list[str] = args.script
    try:
        run = run_settings(args, script)
        slowdowns = parse_slowdowns(args.slowdown, run.num_workers)
        if args.threads_per_worker < 1:
            raise ValueError("--threads-per-worker must be at least 1")
        if args.timeout_seconds < 0:
            raise ValueError("--timeout-seconds must not be negative (0: no limit)")
        if not script:
            from ripples.worker.tasks import resolve_task

            resolve_task(run.task)  # unknown task: fail before spawning anything
        checkpoint: CheckpointOptions = dataclass_from_args(CheckpointOptions, args)
        checkpoint.validate()
        plan_devices(run.num_workers * max(1, args.ranks_per_worker), args.device,
                     share_gpus=args.share_gpus,  # fail early
                     what="workers" if args.ranks_per_worker == 1 else "worker processes")
        link_mbit = link_rates(args.link_mbit, run.num_workers)
        check_ranks_per_worker(args.ranks_per_worker, run.to_proto(), script)
    except ValueError as err:
        print(f"ripples run: error: {err}", file=sys.stderr)
        return 2
    config = LocalRunConfig(run=run, slowdowns=slowdowns, output=Path(args.output),
                            threads_per_worker=args.threads_per_worker,
                            timeout_seconds=args.timeout_seconds, progress=not args.quiet,
                            dashboard_port=args.dashboard_port if args.dashboard else None,
                            worker_log_level=logging.INFO if args.verbose else logging.WARNING,
                            script=tuple(script), checkpoint=checkpoint,
                            resume=args.resume, device=args.device,
                            share_gpus=args.share_gpus, link_mbit=link_mbit,
                            ranks_per_worker=args.ranks_per_worker)
    started = time.monotonic()
    try:
        summary = run_local(config)
    except (RuntimeError, TimeoutError, OSError) as err:
        print(f"ripples run: failed: {err}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(json.dumps({k: v for k, v in summary.items() if k not in SUMMARY_SERIES},
                         indent=2))
    print("\n".join(result_lines(summary, config.output, time.monotonic() - started)))
    return 130 if summary.get("stop_reason") == INTERRUPTED else 0


def link_rates(specs: list[str], num_workers: int) -> tuple[float | None, ...]:
    """`--link-mbit` values to one rate per worker (empty: no shaping, loopback); a
    ValueError says why they cannot be used, also where namespaces cannot be made."""
    if not specs:
        return ()
    from ripples.netshape import parse_link_rates, unavailable_reason

    rates = parse_link_rates(specs, num_workers)
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"--link-mbit runs every host in a network namespace of its own, "
                         f"which cannot be made here: {reason}")
    return tuple(rates)


def result_lines(summary: Mapping[str, Any], output: Path, command_seconds: float) -> list[str]:
    """What `ripples run` ends with, in a few lines: how the run ended, its result (the
    consensus model's evaluation for a task, the workers' last training loss for a
    script), its time and iterations, and where its files are."""
    protocol, num_workers = summary["protocol"], summary["num_workers"]
    lines = [f"{protocol}, {num_workers} workers: {summary['stop_reason'] or 'the workers ended'}"]
    train_loss = summary.get("final_train_loss")
    train = (f"final training loss {train_loss:.4f} (the workers' reported losses at the "
             "end, averaged)" if train_loss is not None
             else "no training loss reported (opt.report_loss)")
    if summary.get("final_loss") is not None:
        accuracy = summary.get("final_accuracy")
        lines.append(f"consensus model on the {summary['task']} task's evaluation data: loss "
                     f"{summary['final_loss']:.4f}"
                     + (f", accuracy {accuracy:.4f}" if accuracy is not None else ""))
        lines.append(train)
    else:
        lines.append(train + ("; a script's model is not evaluated" if summary.get("script")
                              else "; the task has no evaluation data"))
    iterations = [int(w["iterations"]) for w in summary.get("workers") or []]
    timing = (f"{summary['wall_seconds']:.1f} s of training ({command_seconds:.1f} s with "
              f"start-up), {sum(iterations)} iterations")
    if iterations:
        low, high = min(iterations), max(iterations)
        timing += f" ({low} per worker)" if low == high else f" ({low}-{high} per worker)"
    target_seconds = summary.get("time_to_target_seconds")
    if target_seconds is not None:
        timing += f"; target loss reached after {target_seconds:.1f} s"
    lines.append(timing)
    lines.append(f"wrote {output / 'summary.json'} and {output / 'model.pt'}")
    return lines


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ripples.worker.launch_env import CheckpointOptions

    run = sub.add_parser("run", help="run a coordinator and N local workers (loopback; gloo "
                         "on the CPU, NCCL on GPUs)",
                         usage="ripples run [options] [-- python train.py ARGS]")
    add_run_arguments(run, defaults=SCRIPT_RUN_DEFAULTS)
    add_dataclass_arguments(run, CheckpointOptions)
    run.add_argument("--slowdown", action="append", default=[], metavar="RANK:FACTOR",
                     help="make worker RANK FACTOR times slower (RANK:FACTOR@PROBABILITY for a "
                          "random straggler); repeat for several workers")
    run.add_argument("--output", default="runs/latest", help="directory for model.pt and "
                     "summary.json (default: runs/latest)")
    run.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:K",
                     help="where the workers train: auto (default: one worker per GPU when "
                          "there are GPUs, else the CPU), cpu, cuda (one worker per GPU; "
                          "more workers than GPUs is an error) or cuda:K (that GPU)")
    run.add_argument("--share-gpus", action="store_true",
                     help="allow more workers than GPUs: worker i on GPU i mod G, each with "
                          "its own NCCL_HOSTID, talking over NCCL's sockets on loopback "
                          "(slower than one worker per GPU; docs/gpu.md)")
    run.add_argument("--link-mbit", action="append", default=[], metavar="RATE|RANK:RATE",
                     help="slow links: every worker in a network namespace of its own, a "
                          "host on a link of RATE Mbit/s each way (tc tbf), the coordinator "
                          "on an unshaped one; RANK:RATE sets one worker's link (repeat; "
                          "later ones win). Needs root; docs/network.md")
    run.add_argument("--ranks-per-worker", type=int, default=1, metavar="G",
                     help=RANKS_PER_WORKER_HELP)
    run.add_argument("--threads-per-worker", type=int, default=1,
                     help="torch threads per worker process (default: 1)")
    run.add_argument("--timeout-seconds", type=float, default=0.0,
                     help="stop the run and fail if it has not finished after this long "
                     "(default: 0, no limit: every wait inside a run has its own timeout)")
    run.add_argument("--dashboard", action="store_true",
                     help="serve the live dashboard during the run (see --dashboard-port)")
    run.add_argument("--dashboard-port", type=port, default=8080,
                     help="port of the dashboard on 127.0.0.1 (0: any free port; default: 8080)")
    run.add_argument("--resume", action="store_true",
                     help="go on with the run in --output after a total failure (the "
                          "launcher, the machine): the coordinator's state from "
                          "OUTPUT/state (its run settings win over the options given) and "
                          "new workers that continue each rank from its newest checkpoint "
                          "(OUTPUT/checkpoints unless --checkpoint-dir); give the same "
                          "script after --")
    run.add_argument("--quiet", action="store_true",
                     help="no progress lines, and of the summary only a few lines (how the "
                          "run ended, its loss, time and files); summary.json holds it all")
    run.add_argument("--verbose", action="store_true", help="log coordinator and worker events")
    run.set_defaults(func=cmd_run, takes_script=True)
