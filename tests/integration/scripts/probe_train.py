"""A training script for tests, written against the public API only: digits with an MLP
(optionally with BatchNorm), and knobs to misbehave on one rank (a NaN loss, an exception,
a different model), to accumulate gradients, and to record what the worker saw."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ripples
from ripples.worker.tasks.digits import load_digits_arrays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--wider-on-rank", type=int, default=-1)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-steps", type=int, default=1, help="NaN losses from --nan-at on")
    parser.add_argument("--skip-nonfinite", action="store_true")
    parser.add_argument("--raise-at", type=int, default=-1)
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--accumulate-with", default="opt",
                        choices=("opt", "model", "attribute"),
                        help="how the micro-batches before the last skip the gradient sync: "
                        "opt.no_sync(), DDP's model.no_sync(), or DDP's "
                        "model.require_backward_grad_sync")
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--pause-rank", type=int, default=-1)
    parser.add_argument("--pause-at", type=int, default=-1,
                        help="after this step, the pause rank sleeps (a rank-0 evaluation)")
    parser.add_argument("--pause-seconds", type=float, default=0.0)
    parser.add_argument("--record", default="", help="a JSON file per rank: {rank} in it")
    parser.add_argument("--seed-per-rank", action="store_true",
                        help="seed 1337 + rank before building the model, as DDP scripts do")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="this rank pauses after each step (as a rank 0 that evaluates)")
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--steps-after-stop", type=int, default=0,
                        help="rank 0's local steps after the run stopped (its peers are "
                        "gone: nothing may reach them)")
    args = parser.parse_args()

    worker = ripples.init()
    pixels, labels = load_digits_arrays()
    dataset = TensorDataset(torch.tensor(pixels / 16.0, dtype=torch.float32),
                            torch.tensor(labels))
    torch.manual_seed(1337 + worker.rank if args.seed_per_rank else 0)
    hidden = 96 if worker.rank == args.wider_on_rank else 64
    layers: list[nn.Module] = [nn.Linear(64, hidden)]
    if args.batchnorm:
        layers.append(nn.BatchNorm1d(hidden))
    model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(hidden, 10)).to(worker.device)
    built_sum = sum(float(p.double().sum()) for p in model.parameters())
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                            on_nonfinite="skip" if args.skip_nonfinite else "raise")
    start_sum = sum(float(p.double().sum()) for p in model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0 / (1 + opt.global_step / 50))
    sampler = ripples.DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler,
                        num_workers=args.loader_workers)
    full_x, full_y = (t.to(worker.device) for t in dataset.tensors)

    def full_loss() -> float:
        """The loss over the whole dataset in eval mode: no batch's noise in it."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            value = nn.functional.cross_entropy(model(full_x), full_y).item()
        model.train(was_training)
        return value

    initial_loss = full_loss()
    seen: list[dict[str, float]] = []
    gradients: list[float] = []  # a fingerprint of the gradient after each micro-batch

    def skipping_sync(last: bool) -> contextlib.AbstractContextManager[None]:
        if args.accumulate_with == "attribute":
            model.require_backward_grad_sync = last  # type: ignore[assignment]
            return contextlib.nullcontext()
        if last:
            return contextlib.nullcontext()
        return opt.no_sync() if args.accumulate_with == "opt" else model.no_sync()  # type: ignore[operator]

    step = micro = 0
    epoch = 0
    while step < args.steps and not opt.stopped:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(worker.device), y.to(worker.device)
            micro += 1
            last = micro % args.accumulate == 0
            with skipping_sync(last):
                loss = nn.functional.cross_entropy(model(x), y) / args.accumulate
                if (worker.rank == args.nan_rank
                        and args.nan_at <= step + 1 < args.nan_at + args.nan_steps):
                    loss = loss * math.nan
                loss.backward()
            if args.accumulate > 1 and step < 4:
                gradients.append(float(model[0].weight.grad.double().sum()))
            if not last:
                continue
            if worker.rank == args.raise_rank and step + 1 == args.raise_at:
                raise KeyError("the probe's deliberate failure")
            opt.step()
            opt.zero_grad()
            opt.report_loss(loss * args.accumulate, num_samples=len(x))
            schedule.step()
            step += 1
            if worker.rank == args.slow_rank:
                time.sleep(args.slow_seconds)
            seen.append({"step": opt.local_step, "global_step": opt.global_step,
                         "lr": schedule.get_last_lr()[0], "loss": loss.item()})
            if worker.rank == args.pause_rank and step == args.pause_at:
                time.sleep(args.pause_seconds)
            if opt.stopped or step >= args.steps:
                break
        epoch += 1
    final_loss = full_loss()
    x, y = (t.to(worker.device) for t in dataset[:16])
    if args.accumulate_with == "attribute":  # after the stop it must not sync again
        model.require_backward_grad_sync = True  # type: ignore[assignment]
    for _ in range(args.steps_after_stop if worker.rank == 0 else 0):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if args.record:
        with open(args.record.format(rank=worker.rank), "w") as f:
            json.dump({"rank": worker.rank, "seen": seen, "skipped": opt.skipped_steps,
                       "stop_reason": opt.stop_reason, "initial_loss": initial_loss,
                       "final_loss": final_loss, "start_sum": start_sum,
                       "built_sum": built_sum, "steps": step, "gradients": gradients}, f)


if __name__ == "__main__":
    main()
