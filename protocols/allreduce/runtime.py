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

With local steps or an outer optimizer (`--local-steps H`, `--outer-optimizer
nesterov`) this is DiLoCo (arXiv 2311.08105) instead: nothing synchronises in backward
(no DDP: `opt.no_sync()` has nothing to skip), every worker takes H steps of its own
optimizer from the common anchor, then one all-reduce averages, at a step every worker
agrees on (a multiple of H, or the agreed stop): with `none` the models (local SGD),
with `nesterov` the pseudo-gradients, on which every worker takes the same outer Nesterov
step (worker/dataplane/outer_state.py; every worker is in every synchronisation, so the
anchors and momenta stay bitwise equal and only the pseudo-gradients travel). Rank 0's
model is broadcast at the start, as DDP does, so the anchors start equal too. The
wrapped optimizer's state (AdamW's moments) stays each worker's own, as in DiLoCo.

Every worker waits in every all-reduce for the slowest, which may be busy between steps
(an evaluation on rank 0): the run's collective timeout is long for lock-step protocols
(RunSettings.collective_timeout_seconds), a dead peer is caught by its lease, and the
collectives are marked in the process's CollectiveWatch, so that a worker held in one
after the run lost a member ends (worker/collective_watch.py). A collective that fails
says which one it was, which peers it waited for and, for a timeout, how to raise it.
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
from ripples.protocols.lockstep import (
    LockstepStop,
    explain_collective_failure,
    explained_collective,
)
from ripples.worker.collective_watch import COLLECTIVES, megabytes
from ripples.worker.dataplane.local_rounds import local_steps
from ripples.worker.dataplane.outer_state import OuterState
from ripples.worker.dataplane.preduce import reduce_staged
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
        self.stopper = LockstepStop(ctx)
        self.local_steps = local_steps(ctx.config)
        self.outer = OuterState.of_config(ctx.state, ctx.config)
        self.local = self.local_steps > 1 or self.outer is not None
        """DiLoCo's form (no DDP; a synchronisation every local_steps steps)."""
        self.flags_nonfinite = self.local
        """DiLoCo's synchronisation carries the non-finite flags (the outer step's, or the
        model average's); DDP's gradient all-reduce does not."""
        self.synced_at = 0
        """The last step this worker synchronised at (DiLoCo's form)."""
        if self.local:
            self._start_local(ctx)
            return
        self.gradient_allreduce = "the gradient all-reduce of this process's first step"
        """What the comm hook's collectives are called in errors (the step they serve)."""
        replicate(ctx.model, device_id=ctx.device)
        self.gradient_sync = GradientSyncSwitch(
            ctx.model, ctx.model.set_requires_gradient_sync)  # type: ignore[arg-type]
        ctx.model.register_comm_hook(self, _timed_allreduce_hook)  # type: ignore[operator]
        # Build DDP now rather than at the root module's first forward (replicate's
        # default): its constructor's collectives (the shape check, the broadcast of rank
        # 0's parameters) run here, where every worker is, and the gradient hooks exist
        # whichever forward the script calls first.
        state = ctx.state
        size = megabytes(state.flat[: state.model_numel])
        with explained_collective(ctx, "DDP's start (its check of the parameters' shapes "
                                       f"and its broadcast of rank 0's values, {size})"):
            replicate.state(ctx.model).lazy_init()
        params = sum(p.numel() for p in state.params)
        buffers = sum(b.numel() for b in state.buffers)
        self._buffers = state.flat[params: params + buffers] if buffers else None

    def _start_local(self, ctx: ProtocolContext) -> None:
        """DiLoCo's form: every worker starts from rank 0's model (parameters and
        buffers), the common anchor; nothing hooks the backward pass."""
        self.syncs_gradients = False
        state = ctx.state
        size = megabytes(state.flat[: state.model_numel])
        with torch.no_grad(), explained_collective(ctx, "the broadcast of rank 0's model "
                                                        f"at the start, {size}"):
            dist.broadcast(state.flat[: state.model_numel], src=0)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self.local:  # nothing synchronises in backward
            return contextlib.nullcontext()
        return self.gradient_sync.no_sync()

    def on_stop(self) -> None:
        """The peers are leaving: backward passes after the stop stay local."""
        if not self.local:
            self.gradient_sync.stop()

    def backward_sync_seconds(self) -> float:
        window = self._window
        return (max(window) - min(window)) if len(window) >= 2 else 0.0

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        verdict = self.stopper.should_stop(completed, planned)
        if verdict is not None and verdict.stop and self.local and self.synced_at != completed:
            # Every worker stops at this same step (LockstepStop), inside a round: every
            # worker ends with the mean of the models, as the other protocols' final
            # average gives (no outer step on a partial round: its momentum term would
            # extrapolate a round that was not taken). The anchor and the momentum stay
            # as they were, so a resume from the checkpoint of this step goes on with
            # the round: its pseudo-gradient holds these steps too.
            sync = self._synchronise(completed, final=True)
            verdict = sync.merged(verdict)
        return verdict

    def consensus_agreement(self) -> tuple[int, int] | None:
        return self.stopper.consensus

    def after_step(self, completed: int) -> SyncResult:
        if self.local:
            if completed % self.local_steps:
                return SyncResult()
            return self._synchronise(completed)
        seconds = self.backward_sync_seconds()
        self._window[:] = []
        self.gradient_allreduce = f"the gradient all-reduce of step {completed + 1}"
        buffer_seconds = 0.0
        if self._buffers is not None:
            t0 = time.perf_counter()
            what = f"the all-reduce of the floating-point buffers after step {completed}"
            with torch.no_grad(), explained_collective(self.ctx, what):
                self._buffers.div_(self.ctx.num_workers)
                dist.all_reduce(self._buffers)
            buffer_seconds = time.perf_counter() - t0
        size = self.ctx.state.size_bytes
        return SyncResult(preduce_seconds=seconds + buffer_seconds, num_groups=1,
                          inside_step_seconds=seconds,
                          group_sizes=(self.ctx.num_workers,),
                          preduce_durations=(seconds + buffer_seconds,), preduce_bytes=size)

    def _synchronise(self, completed: int, *, final: bool = False) -> SyncResult:
        """DiLoCo's synchronisation, in one all-reduce (two with --outer-compression bf16:
        the pseudo-gradients in bfloat16 beside the buffers in float32): the
        pseudo-gradients (and the buffers) and the outer step, or (outer optimizer none,
        or `final`: the stop inside a round) the models. A failed all-reduce leaves the
        model, anchor and momentum as they were.

        Every worker is in every synchronisation, so the anchors and momenta stay
        bitwise equal and only the pseudo-gradients need to travel; until one
        synchronisation has made them equal (the first, and the first after a restore:
        a checkpoint without the outer state anchors each worker at its own model), the
        group form averages them too, once."""
        outer = None if final else self.outer
        n = self.ctx.num_workers
        averaged = outer if outer is not None else self.ctx.state
        what = (f"the {'outer step' if outer is not None else 'model average'} after "
                f"step {completed}")
        t0 = time.perf_counter()
        same = outer is not None and outer.in_agreement
        staged = (outer.stage(1.0 / n, same_anchor=same) if outer is not None
                  else [self.ctx.state.stage(1.0 / n)])

        def all_reduce(buffer: torch.Tensor) -> None:
            with torch.no_grad(), explained_collective(self.ctx, what):
                dist.all_reduce(buffer)

        reduce_staged(averaged, staged, all_reduce)
        if outer is not None:
            outer.in_agreement = True
        self.synced_at = completed
        seconds = time.perf_counter() - t0
        return SyncResult(preduce_seconds=seconds, num_groups=1, group_sizes=(n,),
                          preduce_durations=(seconds,),
                          preduce_bytes=sum(t.numel() * t.element_size() for t in staged))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def explain(self, what: str, err: BaseException) -> str:
        return explain_collective_failure(self.ctx, what, err)


def _timed_allreduce_hook(
    protocol: AllReduceProtocol, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    window = protocol._window
    window.append(time.perf_counter())
    what = protocol.gradient_allreduce
    COLLECTIVES.enter(what)  # while a bucket is in flight; DDP waits for all at the end
    tensor = bucket.buffer().div_(dist.get_world_size())
    try:
        fut = dist.all_reduce(tensor, async_op=True).get_future()
    except RuntimeError:
        COLLECTIVES.leave()
        raise

    def done(f: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        COLLECTIVES.leave()
        window.append(time.perf_counter())
        try:
            return f.value()[0]
        except RuntimeError as err:  # torch wraps this message in its own words
            raise RuntimeError(protocol.explain(what, err)) from err

    return fut.then(done)
