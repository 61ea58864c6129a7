"""What the coordinator service costs a run: queued runs on host agents, against workers
started by hand.

A run submitted to the service (docs/service.md) waits for the run before it, then its
agents start its worker processes, which import torch, register and build their models
before training starts. Started by hand, the same workers pay the same imports. This
measures both in one go on this machine:

- service: `--agents` host agents of `--slots` slots each and `--runs` runs submitted at
  once (the built-in task, `--iterations` each); per run, the time from the previous
  run's end (the first: from its submission) to its training start, and from its
  training start to its end;
- by hand: the same run on a one-run coordinator, its workers started as processes by
  this script (`ripples worker run`, as a host launcher does); the time from their start
  to the run's training start.

    python -m ripples.bench.service                   # 2 agents x 2 slots, 3 runs
    python -m ripples.bench.service --runs 5 --iterations 200

Prints per run the handover and training seconds, then the medians side by side and
their ratio (service handover / start by hand): what the service adds to starting a run's
workers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient

POLL_SECONDS = 0.05
RUN_TIMEOUT_SECONDS = 600.0


@dataclass(kw_only=True)
class Timing:
    run: str
    handover_seconds: float
    """From the previous run's end (the first run: its submission) to training."""
    training_seconds: float


def _options(args: argparse.Namespace) -> dict[str, object]:
    return {"num_workers": args.agents * args.slots, "workers_per_node": args.slots,
            "task": "digits", "iterations": args.iterations, "protocol": args.protocol}


def _wait(what: str, condition: Callable[[], bool],
          timeout: float = RUN_TIMEOUT_SECONDS) -> float:
    """Poll `condition()` until true; the monotonic time it became so."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(POLL_SECONDS)
    return time.monotonic()


def measure_service(args: argparse.Namespace, directory: Path) -> list[Timing]:
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(directory / "state"))).start()
    client = CoordinatorClient(server.address)
    agents = []
    try:
        for i in range(args.agents):
            with (directory / f"agent-{i}.log").open("w") as log:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "ripples.cli", "worker", "run", "--agent",
                     "--coordinator", server.address, "--host", f"node-{i}",
                     "--nproc-per-node", str(args.slots), "--metrics-port", "-1",
                     "--output-dir", str(directory / f"agent-{i}")],
                    stdout=subprocess.DEVNULL, stderr=log))
        _wait("the agents' polls", lambda: len(client.list_runs().agents) == args.agents)
        since = time.monotonic()
        ids = [client.submit_run(json.dumps(_options(args)), name=f"bench-{i}").run_id
               for i in range(args.runs)]
        timings = []
        for run_id in ids:
            def training(r: str = run_id) -> bool:
                return client.run_status(r).started

            def ended(r: str = run_id) -> bool:
                return client.run_status(r).run.state not in (pb.RUN_STATE_RUNNING,
                                                              pb.RUN_STATE_QUEUED)

            trained = _wait(f"run {run_id}'s training", training)
            end = _wait(f"run {run_id}'s end", ended)
            info = client.run_status(run_id).run
            if info.state != pb.RUN_STATE_FINISHED:
                raise RuntimeError(f"run {run_id} {info.state}: {info.stop_reason}")
            timings.append(Timing(run=run_id, handover_seconds=trained - since,
                                  training_seconds=end - trained))
            since = end
        return timings
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(60)
        client.close()
        server.stop()


def measure_by_hand(args: argparse.Namespace) -> float:
    """Seconds from starting the workers' processes to the run's training start."""
    server = CoordinatorServer(ServerConfig(
        host="127.0.0.1", port=0, run=RunSettings.build(**_options(args)))).start()
    client = CoordinatorClient(server.address)
    workers = []
    try:
        started = time.monotonic()
        for i in range(args.agents * args.slots):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "ripples.cli", "worker", "run", "--coordinator",
                 server.address, "--host", f"node-{i // args.slots}", "--local-rank",
                 str(i % args.slots), "--metrics-port", "-1", "--quiet"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        trained = _wait("training by hand", lambda: client.run_status().started)
        _wait("the run's end by hand", lambda: all(w.poll() is not None for w in workers))
        return trained - started
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        client.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.service",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="workers per agent")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=100, help="per worker and run")
    parser.add_argument("--protocol", default="ripples-smart")
    args = parser.parse_args(argv)
    if args.agents < 1 or args.slots < 1 or args.runs < 2 or args.agents * args.slots < 2:
        parser.error("give at least 2 runs and 2 workers (agents x slots)")
    with tempfile.TemporaryDirectory(prefix="ripples-bench-service-") as tmp:
        timings = measure_service(args, Path(tmp))
    by_hand = [measure_by_hand(args) for _ in range(2)]
    print(f"{args.runs} runs of {args.agents * args.slots} workers ({args.protocol}, "
          f"{args.iterations} iterations each) on {args.agents} agents x {args.slots} slots")
    print(f"{'run':<14}{'handover s':>12}{'training s':>12}")
    for t in timings:
        print(f"{t.run:<14}{t.handover_seconds:>12.2f}{t.training_seconds:>12.2f}")
    handover = statistics.median(t.handover_seconds for t in timings[1:])
    hand = statistics.median(by_hand)
    print(f"median handover (a run's end to the next one's training): {handover:.2f} s")
    print(f"median start by hand (processes started to training):      {hand:.2f} s")
    print(f"ratio service / by hand: {handover / hand:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
