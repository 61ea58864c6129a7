"""A task whose model raises after a few forward passes: a worker that crashes mid-run."""

from __future__ import annotations

import torch

from ripples.worker.tasks import Task, TaskOptions
from ripples.worker.tasks.digits import digits

CRASH_AFTER_FORWARDS = 15


class _Crashing(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > CRASH_AFTER_FORWARDS:
            raise RuntimeError("simulated device failure in forward")
        out: torch.Tensor = self.inner(x)
        return out


def crash_after_a_while(options: TaskOptions) -> Task:
    task = digits(options)
    task.model = _Crashing(task.model)
    return task
