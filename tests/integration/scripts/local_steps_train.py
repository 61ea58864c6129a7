"""A training script for the tests of local steps, on the public API only: a
small MLP (with --batchnorm, a BatchNorm layer whose statistics are averaged too), AdamW,
and batches that depend on (rank, step) alone, so that a test can replay every worker's
steps in one process and compare (`batch`, `build_model`). With --checkpoint, a
ripples.Checkpointer saves and restores (the launch's --checkpoint-dir)."""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import ripples

FEATURES, CLASSES, BATCH = 12, 4, 16
LR = 0.01


def build_model(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    # After the ReLU: a bias just before a BatchNorm gets no gradient but rounding noise,
    # which AdamW's normalised step turns into steps no two computations agree on.
    norm = [nn.BatchNorm1d(16)] if batchnorm else []
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), *norm, nn.Linear(16, CLASSES))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch of rank `rank` (steps count from 1)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, (x[:, :CLASSES].argmax(1) + rank) % CLASSES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reload-at", type=int, default=0,
                        help="after this step, load opt.state_dict() back into the optimizer "
                        "(a resume in place): the run must go on as if it had not")
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--checkpoint", action="store_true",
                        help="save and restore with ripples.Checkpointer")
    args = parser.parse_args()
    worker = ripples.init()
    model = build_model(args.batchnorm)
    opt = ripples.Optimizer(torch.optim.AdamW(model.parameters(), lr=LR), model)
    ckpt = ripples.Checkpointer(opt) if args.checkpoint else None
    step = ckpt.restore() if ckpt is not None else 0
    while not opt.stopped:
        step += 1
        x, y = batch(worker.rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.report_loss(loss, num_samples=len(x))
        if ckpt is not None:
            ckpt.step()
        if step == args.reload_at:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))


if __name__ == "__main__":
    main()
