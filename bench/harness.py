"""`ripples bench`: the papers' protocol comparisons, side by side, as ratios.

Runs every protocol on the same task, seed and data under each heterogeneity scenario,
as full `ripples run` jobs (coordinator + spawned workers on loopback). The whole matrix
is repeated and the order of protocols rotates between repeats, so that machine noise
hits every protocol alike. Repeat r uses seed `seed + r` for every run in it: the spread
between seeds (model initialisation, data order; measured here: 106-157 iterations for
allreduce to reach the same loss) is larger than timing noise, so repeating one seed
would only measure the latter. Methodology as the papers': time to reach a target training
loss (Ripples §7.1.4), time per epoch (AD-PSGD's robustness table), iterations to the
target (statistical efficiency).

    ripples bench --quick                  # about 5 minutes: 2 scenarios, 1 repeat
    ripples bench                          # the full matrix (docs/benchmarks.md)

Writes DIR/results.json (one record per run, plus the medians), DIR/loss.png and
DIR/iteration_split.png, and prints a table. Each finished run is appended to
DIR/records.jsonl as it ends, so an interrupted matrix keeps its runs:
`ripples bench --resume` (same options) runs only the missing ones.

This module is the schedule (the rotating order, the records kept as they come, the
resume) and the command line; the matrix's entries and configuration are in
bench/matrix.py, one run in bench/bench_run.py, the tables in bench/report.py. It hands
out their public names too (`harness.HarnessConfig`, `harness.format_table`, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from ripples.bench.bench_run import (
    RunRecord,
    peer_summary,
    record_from_summary,
    run_command,
    run_one,
    run_summary,
)
from ripples.bench.matrix import (
    DEVICES,
    MATRIX_PROTOCOLS,
    PEER_NAMES,
    QUICK,
    QUICK_PROTOCOLS,
    QUICK_SCENARIOS,
    SCRIPT_WORKLOADS,
    VARIANTS,
    HarnessConfig,
    Variant,
    base_protocol,
    config_dict,
    installed_peers,
    parse_peer_settings,
    takes_topology,
)
from ripples.bench.network import NETWORKS, SLOW_MBIT, UNEVEN_FAST_MBIT, print_links
from ripples.bench.peers import PEERS
from ripples.bench.report import (
    add_equal_step_losses,
    add_speedups,
    format_markdown,
    format_table,
    medians,
    write_results,
)
from ripples.coordinator.topology import TOPOLOGIES
from ripples.sim.scenarios import SCENARIOS

__all__ = [
    "CONFIG_FILE",
    "MATRIX_PROTOCOLS",
    "PEER_NAMES",
    "QUICK",
    "QUICK_PROTOCOLS",
    "QUICK_SCENARIOS",
    "RECORDS_FILE",
    "SCRIPT_WORKLOADS",
    "VARIANTS",
    "HarnessConfig",
    "RunRecord",
    "Variant",
    "add_equal_step_losses",
    "add_speedups",
    "base_protocol",
    "config_dict",
    "format_markdown",
    "format_table",
    "installed_peers",
    "load_finished",
    "main",
    "medians",
    "parse_peer_settings",
    "peer_summary",
    "record_from_summary",
    "run_command",
    "run_matrix",
    "run_one",
    "run_summary",
    "takes_topology",
    "write_results",
]


RECORDS_FILE = "records.jsonl"
"""Under the output folder: one record per finished run, appended as each ends."""
CONFIG_FILE = "config.json"
"""Under the output folder: the options of the bench that wrote the records."""


def load_finished(cfg: HarnessConfig) -> list[RunRecord]:
    """The runs an earlier, interrupted `ripples bench` with the same options finished.

    Args:
        cfg: This bench's configuration; its output folder holds the earlier records.

    Returns:
        The records of OUTPUT/records.jsonl (none if there is no such file); a line cut
        short by the interruption is skipped with a message.

    Raises:
        ValueError: the earlier bench ran with other options.
    """
    config_path, records_path = cfg.output / CONFIG_FILE, cfg.output / RECORDS_FILE
    if not records_path.exists():
        return []
    if config_path.exists():
        before = json.loads(config_path.read_text())
        now, defaults = config_dict(cfg), config_dict(HarnessConfig())
        # An option newer than the interrupted bench had its default there.
        before = {k: before.get(k, defaults[k]) for k in now}
        changed = sorted(k for k in now if k != "output" and before[k] != now[k])
        if changed:
            raise ValueError(f"cannot resume {cfg.output}: it was run with other options "
                             f"({', '.join(f'{k}={before[k]!r}' for k in changed)})")
    records = []
    for number, line in enumerate(records_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(RunRecord(**json.loads(line)))
        except (ValueError, TypeError) as err:  # a line cut short by the interruption
            print(f"{records_path}:{number}: skipped an unreadable record ({err})",
                  file=sys.stderr)
    return records


def run_matrix(cfg: HarnessConfig, finished: list[RunRecord] | None = None) -> list[RunRecord]:
    """Run every (repeat, scenario, protocol) not in `finished`, appending each record to
    OUTPUT/records.jsonl as it ends.

    The order of the protocols rotates from one (repeat, scenario) to the next, so that
    no protocol always runs first (machine noise hits every protocol alike).

    Args:
        cfg: The bench's configuration (validated here).
        finished: Records of an interrupted bench (`load_finished`), kept as they are.

    Returns:
        Every record, `finished` first, with their ratios to allreduce filled in.
    """
    cfg.validate()
    records = list(finished or [])
    have = {(r.scenario, r.protocol, r.repeat) for r in records}
    cfg.output.mkdir(parents=True, exist_ok=True)
    (cfg.output / CONFIG_FILE).write_text(json.dumps(config_dict(cfg), indent=2) + "\n")
    records_path = cfg.output / RECORDS_FILE
    if not records:
        records_path.write_text("")
    total = cfg.repeats * len(cfg.scenarios) * len(cfg.protocols)
    if records:
        print(f"resuming: {len(records)} of {total} runs already in {records_path}",
              file=sys.stderr, flush=True)
    started, ran, position = time.monotonic(), 0, 0
    for repeat in range(cfg.repeats):
        for scenario_name in cfg.scenarios:
            shift = (repeat + position) % len(cfg.protocols)
            order = cfg.protocols[shift:] + cfg.protocols[:shift]  # rotate: no fixed first
            for protocol in order:
                position += 1
                if (scenario_name, protocol, repeat) in have:
                    continue
                done = len(records)
                eta = ((time.monotonic() - started) / ran * (total - done)) if ran else None
                print(f"[{done + 1}/{total}] {scenario_name} {protocol} (repeat {repeat + 1})"
                      + (f", about {eta / 60:.0f} min left" if eta else ""),
                      file=sys.stderr, flush=True)
                rec = run_one(cfg, SCENARIOS[scenario_name], protocol, repeat)
                ttt = (f"{rec.time_to_target_seconds:.1f} s" if rec.time_to_target_seconds
                       else "not reached")
                print(f"    target {ttt}, {rec.seconds_per_iteration:.3f} s/iteration",
                      file=sys.stderr, flush=True)
                with records_path.open("a") as f:
                    f.write(json.dumps(asdict(rec)) + "\n")
                records.append(rec)
                ran += 1
    add_speedups(records)
    add_equal_step_losses(records)
    return records


def main(argv: list[str] | None = None) -> int:
    """`ripples bench`: run the matrix, print the table, write the results and plots.

    Args:
        argv: The command's arguments (None: sys.argv's).

    Returns:
        The exit code (0; a bad option exits 2 through argparse).
    """
    defaults = HarnessConfig()
    parser = argparse.ArgumentParser(prog="ripples bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"scenarios {', '.join(QUICK_SCENARIOS)}, one repeat, target loss "
                             f"{QUICK.target_loss} (about 5 minutes)")
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--workers-per-node", type=int, default=defaults.workers_per_node)
    parser.add_argument("--protocols", help=f"comma-separated (default: all of "
                                            f"{', '.join(defaults.protocols)}; with --quick: "
                                            f"{', '.join(QUICK.protocols)})")
    parser.add_argument("--scenarios", help=f"comma-separated, from {', '.join(SCENARIOS)} "
                                            "(default: all)")
    parser.add_argument("--topology", default=defaults.topology,
                        help="graph for the group and gossip protocols: "
                             f"{', '.join(t for t in TOPOLOGIES if t != 'file')} "
                             "(allreduce and ripples-static ignore it; default %(default)s)")
    parser.add_argument("--rate-com", type=float, default=defaults.rate_com,
                        help="gossip averagings per worker per step, the same for every "
                             "gossip protocol (default %(default)s)")
    parser.add_argument("--task", default=defaults.task,
                        help="a built-in task, or a script workload: "
                             f"{', '.join(SCRIPT_WORKLOADS)} (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--target-loss", type=float,
                        help=f"default {defaults.target_loss} ({QUICK.target_loss} with --quick)")
    parser.add_argument("--max-epochs", type=float,
                        help=f"default {defaults.max_epochs} ({QUICK.max_epochs} with --quick)")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps,
                        help="per-worker step cap of a script workload (default %(default)s)")
    parser.add_argument("--repeats", type=int, help=f"default {defaults.repeats}")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", type=Path, default=defaults.output)
    parser.add_argument("--markdown", action="store_true",
                        help="print the table as Markdown (docs/benchmarks.md); with --resume "
                             "on a finished bench, re-prints it without running anything")
    parser.add_argument("--peers", action="store_true",
                        help=f"also run the peer systems ({', '.join(PEERS)}) whose packages "
                             "are installed (pip install 'ripples[peers]'); the others are "
                             "skipped with a message")
    parser.add_argument("--peer-setting", action="append", default=[], metavar="PEER:KEY=VALUE",
                        help="a peer's knob instead of its tuned default (repeatable), e.g. "
                             "hivemind-local:target_batch_size=1024")
    parser.add_argument("--network", choices=NETWORKS, default=defaults.network,
                        help="the links every system's workers run on: loopback (default), "
                             f"slow (every link {SLOW_MBIT:g} Mbit/s each way), uneven (every "
                             f"link {UNEVEN_FAST_MBIT:g} Mbit/s, the last worker's "
                             f"{SLOW_MBIT:g}); each worker a host in a network namespace of "
                             "its own (root; docs/network.md)")
    parser.add_argument("--link-mbit", action="append", default=[], metavar="RATE|RANK:RATE",
                        help="any link rates over the preset's: RATE for every worker's, "
                             "RANK:RATE for one (repeatable)")
    parser.add_argument("--device", choices=DEVICES, default=defaults.device,
                        help="where Ripples' workers train: cpu (default), or cuda, every "
                             "worker on this machine's GPUs, sharing them (the peers: "
                             "CPU only)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in OUTPUT/records.jsonl (an interrupted "
                             "bench with the same options) and run only the missing ones")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else defaults
    try:
        peer_settings = parse_peer_settings(args.peer_setting)
    except ValueError as err:
        parser.error(str(err))
    cfg = replace(
        base, workers=args.workers, workers_per_node=args.workers_per_node,
        protocols=(tuple(p for p in args.protocols.split(",") if p) if args.protocols
                   else base.protocols),
        scenarios=(tuple(s for s in args.scenarios.split(",") if s) if args.scenarios
                   else base.scenarios),
        task=args.task, batch_size=args.batch_size,
        target_loss=args.target_loss or base.target_loss,
        max_epochs=args.max_epochs or base.max_epochs, repeats=args.repeats or base.repeats,
        max_steps=args.max_steps,
        seed=args.seed, output=args.output, topology=args.topology, rate_com=args.rate_com,
        peer_settings=peer_settings, network=args.network, link_mbit=tuple(args.link_mbit),
        device=args.device,
    )
    if args.peers:
        cfg.protocols += tuple(installed_peers(exclude=cfg.protocols))
    try:
        cfg.validate()
        finished = load_finished(cfg) if args.resume else []
    except ValueError as err:
        parser.error(str(err))
    run_bench(cfg, finished, markdown=args.markdown)
    return 0


def run_bench(cfg: HarnessConfig, finished: list[RunRecord] | None = None, *,
              markdown: bool = False) -> list[RunRecord]:
    """Run a validated configuration's matrix (but the `finished` runs), print its table
    and write results.json and the plots; the records, finished ones included."""
    print_links(cfg.link_rates())
    records = run_matrix(cfg, finished or [])
    rows = medians(records)
    print(format_markdown(rows) if markdown else format_table(rows))
    path = write_results(cfg, records, rows)
    from ripples.bench.plots import plot_iteration_split, plot_loss_curves

    title = f"network: {cfg.network_name}" + (", GPU" if cfg.device == "cuda" else "")
    plots = [plot_loss_curves(records, cfg.output / "loss.png", cfg.target_loss, title=title),
             plot_iteration_split(rows, cfg.output / "iteration_split.png")]
    print(f"wrote {path}, {', '.join(str(p) for p in plots)}", file=sys.stderr)
    return records


if __name__ == "__main__":
    sys.exit(main())