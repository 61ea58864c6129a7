"""`allreduce`: PyTorch DDP over all workers, the usual baseline.

DDP is attached to the user's own model with `torch.distributed._composable.replicate`
(DDP's composable form: the same C++ reducer, registered as hooks on the module instead
of a wrapper), so the user's `model(x)` and `loss.backward()` all-reduce the gradients in
buckets that overlap the backward pass, exactly as with a `DistributedDataParallel`
wrapper. Gradient accumulation: DDP's spellings work on the user's model
(`model.require_backward_grad_sync = False`, `with model.no_sync():`), and so does
`with opt.no_sync():` (gradient_sync.py).

DDP's wrapper broadcasts rank 0's buffers before every forward; `replicate` syncs
parameters only, so this protocol averages the floating-point buffers (BatchNorm
statistics) after every step instead, in one small all-reduce: the buffers are the
average of the workers' (as for the other protocols), not rank 0's.
"""

# No `from __future__ import annotations` here: DDP checks the comm hook's `bucket`
# annotation at run time and rejects a string.

import contextlib
import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed._composable import replicate

from ripples.protocols.allreduce.gradient_sync import GradientSyncSwitch
from ripples.protocols.lockstep import LockstepStop
from ripples.worker.protocol import Protocol, ProtocolContext, SyncResult


class AllReduceProtocol(Protocol):
    """Gradients are all-reduced by DDP inside backward; every worker waits for the slowest.

    The gradient all-reduce overlaps the backward pass; a comm hook times it (first bucket
    launched to last bucket done: this includes the wait for late peers) as preduce
    seconds, which the optimizer subtracts from the compute time it measures around the
    step (`SyncResult.inside_step`).
    """

    name = "allreduce"
    stops_together = True
    syncs_gradients = True  # the optimizer checks the averaged gradients before the step

    def __init__(self, ctx: ProtocolContext) -> None:
        super().__init__(ctx)
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        store = dist.PrefixStore(f"ddp/{ctx.config.run_id}/", ctx.store)
        dist.init_process_group(
            backend, store=store, rank=ctx.rank, world_size=ctx.num_workers,
            timeout=datetime.timedelta(seconds=ctx.config.collective_timeout_seconds),
        )
        self._window: list[float] = []
        replicate(ctx.model, device_id=ctx.device)
        self.gradient_sync = GradientSyncSwitch(
            ctx.model, ctx.model.set_requires_gradient_sync)  # type: ignore[arg-type]
        ctx.model.register_comm_hook(self._window, _timed_allreduce_hook)  # type: ignore[operator]
        # Build DDP now rather than at the root module's first forward (replicate's
        # default): its constructor's collectives (the shape check, the broadcast of rank
        # 0's parameters) run here, where every worker is, and the gradient hooks exist
        # whichever forward the script calls first.
        replicate.state(ctx.model).lazy_init()
        state = ctx.state
        params = sum(p.numel() for p in state.params)
        buffers = sum(b.numel() for b in state.buffers)
        self._buffers = state.flat[params: params + buffers] if buffers else None
        self.stopper = LockstepStop(ctx)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.gradient_sync.no_sync()

    def on_stop(self) -> None:
        """The peers are leaving: backward passes after the stop stay local."""
        self.gradient_sync.stop()

    def backward_sync_seconds(self) -> float:
        window = self._window
        return (max(window) - min(window)) if len(window) >= 2 else 0.0

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        return self.stopper.should_stop(completed, planned)

    def consensus_agreement(self) -> tuple[int, int] | None:
        return self.stopper.consensus

    def after_step(self, completed: int) -> SyncResult:
        seconds = self.backward_sync_seconds()
        self._window[:] = []
        buffer_seconds = 0.0
        if self._buffers is not None:
            t0 = time.perf_counter()
            with torch.no_grad():
                self._buffers.div_(self.ctx.num_workers)
                dist.all_reduce(self._buffers)
            buffer_seconds = time.perf_counter() - t0
        size = self.ctx.state.size_bytes
        return SyncResult(preduce_seconds=seconds + buffer_seconds, num_groups=1,
                          inside_step_seconds=seconds,
                          group_sizes=(self.ctx.num_workers,),
                          preduce_durations=(seconds + buffer_seconds,), preduce_bytes=size)

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
