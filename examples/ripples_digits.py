"""The same script under Ripples (see "Migrating from DDP" in the README for the diff).

    ripples run --workers 4 --protocol ripples-smart -- python examples/ripples_digits.py
    python examples/ripples_digits.py                        # alone: single-process mode

Handwritten digits (scikit-learn's bundled set) with a small MLP, SGD with momentum, a
cosine learning-rate schedule, gradient clipping; gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ripples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--save", help="write the final model's state_dict here")
    args = parser.parse_args()

    worker = ripples.init()
    device = worker.device

    data = load_digits()
    dataset = TensorDataset(torch.tensor(data.data / 16.0, dtype=torch.float32),
                            torch.tensor(data.target))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model)
    sampler = ripples.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.report_loss(loss, num_samples=len(x))
            scheduler.step()
            if opt.stopped:
                break
        if worker.rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
        if opt.stopped:
            break

    if args.save and worker.rank == 0:  # `ripples run` also writes the workers' average
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
