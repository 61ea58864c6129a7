"""A user's script with checkpoints (the public API only), for restart-round tests:
digits with an MLP, SGD with momentum and a step schedule, a DistributedSampler, and a
ripples.Checkpointer that restores before the first step, as the docs say to."""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ripples
from ripples.worker.tasks.digits import load_digits_arrays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--save", default="")
    args = parser.parse_args()

    worker = ripples.init()
    pixels, labels = load_digits_arrays()
    dataset = TensorDataset(torch.tensor(pixels / 16.0, dtype=torch.float32),
                            torch.tensor(labels))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                            planned_steps=args.steps)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=200, gamma=0.5)
    sampler = ripples.DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, drop_last=True)
    ckpt = ripples.Checkpointer(opt, scheduler=scheduler, sampler=sampler, samples_per_step=16)
    print(f"rank {worker.rank} restored step {ckpt.restore()}", flush=True)
    epoch = sampler.epoch
    while not opt.stopped:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.report_loss(loss.detach(), num_samples=len(x))
            scheduler.step()
            ckpt.step()
            if opt.stopped:
                break
        epoch += 1
    if args.save:
        torch.save(model.state_dict(), args.save.format(rank=worker.rank))


if __name__ == "__main__":
    main()
