"""Coordinator throughput and latency under many concurrent simulated workers.

A real coordinator (gRPC, grpc.aio) serves a ripples run whose workers are simulated by
client processes: each simulated worker does nothing but the synchronisation of a real
one on its Synchronize stream (a group request, then a release for each group it is
given), back to back, so the coordinator is the bottleneck. Server and clients share
this machine's cores.

    python -m ripples.bench.coordinator_load                   # 8, 32 and 64 workers
    python -m ripples.bench.coordinator_load --workers 64 --policy random
    python -m ripples.bench.coordinator_load --workers 64 --rate 2000   # offered load

Prints, per level of concurrency, group requests per second and two latencies:

- service: the round trip of the request that completed its group (the last member to
  ask, who waits for nobody): the coordinator's own response time under this load;
- request: every request's round trip, which also includes waiting for the group's
  other members to ask (in this closed loop, mostly queueing behind the other workers).

and where the machine's CPU went in the window (from /proc): the cores the coordinator's
process used and the client processes' (the load generator's own cost), and the
coordinator's CPU time per request: 1 / that is what the service would answer with a
core of its own, whatever the generator costs.

`--floor` measures, in the same run and with the same load generator, gRPC's own cost: a
server that answers the same RPCs at once and does nothing else (a fresh group per
request, releases dropped). What the coordinator spends per request above that floor is
its own Python (the service and the core); the floor is grpc.aio's.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.loop_thread import LoopThreadService
from ripples.rpc import SERVER_OPTIONS, aio_channel
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc
from ripples.worker.client import CoordinatorClient

RPC_TIMEOUT_SECONDS = 30.0


@dataclass(kw_only=True)
class LoadConfig:
    workers: tuple[int, ...] = (8, 32, 64)
    policy: str = "smart"
    """Group generator under load: smart or random."""
    client_processes: int = 2
    warmup_seconds: float = 1.0
    measure_seconds: float = 5.0
    offered_rate: float = 0.0
    """Iterations per second that all simulated workers together start (each worker one
    every workers/rate seconds, as if computing that long); 0: back to back (saturation)."""
    floor: bool = False
    """Also measure gRPC's floor (a server that does nothing) at each level."""


@dataclass(kw_only=True)
class LoadResult:
    workers: int
    server: str
    """"coordinator", or "grpc floor" (a server that answers at once, doing nothing)."""
    requests_per_second: float
    service_p50_ms: float
    service_p99_ms: float
    request_p50_ms: float
    request_p99_ms: float
    groups_per_second: float
    server_cores: float
    """CPU seconds of the coordinator's process per second of the window."""
    client_cores: float
    """CPU seconds of the load generator's processes per second of the window."""
    server_us_per_request: float
    """The coordinator's CPU microseconds per group request (its releases included)."""


Sample = tuple[int, float, float]  # (group id or 0, sent, answered), monotonic clock


async def _simulated_worker(stub: pb_grpc.WorkerStub, index: int, planned: int,
                            interval: float, samples: list[Sample]) -> None:
    """One worker's synchronisation loop; with interval > 0 it starts an iteration at most
    every `interval` seconds (a worker whose compute takes that long), else back to back."""
    reply = await stub.Register(pb.RegisterRequest(host=f"sim{index // 8}", local_rank=index % 8,
                                                   device="cpu", pid=index),
                                timeout=RPC_TIMEOUT_SECONDS)
    wid = reply.worker_id
    await stub.AwaitStart(pb.AwaitStartRequest(worker_id=wid, timeout_seconds=60,
                                               planned_iterations=planned), timeout=90)
    stream = stub.Synchronize()
    iteration = 0
    next_start = time.monotonic() + random.Random(index).uniform(0, interval)
    while True:
        iteration += 1
        if interval > 0:
            now = time.monotonic()
            await asyncio.sleep(max(0.0, next_start - now))
            # A worker that fell behind starts its next iteration late, not in a burst.
            next_start = max(next_start, now - interval) + interval
        more = True
        while more:
            t0 = time.monotonic()
            await stream.write(pb.SyncMessage(request=pb.GroupRequest(
                worker_id=wid, iteration=iteration, timeout_seconds=10)))
            group = await asyncio.wait_for(stream.read(), RPC_TIMEOUT_SECONDS)
            t1 = time.monotonic()
            if group is grpc.aio.EOF or group.outcome == pb.GROUP_OUTCOME_STOP:
                await stream.done_writing()
                return
            samples.append((group.group.group_id, t0, t1))
            if group.outcome == pb.GROUP_OUTCOME_RETRY:
                continue
            more = group.outcome == pb.GROUP_OUTCOME_GROUP and group.more
            if group.outcome == pb.GROUP_OUTCOME_GROUP:
                await stream.write(pb.SyncMessage(release=pb.ReleaseRequest(
                    worker_id=wid, group_id=group.group.group_id, ok=True)))


async def _client_main(address: str, indices: list[int], interval: float,
                       out: mp.Queue) -> None:
    samples: list[Sample] = []
    async with aio_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        await asyncio.gather(*(_simulated_worker(stub, i, 10**9, interval, samples)
                               for i in indices))
    out.put(samples)


def _client_process(address: str, indices: list[int], interval: float, out: mp.Queue) -> None:
    asyncio.run(_client_main(address, indices, interval, out))


def _cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(kw_only=True)
class _Target:
    """A server under load: where it listens, and what the measurement asks of it."""

    name: str
    address: str
    started: Callable[[], bool]
    groups_formed: Callable[[], int]
    stop: Callable[[], None]
    close: Callable[[], None]


def _coordinator(num_workers: int, cfg: LoadConfig) -> _Target:
    run = RunSettings(protocol=f"ripples-{cfg.policy}", num_workers=num_workers,
                      workers_per_node=8, iterations=10**9, lease_seconds=600,
                      heartbeat_interval_seconds=60)
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=run)).start()
    client = CoordinatorClient(server.address)

    def close() -> None:
        client.close()
        server.stop()

    return _Target(name="coordinator", address=server.address,
                   started=lambda: client.run_status().started,
                   groups_formed=lambda: client.run_status().num_groups_formed,
                   stop=lambda: client.stop_run("benchmark over"), close=close)


class _FloorServicer(pb_grpc.WorkerServicer):
    """The RPCs the load generator makes, answered at once with no work: gRPC's floor."""

    def __init__(self) -> None:
        self.registered = 0
        self.groups = 0
        self.stopping = False

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> pb.RegisterReply:
        self.registered += 1
        return pb.RegisterReply(worker_id=self.registered)

    async def AwaitStart(self, request: pb.AwaitStartRequest,
                         context: grpc.aio.ServicerContext) -> pb.AwaitStartReply:
        return pb.AwaitStartReply()

    async def Synchronize(self, request_iterator: object,
                          context: grpc.aio.ServicerContext) -> None:
        while (message := await context.read()) is not grpc.aio.EOF:
            if message.WhichOneof("kind") != "request":
                continue  # a release: nothing to do
            if self.stopping:
                await context.write(pb.GroupReply(outcome=pb.GROUP_OUTCOME_STOP))
                continue
            self.groups += 1
            await context.write(pb.GroupReply(outcome=pb.GROUP_OUTCOME_GROUP, group=pb.Group(
                group_id=self.groups, members=(0, 1, 2), initiator=0, comm_id=1)))


class _FloorServer(LoopThreadService):
    thread_name = "grpc-floor"

    def __init__(self) -> None:
        super().__init__()
        self.servicer = _FloorServicer()
        self.port = 0

    async def _main(self) -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_WorkerServicer_to_server(self.servicer, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await self._until_stopped()
        await server.stop(grace=1.0)


def _floor(num_workers: int) -> _Target:
    server = _FloorServer().start()
    servicer = server.servicer

    def stop() -> None:
        servicer.stopping = True

    return _Target(name="grpc floor", address=f"127.0.0.1:{server.port}",
                   started=lambda: servicer.registered >= num_workers,
                   groups_formed=lambda: servicer.groups, stop=stop, close=server.stop)


def measure(num_workers: int, cfg: LoadConfig, *, floor: bool = False) -> LoadResult:
    """One level: the coordinator (or, `floor`, gRPC's floor) under the load generator."""
    target = _floor(num_workers) if floor else _coordinator(num_workers, cfg)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    shards = [list(range(num_workers))[p::cfg.client_processes]
              for p in range(cfg.client_processes)]
    interval = num_workers / cfg.offered_rate if cfg.offered_rate > 0 else 0.0
    procs = [ctx.Process(target=_client_process, args=(target.address, s, interval, out))
             for s in shards if s]
    try:
        for p in procs:
            p.start()
        status_deadline = time.monotonic() + 120
        while not target.started():
            if time.monotonic() > status_deadline:
                raise TimeoutError("simulated workers did not all register within 120 s")
            time.sleep(0.05)
        start = time.monotonic() + cfg.warmup_seconds
        end = start + cfg.measure_seconds
        formed_at_start = _at(start, target.groups_formed)
        cpu_at_start = (_cpu_seconds(), sum(_cpu_seconds(p.pid) for p in procs if p.pid))
        formed_at_end = _at(end, target.groups_formed)
        cpu_at_end = (_cpu_seconds(), sum(_cpu_seconds(p.pid) for p in procs if p.pid))
        target.stop()
        samples = [x for _ in procs for x in out.get(timeout=60)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        target.close()
    window = [(g, t0, t1) for g, t0, t1 in samples if start <= t1 < end]
    requests = [t1 - t0 for _, t0, t1 in window]
    last_asked: dict[int, tuple[float, float]] = {}  # group -> its completing request
    for g, t0, t1 in window:
        if g and (g not in last_asked or t0 > last_asked[g][0]):
            last_asked[g] = (t0, t1)
    service = [t1 - t0 for t0, t1 in last_asked.values()]
    return LoadResult(
        workers=num_workers, server=target.name,
        requests_per_second=len(requests) / cfg.measure_seconds,
        service_p50_ms=_percentile(service, 0.5) * 1e3,
        service_p99_ms=_percentile(service, 0.99) * 1e3,
        request_p50_ms=_percentile(requests, 0.5) * 1e3,
        request_p99_ms=_percentile(requests, 0.99) * 1e3,
        groups_per_second=(formed_at_end - formed_at_start) / cfg.measure_seconds,
        server_cores=(cpu_at_end[0] - cpu_at_start[0]) / cfg.measure_seconds,
        client_cores=(cpu_at_end[1] - cpu_at_start[1]) / cfg.measure_seconds,
        server_us_per_request=((cpu_at_end[0] - cpu_at_start[0]) / len(requests) * 1e6
                               if requests else float("nan")),
    )


def _at(moment: float, read: Callable[[], int]) -> int:
    time.sleep(max(0.0, moment - time.monotonic()))
    return read()


def main(argv: list[str] | None = None) -> int:
    defaults = LoadConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default=",".join(map(str, defaults.workers)),
                        help="comma-separated numbers of simulated workers")
    parser.add_argument("--policy", choices=["smart", "random"], default=defaults.policy)
    parser.add_argument("--client-processes", type=int, default=defaults.client_processes)
    parser.add_argument("--seconds", type=float, default=defaults.measure_seconds,
                        help="measurement window per level")
    parser.add_argument("--rate", type=float, default=defaults.offered_rate,
                        help="offered load: iterations/s of all workers together, each "
                             "starting one every workers/rate s (default 0: back to back)")
    parser.add_argument("--floor", action="store_true",
                        help="also measure gRPC's floor at each level: a server that "
                             "answers the same RPCs at once, doing nothing")
    args = parser.parse_args(argv)
    try:
        levels = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        parser.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if (any(w < 2 for w in levels) or args.client_processes < 1 or args.seconds <= 0
            or args.rate < 0):
        parser.error("need >= 2 workers per level, >= 1 client process, a positive window "
                     "and a rate >= 0")
    cfg = LoadConfig(workers=levels, policy=args.policy,
                     client_processes=args.client_processes, measure_seconds=args.seconds,
                     offered_rate=args.rate, floor=args.floor)
    print(f"{'server':<12} {'workers':>7} {'requests/s':>11} {'groups/s':>9} {'service p50':>12} "
          f"{'p99':>8} {'request p50':>12} {'p99':>8} {'server cores':>12} "
          f"{'client cores':>12} {'server us/req':>13}")
    for level in cfg.workers:
        results = [measure(level, cfg)] + ([measure(level, cfg, floor=True)] if cfg.floor
                                           else [])
        for r in results:
            _print_row(r)
        if cfg.floor:
            service, floor = results
            print(f"{'':<12} {level:>7}  the coordinator spends "
                  f"{service.server_us_per_request / floor.server_us_per_request:.2f}x "
                  f"gRPC's floor per request ({service.server_us_per_request:.0f} against "
                  f"{floor.server_us_per_request:.0f} us)", flush=True)
    return 0


def _print_row(r: LoadResult) -> None:
    print(f"{r.server:<12} {r.workers:>7} {r.requests_per_second:>11.0f} "
          f"{r.groups_per_second:>9.0f} {r.service_p50_ms:>10.2f}ms {r.service_p99_ms:>6.2f}ms "
          f"{r.request_p50_ms:>10.2f}ms {r.request_p99_ms:>6.2f}ms "
          f"{r.server_cores:>12.2f} {r.client_cores:>12.2f} "
          f"{r.server_us_per_request:>13.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
