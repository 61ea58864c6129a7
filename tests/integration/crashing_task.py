"""A task whose model raises after a few forward passes: a worker that crashes mid-run.

The crash comes from a forward pre-hook, so the model keeps the digits model's parameter
names: its schema matches the healthy workers' and it joins the run like them."""

from __future__ import annotations

import torch

from ripples.worker.tasks import Task, TaskOptions
from ripples.worker.tasks.digits import digits

CRASH_AFTER_FORWARDS = 15


def crash_after_a_while(options: TaskOptions) -> Task:
    task = digits(options)
    build = task.build_model

    def build_crashing() -> torch.nn.Module:
        model = build()
        calls = [0]

        def count(_module: torch.nn.Module, _args: object) -> None:
            calls[0] += 1
            if calls[0] > CRASH_AFTER_FORWARDS:
                raise RuntimeError("simulated device failure in forward")

        model.register_forward_pre_hook(count)
        return model

    task.build_model = build_crashing
    return task
