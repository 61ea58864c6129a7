"""The bench's workloads, built for a peer system's worker: the same model, initial
weights, data shard, batch size, optimizer and learning rate as a Ripples worker of the
same run gets (worker/runner.py for the built-in tasks, examples/transformer_lm.py for the
language model), so that only the system that averages differs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from ripples.worker.runner import steps_per_epoch, task_loader
from ripples.worker.sampler import DistributedSampler
from ripples.worker.tasks import Task, TaskOptions, build_task, evaluate

Params = Iterable[Any]
"""Parameters or parameter groups, as an optimizer takes them."""


@dataclass(kw_only=True)
class PeerWorkload:
    """What a peer worker trains, and how."""

    model: nn.Module
    params: Callable[[nn.Module], Params]
    """The optimizer's parameter groups of a model (AdamW's decay split for the LM)."""
    make_optimizer: Callable[[Params], torch.optim.Optimizer]
    batches: Iterator[tuple[Tensor, Tensor]]
    """This worker's batches, epoch after epoch (reshuffled per epoch), endlessly."""
    loss: Callable[[nn.Module, Tensor, Tensor], Tensor]
    """Forward and loss (under autocast where the workload uses it)."""
    planned_steps: int
    """The step cap of one worker: max_epochs of the built-in task, max_steps of a script."""
    grad_clip_norm: float | None = None
    lr_factor: Callable[[int], float] | None = None
    """The learning-rate schedule's factor at a worker's step (LambdaLR)."""
    train_samples: int | None = None
    """Size of the training set (None: a stream), for seconds per epoch."""
    evaluate: Callable[[dict[str, Tensor]], tuple[float, float | None]] | None = None
    """Loss and accuracy of a state dict on the evaluation data."""


def build_workload(name: str, script_args: list[str], *, seed: int, batch_size: int,
                   rank: int, num_workers: int, max_epochs: float,
                   max_steps: int) -> PeerWorkload:
    """`name` is a built-in task or "transformer-lm" (then `script_args` are the bench's
    arguments of examples/transformer_lm.py)."""
    if name == "transformer-lm":
        return _transformer_lm(script_args, seed=seed, batch_size=batch_size, rank=rank,
                               num_workers=num_workers, max_steps=max_steps)
    return _builtin_task(name, seed=seed, batch_size=batch_size, rank=rank,
                         num_workers=num_workers, max_epochs=max_epochs)


def _builtin_task(name: str, *, seed: int, batch_size: int, rank: int, num_workers: int,
                  max_epochs: float) -> PeerWorkload:
    task = build_task(name, TaskOptions(seed=seed, device="cpu", batch_size=batch_size))
    dataset = task.train_data()
    # The Ripples runner's sharding: each worker keeps its shard, reshuffled per epoch.
    sampler = DistributedSampler(dataset, num_replicas=num_workers, rank=rank, shuffle=True,
                                 seed=seed, reshard_every_epoch=False)
    loader = task_loader(task, dataset, sampler, pin_memory=False)
    optimizer = task.build_optimizer(nn.Linear(1, 1))  # its class and defaults, not its params
    defaults = dict(optimizer.defaults)

    def make_optimizer(params: Params) -> torch.optim.Optimizer:
        return type(optimizer)(params, **defaults)

    def epochs() -> Iterator[tuple[Tensor, Tensor]]:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    def task_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        return task.loss_fn(model(inputs), targets)

    return PeerWorkload(
        model=task.build_model(), params=lambda m: m.parameters(),
        make_optimizer=make_optimizer, batches=epochs(), loss=task_loss,
        planned_steps=max(1, round(max_epochs * steps_per_epoch(task, loader))),
        grad_clip_norm=task.grad_clip_norm, train_samples=len(dataset),  # type: ignore[arg-type]
        evaluate=_evaluator(task) if task.eval_data is not None else None)


def _evaluator(task: Task) -> Callable[[dict[str, Tensor]], tuple[float, float | None]]:
    def run(state: dict[str, Tensor]) -> tuple[float, float | None]:
        model = task.build_model()
        model.load_state_dict(state)
        return evaluate(task, model)
    return run


def _transformer_lm(script_args: list[str], *, seed: int, batch_size: int, rank: int,
                    num_workers: int, max_steps: int) -> PeerWorkload:
    from torch.utils.data import DataLoader

    from ripples.examples import transformer_lm as lm

    args = lm.build_parser().parse_args(
        [*script_args, "--seed", str(seed), "--batch-size", str(batch_size),
         "--steps", str(max_steps)])
    data = lm.ByteStream(lm.stdlib_files(), args.block_size, rank=rank,
                         num_workers=num_workers, seed=seed)
    loader = DataLoader(data, batch_size=batch_size, num_workers=args.loader_workers)
    # bf16 autocast on CPU, as the script's --amp auto (a GradScaler only on a GPU).
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.amp == "auto"
                else contextlib.nullcontext())

    def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        with autocast:
            return functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def groups(model: nn.Module) -> Params:
        return lm.build_adamw(model, args).param_groups

    def make_optimizer(params: Params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95))

    return PeerWorkload(
        model=lm.build_model(args), params=groups, make_optimizer=make_optimizer,
        batches=iter(loader), loss=lm_loss, planned_steps=max_steps,
        grad_clip_norm=args.clip,
        lr_factor=lambda step: lm.warmup_cosine(step, warmup=args.warmup, total=args.steps))
