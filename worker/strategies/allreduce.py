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

    DDP synchronises twice per step, and both count as preduce_seconds (they include the
    wait for late peers), not as compute:
    - the gradient all-reduce overlaps the backward pass, timed with a communication hook
      (first bucket launched to last bucket done);
    - before each forward, DDP broadcasts rank 0's buffers (BatchNorm statistics). That
      is where a fast worker waits for a straggler whose gradients arrive late; it is
      timed as the gap between a forward pre-hook on the DDP wrapper and one on the
      wrapped model.
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
        self._forward_marks: list[float] = []  # [DDP forward entered, model forward entered]
        self.ddp.register_forward_pre_hook(self._mark_ddp_forward)
        ctx.model.register_forward_pre_hook(self._mark_model_forward)
        self.stopper = LockstepStop(ctx)

    def _mark_ddp_forward(self, _module: torch.nn.Module, _args: object) -> None:
        self._forward_marks[:] = [time.perf_counter()]

    def _mark_model_forward(self, _module: torch.nn.Module, _args: object) -> None:
        self._forward_marks.append(time.perf_counter())

    def training_model(self) -> torch.nn.Module:
        return self.ddp

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        return self.stopper.should_stop(completed, planned)

    def after_step(self, completed: int) -> SyncResult:
        window, self._window[:] = list(self._window), []
        seconds = (max(window) - min(window)) if len(window) >= 2 else 0.0
        marks, self._forward_marks[:] = list(self._forward_marks), []
        if len(marks) == 2:
            seconds += marks[1] - marks[0]
        return SyncResult(preduce_seconds=seconds, num_groups=1, inside_step=True,
                          group_sizes=(self.ctx.num_workers,), preduce_durations=(seconds,),
                          preduce_bytes=self.ctx.params.size_bytes)

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
