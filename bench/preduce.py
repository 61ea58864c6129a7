"""P-Reduce overhead: Ripples' P-Reduce vs a plain torch.distributed all_reduce.

Both average the same number of floats over the same member processes, measured side by
side in one run, interleaved round by round so that machine noise hits both alike:

- ``all_reduce``: ``dist.all_reduce`` (SUM) of a tensor on the default process group of
  the members: the bare collective;
- ``all_reduce + mean``: the same, then dividing by the group size in place: what a user
  averaging models with torch.distributed would write;
- ``preduce cached``: ``ripples.worker.dataplane.preduce.preduce`` on a communicator taken from the
  worker's cache (the steady state of a run: scale, collective, pointer swap);
- ``preduce in a step``: the same as ripples.Optimizer's step runs it: with the member's
  non-finite flag known (the step's gate sums the state for it at every step, P-Reduce or
  not, and the step's first P-Reduce sends it as it is; worker/synchronizer.py);
- ``preduce uncached``: the same as ``preduce cached``, building a fresh communicator
  for every call (the first group of a member set: rendezvous through the store plus the
  collective).

    python -m ripples.bench.preduce                 # gloo on CPU, 3 members
    python -m ripples.bench.preduce --device cuda   # NCCL, one GPU per member

Prints per-call medians, and the median over rounds of each method's time relative to
``all_reduce`` measured in the same round (the goal for the cached case is at most 1.1x).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ripples.bench.members import run_members
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import (
    CommunicatorCache,
    CommunicatorFactory,
    connect_store,
)
from ripples.worker.dataplane.preduce import preduce

TIMEOUT_SECONDS = 60.0
METHODS = ("all_reduce", "all_reduce + mean", "preduce cached", "preduce in a step",
           "preduce uncached")


@dataclass(kw_only=True)
class BenchConfig:
    group_size: int = 3
    """Member processes in the group."""
    sizes: tuple[int, ...] = (272_474, 4_000_000)
    """Floats per collective (272,474: the synthetic-cnn ResNet-20; 4M: 16 MB)."""
    calls: int = 20
    """Timed calls per method per round."""
    rounds: int = 15
    """Interleaved rounds; the report takes the median over rounds."""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL, member i on cuda:i)."""


class _Flat(torch.nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(numel))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _operations(cache: CommunicatorCache, rank: int, size: int, params: AveragedState,
                plain: torch.Tensor, key: str) -> dict[str, Callable[[], None]]:
    uncached_keys = iter(range(10**9))

    def uncached() -> None:
        ukey = f"bench/uncached/{params.numel}/{next(uncached_keys)}"
        preduce(params, cache.get(ukey, rank, size, create=True), TIMEOUT_SECONDS)
        cache.drop(ukey)

    def mean() -> None:
        dist.all_reduce(plain)
        plain.div_(size)

    flag = torch.zeros(1, dtype=params.flat.dtype, device=params.flat.device)

    def in_a_step() -> None:
        with params.flag_known(flag):
            preduce(params, cache.get(key, rank, size, create=False), TIMEOUT_SECONDS)

    return {
        "all_reduce": lambda: dist.all_reduce(plain),
        "all_reduce + mean": mean,
        "preduce cached": lambda: preduce(
            params, cache.get(key, rank, size, create=False), TIMEOUT_SECONDS),
        "preduce in a step": in_a_step,
        "preduce uncached": uncached,
    }


def _member(rank: int, port: int, cfg: BenchConfig, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store("127.0.0.1", port, TIMEOUT_SECONDS)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore("world/", store), rank=rank, world_size=cfg.group_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS),
    )
    cache = CommunicatorCache(CommunicatorFactory(store, device, TIMEOUT_SECONDS,
                                                  gloo_hostname="127.0.0.1"))
    results: dict[tuple[int, str], list[float]] = {}
    for numel in cfg.sizes:
        params = AveragedState(_Flat(numel).to(device))
        plain = torch.randn(numel, device=device)
        key = f"bench/cached/{numel}"
        preduce(params, cache.get(key, rank, cfg.group_size, create=True), TIMEOUT_SECONDS)

        ops = _operations(cache, rank, cfg.group_size, params, plain, key)
        for op in ops.values():  # warm-up
            op()
        for round_index in range(cfg.rounds):
            # Rotate the order each round so no method always runs first.
            shift = round_index % len(METHODS)
            order = METHODS[shift:] + METHODS[:shift]
            for name in order:
                calls = max(3, cfg.calls // 5) if name == "preduce uncached" else cfg.calls
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                for _ in range(calls):
                    ops[name]()
                _sync(device)
                results.setdefault((numel, name), []).append(
                    (time.perf_counter() - start) / calls)
    if rank == 0:
        out.put(results)
    cache.close()
    dist.destroy_process_group()


def run(cfg: BenchConfig) -> dict[tuple[int, str], list[float]]:
    """Seconds per call in each round, by (floats, method), as seen by member 0."""
    if cfg.group_size < 2:
        raise ValueError("group_size must be at least 2")
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.group_size:
        raise ValueError(f"--device cuda needs {cfg.group_size} GPUs, "
                         f"found {torch.cuda.device_count()}")
    (results,) = run_members(_member, cfg.group_size, cfg, replies=1, timeout_seconds=600)
    return results  # type: ignore[no-any-return]


def report(cfg: BenchConfig, results: dict[tuple[int, str], list[float]]) -> list[dict]:
    """Rows: per-call median, and the median and quartiles of same-round ratios to
    all_reduce (the quartiles show how much of a difference is machine noise)."""
    rows = []
    for numel in cfg.sizes:
        base = results[(numel, "all_reduce")]
        for name in METHODS:
            times = results[(numel, name)]
            ratios = [t / b for t, b in zip(times, base, strict=True)]
            q1, _, q3 = (statistics.quantiles(ratios, n=4) if len(ratios) >= 2
                         else (ratios[0],) * 3)
            rows.append({"floats": numel, "method": name,
                         "ms_per_call": statistics.median(times) * 1e3,
                         "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=BenchConfig.group_size)
    parser.add_argument("--sizes", default=",".join(map(str, BenchConfig.sizes)),
                        help="comma-separated floats per collective")
    parser.add_argument("--calls", type=int, default=BenchConfig.calls)
    parser.add_argument("--rounds", type=int, default=BenchConfig.rounds)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    cfg = BenchConfig(group_size=args.group_size, sizes=sizes, calls=args.calls,
                      rounds=args.rounds, device=args.device)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    print(f"P-Reduce vs all_reduce: {cfg.group_size} members, {backend}, "
          f"median of {cfg.rounds} interleaved rounds", file=sys.stderr)
    rows = report(cfg, run(cfg))
    print(f"{'floats':>10} {'MB':>7} {'method':>18} {'ms/call':>9} {'vs all_reduce':>14} "
          f"{'quartiles':>12}")
    for row in rows:
        print(f"{row['floats']:>10} {row['floats'] * 4 / 1e6:>7.2f} {row['method']:>18} "
              f"{row['ms_per_call']:>9.3f} {row['ratio']:>13.2f}x "
              f"{row['ratio_q1']:>5.2f}-{row['ratio_q3']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
