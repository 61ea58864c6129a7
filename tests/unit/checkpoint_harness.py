"""What the single-process Checkpointer tests share: a small model with its ripples
optimizer, steps that checkpoint, the files rank 0 saved, and a simulated crash."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

import ripples
from ripples.worker.api import current_worker


def crash() -> None:
    """The process is gone: its worker, and where its random generators stood."""
    worker = current_worker()
    if worker is not None:
        worker.shutdown()
    torch.manual_seed(12345)
    random.seed(12345)


def small_model(seed: int = 0, width: int = 4) -> tuple[nn.Module, ripples.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))
    return model, ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model)


def run_steps(opt: ripples.Optimizer, ckpt: ripples.Checkpointer, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        opt.model(torch.randn(5, 3)).square().mean().backward()
        opt.step()
        ckpt.step()


def saved_files(directory: Path) -> list[str]:
    return sorted(p.name for p in (directory / "rank-0").iterdir())
