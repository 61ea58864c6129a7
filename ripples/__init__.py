"""Ripples: asynchronous, decentralized data-parallel training for PyTorch.

The public API, for your own training script::

    import ripples

    worker = ripples.init()            # join the run the launcher started (or train alone)
    model = Net().to(worker.device)
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    sampler = ripples.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x.to(worker.device)), y.to(worker.device))
            loss.backward()
            opt.step()                 # the local step, then the run's synchronisation
            opt.report_loss(loss)      # progress for the coordinator and the dashboard
            if opt.stopped:            # the coordinator stopped the run
                break

Launch it with `ripples run --workers 4 --protocol ripples-smart -- python train.py`, under
torchrun or SLURM with RIPPLES_COORDINATOR set, or run it alone. docs/library.md has the
whole story. The names below are the stable public API; they import torch on first use,
so `import ripples` alone stays light (the CLI and the dashboard need no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ripples.worker.api import RunInfo, Worker, current_worker, init
    from ripples.worker.checkpoint import Checkpointer
    from ripples.worker.optimizer import Optimizer
    from ripples.worker.sampler import DistributedSampler
    from ripples.worker.synchronizer import StepTimes

_EXPORTS = {
    "init": "ripples.worker.api",
    "current_worker": "ripples.worker.api",
    "Worker": "ripples.worker.api",
    "RunInfo": "ripples.worker.api",
    "Checkpointer": "ripples.worker.checkpoint",
    "Optimizer": "ripples.worker.optimizer",
    "DistributedSampler": "ripples.worker.sampler",
    "StepTimes": "ripples.worker.synchronizer",
}

__all__ = ["Checkpointer", "DistributedSampler", "Optimizer", "RunInfo", "StepTimes", "Worker",
           "__version__", "current_worker", "init"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ripples' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
