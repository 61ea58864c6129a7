"""The built-in runner: a task (`--task digits`, `module:function`) trained through the
public API, like any user script.

It is the loop docs/library.md shows: `ripples.init()`, the task's model and optimizer
wrapped in `ripples.Optimizer`, its data sharded by `ripples.DistributedSampler` in a
DataLoader, and `opt.step()` / `opt.report_loss()` / `opt.stopped` per step, plus what a
task may ask for (a learning-rate schedule, gradient clipping, autocast). Protocols that
run processes of their own (lap-sgd, lpp-sgd: updaters per worker) are not library
protocols: the runner hands them the task instead (`run_training`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, TensorDataset

from ripples.protocols.registry import create_runtime, get_protocol
from ripples.worker.api import Worker
from ripples.worker.checkpoint import Checkpointer
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.optimizer import Optimizer
from ripples.worker.protocol import TrainingJob
from ripples.worker.sampler import DistributedSampler
from ripples.worker.synchronizer import parameter_names
from ripples.worker.tasks import Task, TaskOptions, build_task

logger = logging.getLogger(__name__)


def train_task(worker: Worker, spec: str) -> str:
    """Train the task `spec` (default: the run's) in this worker to the end of the run;
    returns why it ended."""
    settings = worker.settings
    spec = spec or settings.task
    if not spec:
        raise ValueError("this run names no built-in task: start the workers with your "
                         "script (`ripples worker run -- python train.py`), or give --task")
    options = TaskOptions(seed=settings.seed, device=str(worker.device),
                          learning_rate=settings.learning_rate or None,
                          batch_size=settings.batch_size or None)
    task = build_task(spec, options)
    if worker.is_distributed and not get_protocol(settings.protocol).library:
        return _run_protocol_runtime(worker, task, spec, options)
    model = task.build_model()
    dataset = task.train_data()
    # Each worker keeps its own shard (the papers' data partition), reshuffled per epoch;
    # a last partial batch is dropped (the budget counts steps, not epochs).
    sampler = (None if isinstance(dataset, IterableDataset)
               else DistributedSampler(dataset, shuffle=True, seed=settings.seed,
                                       reshard_every_epoch=False))
    loader = task_loader(task, dataset, sampler, pin_memory=worker.device.type == "cuda")
    planned = settings.iterations or math.ceil(settings.epochs * steps_per_epoch(task, loader))
    opt = Optimizer(task.build_optimizer(model), model, planned_steps=planned)
    scheduler = task.build_scheduler(opt) if task.build_scheduler is not None else None
    # The launch's --checkpoint-dir, if any: resume from it, save into it.
    checkpoints = Checkpointer(opt, scheduler=scheduler, sampler=sampler,
                               samples_per_step=task.batch_size)
    resumed = checkpoints.restore() > 0
    autocast = (torch.autocast(worker.device.type, dtype=task.autocast_dtype)
                if task.autocast_dtype is not None else contextlib.nullcontext())
    model.train()
    epoch = sampler.epoch if sampler is not None else 0
    while not opt.stopped:
        if sampler is not None:
            sampler.set_epoch(epoch)
        steps = 0
        for inputs, targets in loader:
            inputs = inputs.to(worker.device, non_blocking=True)
            targets = targets.to(worker.device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = task.loss_fn(model(inputs), targets)
            loss.backward()
            if task.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip_norm)
            opt.step()
            opt.report_loss(loss.detach(), num_samples=len(inputs))
            if scheduler is not None:
                scheduler.step()
            checkpoints.step()
            steps += 1
            if opt.stopped:
                break
        if steps == 0 and not resumed:  # a resumed epoch may have had no batch left
            raise ValueError(f"task {spec!r}: this worker's shard of the training data is "
                             "empty; use fewer workers or a larger data set")
        resumed = False
        epoch += 1
    return opt.stop_reason


def task_loader(task: Task, dataset: Dataset[Any], sampler: DistributedSampler | None, *,
            pin_memory: bool) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """The task's batches. A TensorDataset loaded in this process is indexed a whole batch
    at a time (one gather per tensor): a DataLoader fetches and collates sample by sample,
    91 us instead of 6 us per batch of 16 digits here, a fifth of a digits step, and its
    Python work competes for the GIL with the protocols' communication threads."""
    drop_last = sampler is not None and len(sampler) >= task.batch_size
    if isinstance(dataset, TensorDataset) and sampler is not None and task.loader_workers == 0:
        return _TensorBatches(dataset, BatchSampler(sampler, task.batch_size, drop_last))
    return DataLoader(dataset, batch_size=task.batch_size, sampler=sampler, drop_last=drop_last,
                      num_workers=task.loader_workers, pin_memory=pin_memory)


@dataclass
class _TensorBatches:
    dataset: TensorDataset
    batches: BatchSampler

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = self.dataset.tensors
        for indices in self.batches:
            index = torch.tensor(indices)
            yield inputs[index], targets[index]


def steps_per_epoch(task: Task, loader: Iterable[Any]) -> int:
    """One epoch: the workers together pass over the training set once."""
    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        if task.iterations_per_epoch is None:
            raise ValueError("an IterableDataset task must give iterations_per_epoch (or "
                             "run with --iterations)")
        return task.iterations_per_epoch
    return max(1, len(loader))  # type: ignore[arg-type]


@dataclass(kw_only=True)
class _RunnerOnlyTraining:
    """Stands where a ripples.Optimizer would for protocols the runner drives itself:
    what the worker saves at the end (the model, the record)."""

    model: torch.nn.Module
    record: dict[str, object]

    def _finish(self, error: str) -> dict[str, object]:
        return self.record


def _run_protocol_runtime(worker: Worker, task: Task, spec: str, options: TaskOptions) -> str:
    """lap-sgd, lpp-sgd: the protocol runs its own processes; this process averages."""
    session = worker._session
    assert session is not None and session.worker_id is not None
    model = task.build_model()
    state = AveragedState(model)
    shard = DistributedSampler(_len_only(task.train_data()), num_replicas=worker.num_workers,
                               rank=worker.rank, seed=worker.settings.seed)
    per_epoch = max(1, math.ceil(len(shard) / task.batch_size))
    settings = worker.settings
    planned = settings.iterations or math.ceil(settings.epochs * per_epoch)
    session.start_training(state, planned)
    ctx = session.protocol_context(model, state)
    protocol = create_runtime(settings.protocol, ctx)
    training = _RunnerOnlyTraining(model=model, record={})
    worker._register_optimizer(training)  # type: ignore[arg-type]
    job = TrainingJob(task_spec=spec, task_options=options, batch_size=task.batch_size,
                      stats=session.stats, local_stop=session.local_stop,
                      metrics=session.metrics, slowdown_spec=worker.env.slowdown,
                      num_threads=worker.env.num_threads or 1,
                      checkpoint=worker.env.checkpoint, restart=session.restart)
    try:
        reason = protocol.run_training(job)
    finally:
        protocol.close()
    training.record = {"worker_id": session.worker_id, "rank": worker.rank,
                       "protocol": settings.protocol, "iterations": session.stats.iteration,
                       "stop_reason": reason, "parameter_names": parameter_names(state),
                       settings.protocol: protocol.record()}
    return str(reason)


def _len_only(dataset: Dataset[Any]) -> Dataset[Any]:
    if not hasattr(dataset, "__len__"):
        raise ValueError("lap-sgd and lpp-sgd need a map-style training set (with a length)")
    return dataset
