"""A plain PyTorch DDP training script (the starting point of "Migrating from DDP").

    torchrun --standalone --nproc-per-node 2 examples/ddp_digits.py --epochs 3

Handwritten digits (scikit-learn's bundled set) with a small MLP, SGD with momentum, a
cosine learning-rate schedule, gradient clipping; gloo on CPU, NCCL on GPUs. With the
habits of real DDP scripts: a seed per rank (DDP broadcasts rank 0's model), gradient
accumulation through DDP's `require_backward_grad_sync`, and rank 0 alone evaluating on
the held-out fifth and saving a checkpoint (model and optimizer).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--save", help="write a checkpoint (model, optimizer) here")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    rank = dist.get_rank()

    data = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(
        data.data / 16.0, data.target, test_size=0.2, random_state=0, stratify=data.target)
    dataset = TensorDataset(torch.tensor(train_x, dtype=torch.float32), torch.tensor(train_y))
    held_out = (torch.tensor(test_x, dtype=torch.float32, device=device),
                torch.tensor(test_y, device=device))
    torch.manual_seed(1337 + rank)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
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
            opt.zero_grad()
            scheduler.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, held-out accuracy {accuracy():.3f}")

    if args.save and rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()},
                   args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
