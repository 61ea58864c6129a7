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
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ripples import chaos, schedule_command, service_cli
from ripples.config_cli import add_dataclass_arguments, dataclass_from_args
from ripples.config_file import (
    ConfigError,
    command_path,
    config_option,
    effective,
    flags_given,
    leaf_parsers,
)
from ripples.config_file import apply as apply_config
from ripples.sim import cli as sim_cli

ENV_COORDINATOR = "RIPPLES_COORDINATOR"
# Fields of RunSettings that the CLI sets under other names or not at all.
_RUN_SKIP = {"run_id", "protocol_settings"}


def _setup_logging(verbose: bool, who: str = "") -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {who}%(levelname)s %(name)s: %(message)s")


def _add_run_arguments(parser: argparse.ArgumentParser,
                       defaults: dict[str, object] | None = None) -> None:
    """The options of a run: RunSettings' fields, then every protocol family's settings
    (flat: --group-size, --hop-mode, ...), each documented once, on its field."""
    from ripples.coordinator.config import RunSettings
    from ripples.protocols import SETTINGS_CLASSES

    add_dataclass_arguments(parser, RunSettings, skip=_RUN_SKIP,
                            rename={"num_workers": "workers"}, defaults=defaults)
    for settings_cls in SETTINGS_CLASSES:
        add_dataclass_arguments(parser, settings_cls, option_names=settings_cls.cli_names)


def _run_settings(args: argparse.Namespace, script: list[str] | None = None
                  ):  # -> RunSettings (import kept lazy)
    """The run's settings from its options. `ripples run` leaves --task and --epochs unset
    (None) so that a script run can refuse them: a script trains its own model for its
    own epochs (cap it with --iterations)."""
    from ripples.coordinator.config import RunSettings, option_names
    from ripples.protocols import SETTINGS_CLASSES

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
    return RunSettings.build(**options)


def _cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ripples.local_cluster import INTERRUPTED, LocalRunConfig, parse_slowdowns, run_local
    from ripples.worker.launch_env import CheckpointOptions

    _setup_logging(args.verbose)
    script: list[str] = args.script
    try:
        run = _run_settings(args, script)
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
    except ValueError as err:
        print(f"ripples run: error: {err}", file=sys.stderr)
        return 2
    config = LocalRunConfig(run=run, slowdowns=slowdowns, output=Path(args.output),
                            threads_per_worker=args.threads_per_worker,
                            timeout_seconds=args.timeout_seconds, progress=not args.quiet,
                            dashboard_port=args.dashboard_port if args.dashboard else None,
                            worker_log_level=logging.INFO if args.verbose else logging.WARNING,
                            script=tuple(script), checkpoint=checkpoint,
                            resume=args.resume)
    try:
        summary = run_local(config)
    except (RuntimeError, TimeoutError, OSError) as err:
        print(f"ripples run: failed: {err}", file=sys.stderr)
        return 1
    shown = {k: v for k, v in summary.items() if k not in ("loss_curve", "workers")}
    print(json.dumps(shown, indent=2))
    print(f"wrote {config.output / 'summary.json'} and {config.output / 'model.pt'}",
          file=sys.stderr)
    return 130 if summary.get("stop_reason") == INTERRUPTED else 0


def _add_client_security_arguments(parser: argparse.ArgumentParser) -> None:
    """How a command reaches a coordinator that has TLS or a token (docs/security.md);
    the processes it starts inherit them (as RIPPLES_* variables)."""
    from ripples.security import (
        ENV_TLS_CA,
        ENV_TLS_CLIENT_CERT,
        ENV_TLS_CLIENT_KEY,
        ENV_TOKEN,
        ENV_TOKEN_FILE,
    )

    group = parser.add_argument_group("security (docs/security.md)")
    group.add_argument("--token-file", default="", metavar="FILE",
                       help=f"the run's token (default: the file ${ENV_TOKEN_FILE} names, "
                            f"else ${ENV_TOKEN})")
    group.add_argument("--tls-ca", default="", metavar="FILE",
                       help="connect with TLS, checking the coordinator's certificate "
                            f"against this CA (PEM; default: ${ENV_TLS_CA})")
    group.add_argument("--tls-client-cert", default="", metavar="FILE",
                       help="mutual TLS: this client's certificate (PEM; default: "
                            f"${ENV_TLS_CLIENT_CERT})")
    group.add_argument("--tls-client-key", default="", metavar="FILE",
                       help=f"mutual TLS: its key (PEM; default: ${ENV_TLS_CLIENT_KEY})")


def _add_server_security_arguments(parser: argparse.ArgumentParser) -> None:
    from ripples.security import ENV_TOKEN, ENV_TOKEN_FILE

    group = parser.add_argument_group("security (docs/security.md)")
    group.add_argument("--token-file", default="", metavar="FILE",
                       help="require this token on every call (default: the file "
                            f"${ENV_TOKEN_FILE} names, else ${ENV_TOKEN}; neither: no token)")
    group.add_argument("--read-token-file", default="", metavar="FILE",
                       help="also accept this read-only token, for the run's status and "
                            "consensus model only (dashboards)")
    group.add_argument("--tls-cert", default="", metavar="FILE",
                       help="serve gRPC over TLS with this certificate chain (PEM)")
    group.add_argument("--tls-key", default="", metavar="FILE", help="its private key (PEM)")
    group.add_argument("--tls-client-ca", default="", metavar="FILE",
                       help="mutual TLS: clients must show a certificate signed by this CA")


def _client_security(args: argparse.Namespace) -> None:
    """Export a command's client security flags to the environment (for the clients it
    makes and the processes it starts) and check them; ValueError saying what is wrong."""
    from ripples.security import ClientSecurity, export_client_flags

    export_client_flags(args.token_file, args.tls_ca, args.tls_client_cert,
                        args.tls_client_key)
    ClientSecurity.from_env()


def _cmd_serve(args: argparse.Namespace) -> int:
    from ripples.coordinator.server import ServerConfig, serve
    from ripples.security import ServerSecurity

    _setup_logging(not args.quiet)
    if args.script:
        print("ripples coordinator serve: error: the coordinator runs no script; start the "
              "workers with `ripples worker run -- python train.py`", file=sys.stderr)
        return 2
    try:
        # Run options given (flags, file, environment): the one-run form submits that run
        # at the start; none: the coordinator starts with no run (`ripples submit`).
        run = _run_settings(args) if _run_option_dests() & args.options_given else None
        security = ServerSecurity.build(
            token_file=args.token_file, read_token_file=args.read_token_file,
            cert_file=args.tls_cert, key_file=args.tls_key,
            client_ca_file=args.tls_client_ca)
        config = ServerConfig(host=args.host, port=args.port, store_port=args.store_port,
                              metrics_port=args.metrics_port,
                              advertise_host=args.advertise_host, run=run,
                              exit_when_done=args.exit_when_done, state_dir=args.state_dir,
                              security=security)
        return serve(config)
    except (ValueError, OSError) as err:
        print(f"ripples coordinator serve: error: {err}", file=sys.stderr)
        return 2


def _run_option_dests() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    _add_run_arguments(parser)
    return {a.dest for a in parser._actions}


def _add_coordinator_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", default=os.environ.get(ENV_COORDINATOR, ""),
                        help=f"HOST:PORT of the coordinator (default: ${ENV_COORDINATOR})")
    parser.set_defaults(needs_coordinator=True)


def _cmd_submit(args: argparse.Namespace) -> int:
    return service_cli.cmd_submit(args, _run_settings)


def _check_coordinator(address: str) -> None:
    """ValueError unless the coordinator address (option or environment) is HOST:PORT."""
    from ripples.rpc import parse_target

    if not address:
        raise ValueError(f"give --coordinator HOST:PORT or set {ENV_COORDINATOR}")
    parse_target(address)


def _cmd_worker(args: argparse.Namespace) -> int:
    from ripples.worker.agent import run_agent
    from ripples.worker.daemon import (
        RESTART_EXIT_CODE,
        WorkerConfig,
        agent_config,
        exec_again,
        exit_now,
        install_signal_handlers,
        run_host,
        run_worker,
    )

    script: list[str] = args.script
    try:
        _check_coordinator(args.coordinator)
        config = dataclass_from_args(WorkerConfig, args)
        if script and config.task:
            raise ValueError("give --task or a script after --, not both")
        if script and config.agent:
            raise ValueError("an agent runs the coordinator's runs: give the script to "
                             "`ripples submit ... -- python train.py`")
        agent = agent_config(config) if config.agent else None
    except ValueError as err:
        print(f"ripples worker run: error: {err}", file=sys.stderr)
        return 2
    if agent is not None:
        _setup_logging(not args.quiet, f"agent[{agent.host}] ")
        return run_agent(agent)
    if script or config.nproc_per_node > 1:
        _setup_logging(not args.quiet, "host-launcher ")
        return run_host(config, script, args.quiet)
    _setup_logging(not args.quiet, f"worker[{config.host or '-'}/{config.local_rank}] ")
    install_signal_handlers()
    code = run_worker(config)
    if code == RESTART_EXIT_CODE:  # a restart round: the same command again, in place
        exec_again()
    exit_now(code)  # the worker left the run: skip interpreter teardown
    return 1  # not reached


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from ripples.dashboard.app import DashboardConfig
    from ripples.dashboard.server import serve

    _setup_logging(not args.quiet)
    try:
        _check_coordinator(args.coordinator)
        config = dataclass_from_args(DashboardConfig, args)
        return serve(config)
    except (ValueError, OSError) as err:
        print(f"ripples dashboard serve: error: {err}", file=sys.stderr)
        return 2


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from ripples.worker.client import CoordinatorCallError, CoordinatorClient

    try:
        _check_coordinator(args.coordinator)
        if args.timeout_seconds <= 0:
            raise ValueError("--timeout-seconds must be positive")
    except ValueError as err:
        print(f"ripples checkpoint: error: {err}", file=sys.stderr)
        return 2
    client = CoordinatorClient(args.coordinator)
    try:
        info, data = client.consensus(args.timeout_seconds)
    except CoordinatorCallError as err:
        print(f"ripples checkpoint: error: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    partial.replace(path)
    summary = {"path": str(path), "consensus_id": info.consensus_id,
               "workers": list(info.workers), "iterations": list(info.iterations),
               "consensus_distance": info.consensus_distance,
               "seconds": round(info.seconds, 3), "bytes": len(data)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {path}: the average of workers {summary['workers']} at iterations "
              f"{summary['iterations']} (consensus distance {info.consensus_distance:.3g}, "
              f"{info.seconds:.2f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ripples.dashboard.app import DashboardConfig
    from ripples.worker.daemon import WorkerConfig
    from ripples.worker.launch_env import CheckpointOptions

    parser = argparse.ArgumentParser(prog="ripples", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a coordinator and N local workers (loopback, gloo)",
                         usage="ripples run [options] [-- python train.py ARGS]")
    _add_run_arguments(run, defaults={"task": None, "epochs": None})
    add_dataclass_arguments(run, CheckpointOptions)
    run.add_argument("--slowdown", action="append", default=[], metavar="RANK:FACTOR",
                     help="make worker RANK FACTOR times slower (RANK:FACTOR@PROBABILITY for a "
                          "random straggler); repeat for several workers")
    run.add_argument("--output", default="runs/latest", help="directory for model.pt and "
                     "summary.json (default: runs/latest)")
    run.add_argument("--threads-per-worker", type=int, default=1,
                     help="torch threads per worker process (default: 1)")
    run.add_argument("--timeout-seconds", type=float, default=0.0,
                     help="stop the run and fail if it has not finished after this long "
                     "(default: 0, no limit: every wait inside a run has its own timeout)")
    run.add_argument("--dashboard", action="store_true",
                     help="serve the live dashboard during the run (see --dashboard-port)")
    run.add_argument("--dashboard-port", type=int, default=8080,
                     help="port of the dashboard on 127.0.0.1 (0: any free port; default: 8080)")
    run.add_argument("--resume", action="store_true",
                     help="go on with the run in --output after a total failure (the "
                          "launcher, the machine): the coordinator's state from "
                          "OUTPUT/state (its run settings win over the options given) and "
                          "new workers that continue each rank from its newest checkpoint "
                          "(OUTPUT/checkpoints unless --checkpoint-dir); give the same "
                          "script after --")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--verbose", action="store_true", help="log coordinator and worker events")
    run.set_defaults(func=_cmd_run)

    coord = sub.add_parser("coordinator", help="the coordinator service")
    coord_sub = coord.add_subparsers(dest="coordinator_command", required=True)
    serve = coord_sub.add_parser(
        "serve", help="serve runs over gRPC: with run options, that run at once; without, "
        "the runs `ripples submit` queues (docs/service.md)")
    serve.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (default: 50051)")
    serve.add_argument("--store-port", type=int, default=0,
                       help="rendezvous store port (default: any free port)")
    serve.add_argument("--metrics-port", type=int, default=9400,
                       help="HTTP port for /metrics and Prometheus service discovery at /sd "
                            "(0: any free port; default: 9400)")
    serve.add_argument("--advertise-host", default="",
                       help="address workers use to reach the store (default: host name)")
    serve.add_argument("--state-dir", default="",
                       help="keep the runs in DIR (SQLite: DIR/history.db, the active "
                            "run's state and every run's logs under DIR/runs/); started "
                            "again on the same DIR, the coordinator resumes the active run "
                            "(its saved settings win over the run options) and its queue, "
                            "and workers ride over the restart (docs/fault-tolerance.md)")
    serve.add_argument("--exit-when-done", action="store_true",
                       help="exit once every run submitted has ended and its workers left")
    serve.add_argument("--quiet", action="store_true", help="log warnings only")
    _add_server_security_arguments(serve)
    _add_run_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    service_cli.add_health_parser(coord_sub, coordinator_option=_add_coordinator_option,
                                  client_security=_add_client_security_arguments)

    worker = sub.add_parser("worker", help="the worker daemon")
    worker_sub = worker.add_subparsers(dest="worker_command", required=True)
    wrun = worker_sub.add_parser(
        "run", help="run one worker (or --nproc-per-node K of them) until the run ends",
        usage="ripples worker run [options] [-- python train.py ARGS]")
    add_dataclass_arguments(wrun, WorkerConfig, defaults={
        "coordinator": os.environ.get(ENV_COORDINATOR, "")})
    wrun.add_argument("--quiet", action="store_true", help="log warnings only")
    _add_client_security_arguments(wrun)
    wrun.set_defaults(func=_cmd_worker)

    dash = sub.add_parser("dashboard", help="the live web dashboard")
    dash_sub = dash.add_subparsers(dest="dashboard_command", required=True)
    dserve = dash_sub.add_parser("serve", help="serve the dashboard of a coordinator's run")
    add_dataclass_arguments(dserve, DashboardConfig, defaults={
        "coordinator": os.environ.get(ENV_COORDINATOR, "")})
    dserve.add_argument("--quiet", action="store_true", help="log warnings only")
    _add_client_security_arguments(dserve)
    dserve.set_defaults(func=_cmd_dashboard)

    service_cli.add_parsers(
        sub, coordinator_option=_add_coordinator_option,
        client_security=_add_client_security_arguments,
        run_arguments=lambda p: _add_run_arguments(p, defaults={"task": None, "epochs": None}),
        submit=_cmd_submit)

    # Listed for --help; main() hands `ripples bench ...` to the harness's own parser.
    sub.add_parser("bench", add_help=False,
                   help="benchmark the protocols side by side (ripples bench --help)")

    sched = sub.add_parser("schedule", help="print the static (conflict-free) schedule")
    schedule_command.add_arguments(sched)
    sched.set_defaults(func=schedule_command.run)

    ckpt = sub.add_parser("checkpoint", help="write the running run's consensus model now "
                          "(the average of the live workers' models)")
    ckpt.add_argument("--coordinator", default=os.environ.get(ENV_COORDINATOR, ""),
                      help=f"HOST:PORT of the run's coordinator (default: ${ENV_COORDINATOR})")
    ckpt.add_argument("--output", required=True,
                      help="file to write (a state_dict, torch.load-able), written whole or "
                           "not at all")
    ckpt.add_argument("--timeout-seconds", type=float, default=60.0,
                      help="how long the workers have to publish their models, each at its "
                           "next step boundary (default: 60)")
    ckpt.add_argument("--json", action="store_true", help="print what was averaged as JSON")
    _add_client_security_arguments(ckpt)
    ckpt.set_defaults(func=_cmd_checkpoint)

    chaos_parser = sub.add_parser("chaos", help="seeded chaos trials: kill, stop and replace "
                                  "workers of real runs, check nothing is lost")
    chaos.add_arguments(chaos_parser)
    chaos_parser.set_defaults(func=chaos.run_command)

    simulate = sub.add_parser("simulate", help="a discrete-event simulation: up to 100,000 "
                              "simulated workers drive the real coordinator core (docs/scale.md)")
    sim_cli.add_arguments(simulate)
    simulate.set_defaults(func=sim_cli.run_command)

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
    if script and args.func not in (_cmd_run, _cmd_worker, _cmd_serve, _cmd_submit):
        build_parser().error(f"`ripples {argv[0]}` takes no script after --")
    args.script = script
    args.options_given = set(sources) | (flags_given(leaf, argv) if leaf else set())
    try:
        if hasattr(args, "tls_ca"):  # a command that talks to a coordinator as a client
            _client_security(args)
        if getattr(args, "needs_coordinator", False):
            _check_coordinator(args.coordinator)
    except ValueError as err:
        print(f"ripples {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
