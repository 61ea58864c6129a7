"""The `ripples` command: parse, build a config, call the component's entry point.

    ripples run ... [-- python train.py ARGS]   coordinator + N local workers, start to summary
    ripples coordinator serve ...               the gRPC coordinator service of a cluster
    ripples worker run --agent ...              a host's agent: runs the service's runs
    ripples worker run ... [-- python train.py] one worker, or a host's K workers
    ripples submit ... [-- python train.py]     queue a run; runs, status, stop, logs
    ripples dashboard serve ...                 the live web dashboard of a run
    ripples schedule ...                        print the static schedule
    ripples chaos ...                           seeded fault-injection trials of real runs
    ripples simulate ...                        simulated workers drive the real coordinator core

After `--` comes the user's training script, which every worker runs (written against
`import ripples`: docs/library.md); without it the workers run the built-in task.

Each command lives in a module of this package (run, daemons, service, schedule, simulate,
chaos); building the parser imports none of the heavy parts (torch, the web stack, the
simulator), so `ripples status` starts in a fraction of a second: a command imports what
it runs when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from ripples.cli import chaos, daemons, run, schedule, service, simulate
from ripples.cli.arguments import check_coordinator, export_client_security
from ripples.cli.config_file import (
    ConfigError,
    command_path,
    config_option,
    effective,
    flags_given,
    leaf_parsers,
)
from ripples.cli.config_file import apply as apply_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ripples", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run.add_parser(sub)

    coord = sub.add_parser("coordinator", help="the coordinator service")
    coord_sub = coord.add_subparsers(dest="coordinator_command", required=True)
    daemons.add_coordinator_parser(coord_sub)
    service.add_health_parser(coord_sub)

    daemons.add_worker_parser(sub)
    daemons.add_dashboard_parser(sub)
    service.add_parsers(sub)

    # Listed for --help; main() hands `ripples bench ...` to the harness's own parser.
    sub.add_parser("bench", add_help=False,
                   help="benchmark the protocols side by side (ripples bench --help)")

    sched = sub.add_parser("schedule", help="print the static (conflict-free) schedule")
    schedule.add_arguments(sched)
    sched.set_defaults(func=schedule.run)

    chaos_parser = sub.add_parser("chaos", help="seeded chaos trials: kill, stop and replace "
                                  "workers of real runs, check nothing is lost")
    chaos.add_arguments(chaos_parser)
    chaos_parser.set_defaults(func=chaos.run_command)

    simulate_parser = sub.add_parser(
        "simulate", help="a discrete-event simulation: up to 100,000 simulated workers drive "
        "the real coordinator core (docs/scale.md)")
    simulate.add_arguments(simulate_parser)
    simulate_parser.set_defaults(func=simulate.run_command)

    config = sub.add_parser("config", help="configuration files (--config FILE.toml)")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show", help="print the effective options of a command line and where each came "
        "from (flag, environment, file, default)",
        usage="ripples config show [--json] COMMAND [options]")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument("line", nargs=argparse.REMAINDER,
                      help="the command line to resolve, e.g. worker run --config f.toml")
    show.set_defaults(func=_cmd_config_show)

    for path, leaf in leaf_parsers(parser).items():
        if path[0] != "config":
            leaf.add_argument("--config", default="", metavar="FILE.toml",
                              help=f"read options from the [{'.'.join(path)}] table of this "
                                   "TOML file (flags and RIPPLES_* variables win; `ripples "
                                   "config show` prints the result)")
    return parser


def _prepare(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None,
                                       tuple[str, ...], dict[str, str]]:
    """The parser of a command line, with its command's defaults taken from its config
    file and the environment: (the parser, the command's parser or None when the line
    names no configurable command, the command's path, each option's source).
    ConfigError when the file or a variable is wrong."""
    parser = build_parser()
    leaves = leaf_parsers(parser)
    command = command_path(argv, leaves)
    if not command or command[0] == "config":
        return parser, None, command, {}
    leaf = leaves[command]
    return parser, leaf, command, apply_config(leaf, command, argv, config_option(argv), leaves)


def _resolve(argv: list[str]) -> tuple[argparse.ArgumentParser | None, argparse.Namespace,
                                       tuple[str, ...], dict[str, str]]:
    """Parse a command line with its config file and environment (see _prepare)."""
    parser, leaf, command, sources = _prepare(argv)
    return leaf, parser.parse_args(argv), command, sources


def _cmd_config_show(args: argparse.Namespace) -> int:
    line = [a for a in args.line if a != "--"]
    try:
        parser, leaf, command, sources = _prepare(line)
    except ConfigError as err:
        print(f"ripples config show: error: {err}", file=sys.stderr)
        return 2
    if leaf is None:
        print("ripples config show: error: give a command line, e.g. `ripples config show "
              "worker run --config ripples.toml`", file=sys.stderr)
        return 2
    settings = effective(leaf, parser.parse_args(line), line, sources)
    if args.json:
        print(json.dumps({k: {"value": v.value, "source": v.source}
                          for k, v in settings.items()}, indent=2, default=str))
        return 0
    width = max(map(len, settings))
    print(f"# ripples {' '.join(command)}: effective options (flag > environment > file > "
          "default)")
    for name, setting in settings.items():
        print(f"{name:<{width}} = {json.dumps(setting.value, default=str)}  "
              f"# {setting.source}")
    return 0


def split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the options, the user's training script after the first `--`)."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return list(argv[:cut]), list(argv[cut + 1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from ripples.bench.harness import main as bench_main

        return bench_main(argv[1:])
    separated = "--" in argv
    argv, script = split_script(argv)
    if separated and not script:
        build_parser().error("nothing after --: give the script, e.g. -- python train.py")
    try:
        leaf, args, _, sources = _resolve(argv)
    except ConfigError as err:
        print(f"ripples: error: {err}", file=sys.stderr)
        return 2
    if script and not getattr(args, "takes_script", False):
        build_parser().error(f"`ripples {argv[0]}` takes no script after --")
    args.script = script
    args.options_given = set(sources) | (flags_given(leaf, argv) if leaf else set())
    try:
        if hasattr(args, "tls_ca"):  # a command that talks to a coordinator as a client
            export_client_security(args)
        if getattr(args, "needs_coordinator", False):
            check_coordinator(args.coordinator)
    except ValueError as err:
        print(f"ripples {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    code: int = args.func(args)
    return code
