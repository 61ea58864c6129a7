"""The same script under Ripples (see "Migrating from DDP" in the README for the diff).

    ripples run --workers 4 --protocol ripples-smart -- python examples/ripples_digits.py
    python examples/ripples_digits.py                        # alone: single-process mode

Handwritten digits (scikit-learn's bundled set) with a small MLP, SGD with momentum, a
cosine learning-rate schedule, gradient clipping; gloo on CPU, NCCL on GPUs. The DDP
habits stay as they were: the seed per rank (every worker starts from rank 0's model),
`require_backward_grad_sync` for gradient accumulation (honoured under `allreduce`; the
other protocols average in `opt.step()` only), rank 0's evaluation and checkpoint (a
slower rank 0 still runs its loop to the end).
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ripples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--save", help="write a checkpoint (model, optimizer) here")
    args = parser.parse_args()

    worker = ripples.init()
    device = worker.device
    rank = worker.rank

    data = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(
        data.data / 16.0, data.target, test_size=0.2, random_state=0, stratify=data.target)
    dataset = TensorDataset(torch.tensor(train_x, dtype=torch.float32), torch.tensor(train_y))
    held_out = (torch.tensor(test_x, dtype=torch.float32, device=device),
                torch.tensor(test_y, device=device))
    torch.manual_seed(1337 + rank)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model)
    sampler = ripples.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    steps_per_epoch = len(loader) // args.accumulate
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            predicted = model(held_out[0]).argmax(dim=1)
        model.train()
        return float((predicted == held_out[1]).float().mean())

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for micro, (x, y) in enumerate(loader):
            if micro >= steps_per_epoch * args.accumulate:
                break
            x, y = x.to(device), y.to(device)
            last = (micro + 1) % args.accumulate == 0
            model.require_backward_grad_sync = last  # average the gradients on the last only
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / args.accumulate).backward()
            if not last:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.report_loss(loss, num_samples=len(x))
            opt.zero_grad()
            scheduler.step()
            if opt.stopped:
                break
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, held-out accuracy {accuracy():.3f}")
        if opt.stopped:
            break

    if args.save and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   args.save)


if __name__ == "__main__":
    main()
