"""Commands of the coordinator service (docs/service.md):

    ripples submit [run options] [-- python train.py]   queue a run
    ripples runs                                        every run and every host agent
    ripples status [RUN]                                one run, as the dashboard shows it
    ripples stop RUN                                    stop a run (cancel a queued one)
    ripples logs RUN [--worker HOST/LOCAL_RANK]         its workers' output
    ripples checkpoint --output model.pt                the live workers' average, now
    ripples coordinator health                          the gRPC health check (probes)

Each one talks to `--coordinator HOST:PORT` (default: $RIPPLES_COORDINATOR) with the
client security flags (--token-file, --tls-ca, ...). RUN is a run id, a unique prefix of
one, or a unique name. How runs read in a terminal: ripples/cli/run_views.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ripples.cli.arguments import add_client_security_arguments, add_coordinator_option
from ripples.cli.run import (
    RANKS_PER_WORKER_HELP,
    SCRIPT_RUN_DEFAULTS,
    add_run_arguments,
    run_settings,
)
from ripples.cli.run_views import (
    agents_table,
    progress_line,
    render_status,
    runs_table,
    status_json,
    task_of,
)
from ripples.protocols.registry import check_ranks_per_worker
from ripples.rpc import CoordinatorCallError
from ripples.run_records import ENDED, agent_summary, printable, state_name, summary
from ripples.v1 import coordinator_pb2 as pb

WAIT_POLL_SECONDS = 2.0


def _client(args: argparse.Namespace):  # -> CoordinatorClient (import kept lazy)
    """A client of the coordinator, once it is reachable (a command typed right after the
    coordinator was started waits for it, up to --connect-timeout-seconds)."""
    from ripples.worker.client import CoordinatorClient

    client = CoordinatorClient(args.coordinator)
    try:
        client.wait_until_reachable(args.connect_timeout_seconds)
    except CoordinatorCallError:
        client.close()
        raise
    return client


def _fail(command: str, err: Exception, code: int = 1) -> int:
    print(printable(f"ripples {command}: error: {err}"), file=sys.stderr)
    return code


# ---------------------------------------------------------------------------- submit
def cmd_submit(args: argparse.Namespace) -> int:
    script: list[str] = args.script
    try:
        settings = run_settings(args, script)
        check_ranks_per_worker(args.ranks_per_worker, settings.to_proto(), script)
    except ValueError as err:
        return _fail("submit", err, 2)
    options = settings.options()
    workdir = args.workdir or (str(Path.cwd()) if script else "")
    try:
        client = _client(args)
    except CoordinatorCallError as err:
        return _fail("submit", err)
    try:
        info = client.submit_run(json.dumps(options), name=args.name, command=script,
                                 workdir=workdir, ranks_per_worker=args.ranks_per_worker)
        if args.json and not args.wait:
            print(json.dumps(summary(info), indent=2))
        else:
            where = ("starts now" if info.state == pb.RUN_STATE_RUNNING
                     else f"queued at place {info.queue_position}")
            ranks = (f" of {info.ranks_per_worker} ranks"
                     if info.ranks_per_worker > 1 else "")
            print(printable(f"submitted run {info.run_id} ({info.name}): {info.protocol}, "
                            f"{info.num_workers} workers{ranks}, {task_of(info)}; {where}"),
                  flush=True)
        if not args.wait:
            return 0
        return _wait(client, info.run_id, args.json)
    except CoordinatorCallError as err:
        return _fail("submit", err, 2 if "bad run" in str(err) else 1)
    finally:
        client.close()


def _wait(client, run_id: str, as_json: bool) -> int:  # type: ignore[no-untyped-def]
    """Follow a run until it ends: 0 if it finished, 1 otherwise."""
    last = ""
    while True:
        status = client.run_status(run_id)
        info = status.run
        line = (f"{state_name(info.state)}: {progress_line(status)}" if info.state
                not in ENDED else "")
        if line and line != last:
            print(line, file=sys.stderr, flush=True)
            last = line
        if info.state in ENDED:
            if as_json:
                print(json.dumps(summary(info), indent=2))
            else:
                print(printable(f"run {info.run_id} {state_name(info.state)}: "
                                f"{info.stop_reason}" + (f"; model at {info.model_path}"
                                                         if info.model_path else "")))
            return 0 if info.state == pb.RUN_STATE_FINISHED else 1
        time.sleep(WAIT_POLL_SECONDS)


# ---------------------------------------------------------------------------- runs
def cmd_runs(args: argparse.Namespace) -> int:
    try:
        client = _client(args)
    except CoordinatorCallError as err:
        return _fail("runs", err)
    try:
        listing = client.list_runs()
    except CoordinatorCallError as err:
        return _fail("runs", err)
    finally:
        client.close()
    if args.json:
        print(json.dumps({"runs": [summary(r) for r in listing.runs],
                          "agents": [agent_summary(a) for a in listing.agents]}, indent=2))
        return 0
    if not listing.runs:
        print("no runs yet: `ripples submit` adds one")
    else:
        print(runs_table(listing.runs))
    if listing.agents:
        print()
        print(agents_table(listing.agents))
    return 0


# ---------------------------------------------------------------------------- status
def cmd_status(args: argparse.Namespace) -> int:
    try:
        client = _client(args)
    except CoordinatorCallError as err:
        return _fail("status", err)
    try:
        status = client.run_status(args.run)
    except CoordinatorCallError as err:
        return _fail("status", err)
    finally:
        client.close()
    if not status.HasField("run"):
        print("no runs yet: `ripples submit` adds one")
        return 0
    if args.json:
        print(json.dumps(status_json(status), indent=2))
        return 0
    print(render_status(status))
    return 0


# ---------------------------------------------------------------------------- stop, logs
def cmd_stop(args: argparse.Namespace) -> int:
    try:
        client = _client(args)
    except CoordinatorCallError as err:
        return _fail("stop", err)
    try:
        client.stop_run(args.reason, args.run)
        status = client.run_status(args.run)
    except CoordinatorCallError as err:
        return _fail("stop", err)
    finally:
        client.close()
    info = status.run
    verb = "cancelled" if info.state == pb.RUN_STATE_CANCELLED else "stopping"
    print(printable(f"run {info.run_id} ({info.name}): {verb} ({args.reason})"))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    try:
        client = _client(args)
    except CoordinatorCallError as err:
        return _fail("logs", err)
    try:
        run_id = args.run
        status = client.run_status(run_id)
        worker = args.worker
        if worker.isdigit():  # a worker id: its host and local rank
            match = [w for w in status.workers if w.worker_id == int(worker)]
            if not match:
                raise CoordinatorCallError(f"run {status.run.run_id} has no worker {worker} "
                                           "(`ripples status RUN` lists them)", None)
            worker = f"{match[0].host}/{match[0].local_rank}"
        several = not worker
        printed = 0
        for batch in client.logs(status.run.run_id, worker=worker, follow=args.follow,
                                 tail=args.tail):
            for line in batch.lines:
                print(f"[{printable(batch.worker)}] {line}" if several else line)
                printed += 1
        sys.stdout.flush()
        if not printed and not args.follow:
            print(f"run {status.run.run_id} has no worker output (logs come from host "
                  "agents: `ripples worker run --agent`)", file=sys.stderr)
    except CoordinatorCallError as err:
        return _fail("logs", err)
    except BrokenPipeError:  # `ripples logs RUN | head`
        return 0
    finally:
        client.close()
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """The gRPC health check of a coordinator: 0 when each of its services (Worker, Runs,
    Agents) serves (container and Kubernetes probes; Kubernetes' own grpc probe cannot
    speak TLS)."""
    import dataclasses
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ripples.client_security import ClientSecurity
    from ripples.rpc import CHANNEL_OPTIONS
    from ripples.security import SERVICES

    security = dataclasses.replace(ClientSecurity.from_env(), server_name=args.tls_server_name)
    channel = security.channel(args.coordinator, CHANNEL_OPTIONS)
    deadline = time.monotonic() + args.timeout_seconds
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in SERVICES:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service),
                               timeout=max(0.001, deadline - time.monotonic()))
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                break
    except grpc.RpcError as err:
        print(f"ripples coordinator health: {args.coordinator}: {err.code().name}: "  # type: ignore[attr-defined]
              f"{err.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    finally:
        channel.close()
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.coordinator}: {name}" + ("" if serving else f" ({service})"))
    return 0 if serving else 1


# ---------------------------------------------------------------------------- checkpoint
def cmd_checkpoint(args: argparse.Namespace) -> int:
    """The consensus model now: the coordinator streams the live workers' models, this
    command averages them (one model in memory at a time) and writes the average."""
    import io

    import torch

    from ripples.consensus import RunningAverage
    from ripples.files import write_atomically
    from ripples.worker.client import CoordinatorClient

    if args.timeout_seconds <= 0:
        return _fail("checkpoint", ValueError("--timeout-seconds must be positive"), 2)
    started = time.monotonic()
    client = CoordinatorClient(args.coordinator)
    average = RunningAverage()
    try:
        info = client.consensus(args.timeout_seconds, lambda _, blob: average.add(blob))
    except (CoordinatorCallError, ValueError) as err:
        return _fail("checkpoint", err)
    finally:
        client.close()
    buffer = io.BytesIO()
    torch.save(average.state_dict(), buffer)
    data = buffer.getvalue()
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data)
    done = {"path": str(path), "consensus_id": info.consensus_id,
            "workers": list(info.workers), "iterations": average.iterations,
            "consensus_distance": average.consensus_distance,
            "seconds": round(time.monotonic() - started, 3),
            "collect_seconds": round(info.seconds, 3), "bytes": len(data)}
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        print(f"wrote {path}: the average of workers {done['workers']} at iterations "
              f"{done['iterations']} (consensus distance {average.consensus_distance:.3g}, "
              f"{done['seconds']:.2f} s)")
    return 0


# ---------------------------------------------------------------------------- parsers
def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The service's commands, on `ripples`' sub-parsers."""
    p = sub.add_parser("submit", help="queue a run on a coordinator service",
                       usage="ripples submit [options] [-- python train.py ARGS]")
    add_run_arguments(p, defaults=SCRIPT_RUN_DEFAULTS)
    p.add_argument("--name", default="", help="the run's name (default: protocol and task "
                   "or script)")
    p.add_argument("--ranks-per-worker", type=int, default=1, metavar="G",
                   help=RANKS_PER_WORKER_HELP + "; a host agent starts each worker's G "
                   "processes on G of its slots (devices)")
    p.add_argument("--workdir", default="", help="the script's working directory on the "
                   "hosts (default: the current directory; an agent without it uses its own)")
    p.add_argument("--wait", action="store_true",
                   help="follow the run until it ends; exit 0 if it finished, 1 otherwise")
    p.add_argument("--json", action="store_true", help="print the run as JSON")
    _common(p)
    p.set_defaults(func=cmd_submit, takes_script=True)

    p = sub.add_parser("runs", help="list a coordinator service's runs and host agents")
    p.add_argument("--json", action="store_true", help="print JSON")
    _common(p)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("status", help="one run's status (default: the active run)")
    p.add_argument("run", nargs="?", default="", metavar="RUN",
                   help="run id, unique id prefix or name (default: the active run, else "
                        "the newest)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _common(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("stop", help="stop a run (a queued one is cancelled)")
    p.add_argument("run", metavar="RUN", type=_run_named,
                   help="run id, unique id prefix or name")
    p.add_argument("--reason", default="stopped by an operator",
                   help="recorded as the run's stop reason")
    _common(p)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("logs", help="a run's worker output (sent by the host agents)")
    p.add_argument("run", metavar="RUN", help="run id, unique id prefix or name")
    p.add_argument("--worker", default="", metavar="W",
                   help="one worker: HOST/LOCAL_RANK, or its worker id (default: all, each "
                        "line prefixed with its worker)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing while the run is active")
    p.add_argument("--tail", type=_count, default=0, metavar="N",
                   help="only the last N lines of each worker (0: all)")
    _common(p)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("checkpoint", help="write the running run's consensus model now "
                       "(the average of the live workers' models)")
    add_coordinator_option(p)
    p.add_argument("--output", required=True,
                   help="file to write (a state_dict, torch.load-able), written whole or "
                        "not at all")
    p.add_argument("--timeout-seconds", type=float, default=60.0,
                   help="how long the workers have to publish their models, each at its "
                        "next step boundary (default: 60)")
    p.add_argument("--json", action="store_true", help="print what was averaged as JSON")
    add_client_security_arguments(p)
    p.set_defaults(func=cmd_checkpoint)


def add_health_parser(coord_sub: argparse._SubParsersAction) -> None:
    p = coord_sub.add_parser("health", help="check that a coordinator serves (gRPC health; "
                             "exit 0 when SERVING)")
    p.add_argument("--tls-server-name", default="",
                   help="check the coordinator's certificate for this name (a probe that "
                        "dials 127.0.0.1)")
    p.add_argument("--timeout-seconds", type=float, default=5.0,
                   help="how long to wait for the answer (default: 5)")
    add_coordinator_option(p)
    add_client_security_arguments(p)
    p.set_defaults(func=cmd_health)


def _run_named(text: str) -> str:
    """A RUN argument that names one: an empty one would reach the coordinator as "the
    active run", whatever that is by then."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give the run's id, a unique prefix of one or its "
                                         "name (`ripples runs` lists them)")
    return text


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    add_coordinator_option(parser)
    parser.add_argument("--connect-timeout-seconds", type=float, default=30.0,
                        help="how long to wait for the coordinator to be reachable "
                             "(default: 30)")
    add_client_security_arguments(parser)
