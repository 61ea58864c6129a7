"""The long-running processes of a cluster, each started by one command:

    ripples coordinator serve ...               the gRPC coordinator service
    ripples worker run --agent ...              a host's agent: runs the service's runs
    ripples worker run ... [-- python train.py] one worker, or a host's K workers
    ripples dashboard serve ...                 the live web dashboard of a coordinator

Each parses its options into its component's config and calls that component's entry
point; the component is imported when the command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import os
import sys

from ripples.cli.arguments import (
    ENV_COORDINATOR,
    add_client_security_arguments,
    add_dataclass_arguments,
    add_server_security_arguments,
    check_coordinator,
    dataclass_from_args,
    port,
    port_or_off,
    setup_logging,
)
from ripples.cli.run import add_run_arguments, run_option_dests, run_settings


def cmd_serve(args: argparse.Namespace) -> int:
    from ripples.coordinator.server import ServerConfig, serve
    from ripples.server_security import ServerSecurity

    setup_logging(not args.quiet)
    if args.script:
        print("ripples coordinator serve: error: the coordinator runs no script; start the "
              "workers with `ripples worker run -- python train.py`", file=sys.stderr)
        return 2
    try:
        # Run options given (flags, file, environment): the one-run form submits that run
        # at the start; none: the coordinator starts with no run (`ripples submit`).
        run = run_settings(args) if run_option_dests() & args.options_given else None
        security = ServerSecurity.build(
            token_file=args.token_file, read_token_file=args.read_token_file,
            cert_file=args.tls_cert, key_file=args.tls_key,
            client_ca_file=args.tls_client_ca)
        config = ServerConfig(host=args.host, port=args.port, store_port=args.store_port,
                              metrics_port=args.metrics_port,
                              advertise_host=args.advertise_host, run=run,
                              exit_when_done=args.exit_when_done, state_dir=args.state_dir,
                              security=security, netns=args.netns)
        return serve(config)
    except (ValueError, OSError) as err:
        print(f"ripples coordinator serve: error: {err}", file=sys.stderr)
        return 2


def cmd_worker(args: argparse.Namespace) -> int:
    from ripples.protocols.registry import check_sharded_script
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
        check_coordinator(args.coordinator)
        config = dataclass_from_args(WorkerConfig, args)
        if script and config.task:
            raise ValueError("give --task or a script after --, not both")
        check_sharded_script(config.ranks_per_worker, script)
        if script and config.agent:
            raise ValueError("an agent runs the coordinator's runs: give the script to "
                             "`ripples submit ... -- python train.py`")
        agent = agent_config(config) if config.agent else None
        if agent is not None:
            agent.devices()
        elif script or config.nproc_per_node > 1:
            config.host_devices()
    except ValueError as err:
        print(f"ripples worker run: error: {err}", file=sys.stderr)
        return 2
    if agent is not None:
        setup_logging(not args.quiet, f"agent[{agent.host}] ")
        return run_agent(agent)
    if script or config.nproc_per_node > 1:
        setup_logging(not args.quiet, "host-launcher ")
        return run_host(config, script, args.quiet)
    setup_logging(not args.quiet, f"worker[{config.host or '-'}/{config.local_rank}] ")
    install_signal_handlers()
    code = run_worker(config)
    if code == RESTART_EXIT_CODE:  # a restart round: the same command again, in place
        exec_again()
    exit_now(code)  # the worker left the run: skip interpreter teardown
    return 1  # not reached


def cmd_dashboard(args: argparse.Namespace) -> int:
    from ripples.dashboard.config import DashboardConfig
    from ripples.dashboard.server import serve

    setup_logging(not args.quiet)
    try:
        check_coordinator(args.coordinator)
        config = dataclass_from_args(DashboardConfig, args)
        return serve(config)
    except (ValueError, OSError) as err:
        print(f"ripples dashboard serve: error: {err}", file=sys.stderr)
        return 2


def add_coordinator_parser(coord_sub: argparse._SubParsersAction) -> None:
    serve = coord_sub.add_parser(
        "serve", help="serve runs over gRPC: with run options, that run at once; without, "
        "the runs `ripples submit` queues (docs/service.md)")
    serve.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    serve.add_argument("--port", type=port, default=50051, help="gRPC port (default: 50051)")
    serve.add_argument("--store-port", type=port, default=0,
                       help="rendezvous store port (default: any free port)")
    serve.add_argument("--metrics-port", type=port, default=9400,
                       help="HTTP port for /metrics and Prometheus service discovery at /sd "
                            "(0: any free port; default: 9400)")
    serve.add_argument("--advertise-host", default="",
                       help="address workers use to reach the store (default: host name)")
    serve.add_argument("--netns", default="", metavar="NAME",
                       help="serve workers that live in network namespace NAME (`ip netns "
                            "list`): listen on --host inside it, and on 127.0.0.1 (a port of "
                            "its own, printed) here for local tools; docs/network.md")
    serve.add_argument("--state-dir", default="",
                       help="keep the runs in DIR (SQLite: DIR/history.db, the active "
                            "run's state and every run's logs under DIR/runs/); started "
                            "again on the same DIR, the coordinator resumes the active run "
                            "(its saved settings win over the run options) and its queue, "
                            "and workers ride over the restart (docs/fault-tolerance.md)")
    serve.add_argument("--exit-when-done", action="store_true",
                       help="exit once every run submitted has ended and its workers left")
    serve.add_argument("--quiet", action="store_true", help="log warnings only")
    add_server_security_arguments(serve)
    add_run_arguments(serve)
    serve.set_defaults(func=cmd_serve, takes_script=True)


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    from ripples.worker.daemon import WorkerConfig

    worker = sub.add_parser("worker", help="the worker daemon")
    worker_sub = worker.add_subparsers(dest="worker_command", required=True)
    wrun = worker_sub.add_parser(
        "run", help="run one worker (or --nproc-per-node K of them) until the run ends",
        usage="ripples worker run [options] [-- python train.py ARGS]")
    add_dataclass_arguments(wrun, WorkerConfig, defaults={
        "coordinator": os.environ.get(ENV_COORDINATOR, "")}, types={"metrics_port": port_or_off})
    wrun.add_argument("--quiet", action="store_true", help="log warnings only")
    add_client_security_arguments(wrun)
    wrun.set_defaults(func=cmd_worker, takes_script=True)


def add_dashboard_parser(sub: argparse._SubParsersAction) -> None:
    from ripples.dashboard.config import DashboardConfig

    dash = sub.add_parser("dashboard", help="the live web dashboard")
    dash_sub = dash.add_subparsers(dest="dashboard_command", required=True)
    dserve = dash_sub.add_parser("serve", help="serve the dashboard of a coordinator's run")
    add_dataclass_arguments(dserve, DashboardConfig, defaults={
        "coordinator": os.environ.get(ENV_COORDINATOR, "")})
    dserve.add_argument("--quiet", action="store_true", help="log warnings only")
    add_client_security_arguments(dserve)
    dserve.set_defaults(func=cmd_dashboard)
