"""Coordinator throughput and latency under many concurrent simulated workers.

A real coordinator (gRPC, grpc.aio) serves a ripples run whose workers are simulated by
client processes: each simulated worker does nothing but the synchronisation RPCs of a
real one (RequestGroup, then ReleaseGroup for each group it is given), back to back, so
the coordinator is the bottleneck. Server and clients share this machine's cores.

    python -m ripples.bench.coordinator_load                   # 8, 32 and 64 workers
    python -m ripples.bench.coordinator_load --workers 64 --policy random

Prints, per level of concurrency, group requests per second and the p50/p99 round trip
of RequestGroup (which includes waiting for the group's other members to ask) and of
ReleaseGroup.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.rpc import aio_channel
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


@dataclass(kw_only=True)
class LoadResult:
    workers: int
    requests_per_second: float
    request_p50_ms: float
    request_p99_ms: float
    release_p50_ms: float
    release_p99_ms: float
    groups_per_second: float


Sample = tuple[float, float]  # (finish time, round trip seconds), monotonic clock


async def _simulated_worker(stub: pb_grpc.CoordinatorStub, index: int, planned: int,
                            requests: list[Sample], releases: list[Sample]) -> None:
    reply = await stub.Register(pb.RegisterRequest(host=f"sim{index // 8}", local_rank=index % 8,
                                                   device="cpu", pid=index),
                                timeout=RPC_TIMEOUT_SECONDS)
    wid = reply.worker_id
    await stub.AwaitStart(pb.AwaitStartRequest(worker_id=wid, timeout_seconds=60,
                                               planned_iterations=planned), timeout=90)
    iteration = 0
    while True:
        iteration += 1
        more = True
        while more:
            t0 = time.monotonic()
            group = await stub.RequestGroup(
                pb.GroupRequest(worker_id=wid, iteration=iteration, timeout_seconds=10),
                timeout=RPC_TIMEOUT_SECONDS)
            t1 = time.monotonic()
            requests.append((t1, t1 - t0))
            if group.outcome == pb.GROUP_OUTCOME_STOP:
                return
            if group.outcome == pb.GROUP_OUTCOME_RETRY:
                continue
            more = group.outcome == pb.GROUP_OUTCOME_GROUP and group.more
            if group.outcome == pb.GROUP_OUTCOME_GROUP:
                await stub.ReleaseGroup(pb.ReleaseRequest(worker_id=wid,
                                                          group_id=group.group.group_id, ok=True),
                                        timeout=RPC_TIMEOUT_SECONDS)
                t2 = time.monotonic()
                releases.append((t2, t2 - t1))


async def _client_main(address: str, indices: list[int], out: mp.Queue) -> None:
    requests: list[Sample] = []
    releases: list[Sample] = []
    async with aio_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        await asyncio.gather(*(_simulated_worker(stub, i, 10**9, requests, releases)
                               for i in indices))
    out.put((requests, releases))


def _client_process(address: str, indices: list[int], out: mp.Queue) -> None:
    asyncio.run(_client_main(address, indices, out))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(num_workers: int, cfg: LoadConfig) -> LoadResult:
    run = RunSettings(protocol=f"ripples-{cfg.policy}", num_workers=num_workers,
                      workers_per_node=8, iterations=10**9, lease_seconds=600,
                      heartbeat_interval_seconds=60)
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=run)).start()
    client = CoordinatorClient(server.address)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    shards = [list(range(num_workers))[p::cfg.client_processes]
              for p in range(cfg.client_processes)]
    procs = [ctx.Process(target=_client_process, args=(server.address, s, out))
             for s in shards if s]
    try:
        for p in procs:
            p.start()
        status_deadline = time.monotonic() + 120
        while not client.run_status().started:
            if time.monotonic() > status_deadline:
                raise TimeoutError("simulated workers did not all register within 120 s")
            time.sleep(0.05)
        start = time.monotonic() + cfg.warmup_seconds
        end = start + cfg.measure_seconds
        formed_at_start = _formed_after(client, start)
        formed_at_end = _formed_after(client, end)
        client.stop_run("benchmark over")
        results = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        client.close()
        server.stop()
    requests = [lat for r, _ in results for t, lat in r if start <= t < end]
    releases = [lat for _, r in results for t, lat in r if start <= t < end]
    return LoadResult(
        workers=num_workers, requests_per_second=len(requests) / cfg.measure_seconds,
        request_p50_ms=statistics.median(requests) * 1e3 if requests else float("nan"),
        request_p99_ms=_percentile(requests, 0.99) * 1e3,
        release_p50_ms=statistics.median(releases) * 1e3 if releases else float("nan"),
        release_p99_ms=_percentile(releases, 0.99) * 1e3,
        groups_per_second=(formed_at_end - formed_at_start) / cfg.measure_seconds,
    )


def _formed_after(client: CoordinatorClient, moment: float) -> int:
    time.sleep(max(0.0, moment - time.monotonic()))
    return client.run_status().num_groups_formed


def main(argv: list[str] | None = None) -> int:
    defaults = LoadConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default=",".join(map(str, defaults.workers)),
                        help="comma-separated numbers of simulated workers")
    parser.add_argument("--policy", choices=["smart", "random"], default=defaults.policy)
    parser.add_argument("--client-processes", type=int, default=defaults.client_processes)
    parser.add_argument("--seconds", type=float, default=defaults.measure_seconds,
                        help="measurement window per level")
    args = parser.parse_args(argv)
    try:
        levels = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        parser.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if any(w < 2 for w in levels) or args.client_processes < 1 or args.seconds <= 0:
        parser.error("need >= 2 workers per level, >= 1 client process, a positive window")
    cfg = LoadConfig(workers=levels, policy=args.policy,
                     client_processes=args.client_processes, measure_seconds=args.seconds)
    print(f"{'workers':>7} {'requests/s':>11} {'groups/s':>9} {'request p50':>12} "
          f"{'p99':>8} {'release p50':>12} {'p99':>8}")
    for level in cfg.workers:
        r = measure(level, cfg)
        print(f"{r.workers:>7} {r.requests_per_second:>11.0f} {r.groups_per_second:>9.0f} "
              f"{r.request_p50_ms:>10.2f}ms {r.request_p99_ms:>6.2f}ms "
              f"{r.release_p50_ms:>10.2f}ms {r.release_p99_ms:>6.2f}ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
