"""`allreduce`: PyTorch DistributedDataParallel over all workers, the usual baseline."""

# No `from __future__ import annotations` here: DDP checks the comm hook's `bucket`
# annotation at run time and rejects a string.

import datetime
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ripples.worker.strategies.base import SyncContext, SyncResult, SyncStrategy
from ripples.worker.strategies.lockstep import LockstepStop


class AllReduceStrategy(SyncStrategy):
    """Gradients are all-reduced by DDP inside backward; every worker waits for the slowest.

    The all-reduce overlaps the backward pass, so its time is measured with a DDP
    communication hook (first bucket launched to last bucket done) and reported as
    preduce_seconds; it includes the wait for late peers.
    """

    name = "allreduce"

    def __init__(self, ctx: SyncContext) -> None:
        super().__init__(ctx)
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        store = dist.PrefixStore(f"ddp/{ctx.config.run_id}/", ctx.store)
        dist.init_process_group(
            backend, store=store, rank=ctx.rank, world_size=ctx.num_workers,
            timeout=datetime.timedelta(seconds=ctx.config.collective_timeout_seconds),
        )
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(ctx.model, device_ids=device_ids)
        self._window: list[float] = []
        self.ddp.register_comm_hook(self._window, _timed_allreduce_hook)
        self.stopper = LockstepStop(ctx)

    def training_model(self) -> torch.nn.Module:
        return self.ddp

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        return self.stopper.should_stop(completed, planned)

    def after_step(self, completed: int) -> SyncResult:
        window, self._window[:] = list(self._window), []
        seconds = (max(window) - min(window)) if len(window) >= 2 else 0.0
        return SyncResult(preduce_seconds=seconds, num_groups=1, inside_step=True,
                          group_sizes=(self.ctx.num_workers,))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _timed_allreduce_hook(
    window: list[float], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    window.append(time.perf_counter())
    tensor = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()

    def done(f: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        window.append(time.perf_counter())
        return f.value()[0]

    return fut.then(done)
