"""A user's script with a checkpoint format of its own (the public API only), for
restart-round tests: digits with an MLP and SGD with momentum, and neither a sampler nor
a scheduler: each rank takes the batches of its slice of the data in order, from the step
it stands at. Its checkpoints hold what its own `state_dict()` returns, put back by its
own `load_state_dict()`, through ripples.Checkpointer's callables."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import ripples
from ripples.worker.tasks.digits import load_digits_arrays

BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--save", default="")
    args = parser.parse_args()

    worker = ripples.init()
    pixels, labels = load_digits_arrays()
    x_all = torch.tensor(pixels / 16.0, dtype=torch.float32)[worker.rank::worker.num_workers]
    y_all = torch.tensor(labels)[worker.rank::worker.num_workers]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                            planned_steps=args.steps)
    loaded: list[int] = []

    def state_dict() -> dict[str, Any]:
        return {"format": "own-v1", "net": model.state_dict(), "sgd": opt.state_dict(),
                "trained_steps": opt.local_step}

    def load_state_dict(state: dict[str, Any]) -> None:
        assert state["format"] == "own-v1", state["format"]
        model.load_state_dict(state["net"])
        opt.load_state_dict(state["sgd"])
        loaded.append(state["trained_steps"])

    ckpt = ripples.Checkpointer(opt, state_dict=state_dict, load_state_dict=load_state_dict)
    start = ckpt.restore()
    print(f"rank {worker.rank} restored step {start} (its own state says {loaded})", flush=True)
    while not opt.stopped:
        first = (opt.local_step * BATCH) % (len(x_all) - BATCH)
        x, y = x_all[first:first + BATCH], y_all[first:first + BATCH]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.report_loss(loss.detach(), num_samples=len(x))
        ckpt.step()
    if args.save:
        torch.save(model.state_dict(), args.save.format(rank=worker.rank))


if __name__ == "__main__":
    main()
