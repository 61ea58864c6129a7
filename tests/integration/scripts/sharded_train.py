"""A worker of several ranks (`ripples run --ranks-per-worker G -- python
sharded_train.py TRACE_DIR STEPS`): a small model sharded with FSDP2 over worker.mesh,
plain SGD, and batches that depend on the worker's rank and the step only. Rank r of a
worker trains on the r-th of G equal slices of the worker's batch, so that the worker's
step is the step of one unsharded model on the whole batch. It checkpoints where the
launch asks, and resumes from there. Rank 0 writes TRACE_DIR/worker<rank>.pt: the step it
started from, the whole model then and after each step (gathered from the shards), for
the test to replay (TRACE_DIR "-": no trace).

SHARDED_TRAIN_MISMATCH=1 makes worker 1's hidden layer one wider (a worker whose
sharding differs from the others', which the coordinator refuses);
SHARDED_TRAIN_MOMENTUM=M gives SGD momentum M, and the trace the momentum buffers too."""

import os
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import ripples

WIDTH = 15  # odd: FSDP2 pads the shards of rank 1
BATCH = 8
LR = 0.2


def build_model(width: int = WIDTH) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 3))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(worker * 100_003 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def main() -> None:
    trace_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    worker = ripples.init()
    width = WIDTH + (1 if os.environ.get("SHARDED_TRAIN_MISMATCH") and worker.rank == 1
                     else 0)
    model = build_model(width).to(worker.device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=worker.mesh)
    fully_shard(model, mesh=worker.mesh)
    momentum = float(os.environ.get("SHARDED_TRAIN_MOMENTUM", "0"))
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum),
                            model, planned_steps=steps)
    checkpoints = ripples.Checkpointer(opt)  # where the launch asks (--checkpoint-dir)
    start = checkpoints.restore()
    g, r = worker.ranks_per_worker, worker.rank_in_worker
    print(f"worker {worker.rank}: its rank {r} of {g}, from step {start}", flush=True)
    restored = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    trace, buffers = [], []
    for step in range(start + 1, steps + 1):
        x, y = (t.to(worker.device) for t in batch(worker.rank, step))
        part = slice(r * BATCH // g, (r + 1) * BATCH // g)
        loss = torch.nn.functional.mse_loss(model(x[part]), y[part])
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.report_loss(loss)
        checkpoints.step()
        if str(trace_dir) != "-":
            trace.append({n: p.full_tensor().cpu() for n, p in model.named_parameters()})
            if momentum:  # the optimizer's state, whole
                buffers.append({n: opt.optimizer.state[p]["momentum_buffer"].full_tensor().cpu()
                                for n, p in model.named_parameters()})
        if opt.stopped:
            break
    if r == 0 and str(trace_dir) != "-":
        torch.save({"start": start, "restored": restored, "trace": trace,
                    "momentum": buffers},
                   trace_dir / f"worker{worker.rank}.pt")


if __name__ == "__main__":
    main()
