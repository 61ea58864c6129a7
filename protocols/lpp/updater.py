"""An LAP-SGD / LPP-SGD updater process (Algorithm 1, lines 1-7).

Started with spawn by its worker's averaging process (worker/protocols/lpp/protocol.py). It
builds the task, points its model's parameters and buffers at the worker's shared ones
(shared memory on CPU, CUDA IPC on GPU), and runs Hogwild steps until the shared counter
reaches the budget or the worker says stop: s = read&inc(counter), pick the block
(worker/protocols/lpp/rules.py: BlockSelection), forward on the live shared model, gradients of the
block's parameters only, its own optimizer's step in place. It never waits for anyone.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset, default_collate

from ripples.protocols.lpp.rules import BlockSelection
from ripples.worker.dataplane.averaged_state import bind_parameters
from ripples.worker.slowdown import Slowdown, SlowdownSpec
from ripples.worker.tasks import TaskOptions, build_task

UPDATER_NICENESS = 5
"""Updaters run this much nicer than their worker's averaging process."""
LEAD_POLL_SECONDS = 0.001
LOSS_SLOTS = 16
"""Recent losses the updaters of a worker keep for its progress (slot = s mod this)."""


@dataclass(kw_only=True)
class SharedState:
    """What a worker's processes share; pickled once into each updater at spawn."""

    flat: torch.Tensor
    """The model's averaged state, parameters first (AveragedState's layout)."""
    buffers: list[torch.Tensor]
    """The model's buffers (BatchNorm statistics), in module.buffers() order."""
    counter: Any
    """mp.Value('q'): the next counter value s (read&inc under its lock)."""
    done: Any
    """mp.Array('q', U): updates finished, per updater."""
    compute: Any
    """mp.Array('d', U): seconds of compute (and injected slowdown), per updater."""
    losses: Any
    """mp.Array('d', LOSS_SLOTS): the loss of update s at slot s mod LOSS_SLOTS (nan: none)."""
    ready: Any
    """mp.Array('b', U): the updater has built its model and waits for `go`."""
    go: Any
    """mp.Event: every worker's updaters are ready, training starts."""
    averaged_at: Any
    """mp.Value('q'): the counter value when the last completed averaging round began."""
    max_lead: int
    """Updates the updaters may make beyond averaged_at before they wait for a round."""
    stop: Any
    """mp.Event: the averaging process wants the updaters to finish."""
    errors: Any
    """mp.Queue: an updater that fails puts its message here, then exits 1."""


@dataclass(frozen=True, kw_only=True)
class UpdaterJob:
    index: int
    """0..U-1; the updater owns block index + 1."""
    task: str
    options: TaskOptions
    rank: int
    num_workers: int
    seed: int
    budget: int
    """T: the worker stops handing out counter values at this one."""
    full_until: int
    """T_st: full-model updates while s <= this."""
    blocks: tuple[tuple[int, int], ...]
    """Per block 1..U, its (first, end) parameter tensors."""
    parent_pid: int
    """The worker's process: an updater whose parent is gone stops."""
    slowdown: str = ""
    num_threads: int = 1
    start: int = 0
    """The counter's first value (restored from a checkpoint: its data order is drawn
    afresh rather than repeat the order of the run's start)."""


class ShardBatches:
    """Mini-batches from the worker's shard of the training set (its DistributedSampler
    shard of epoch 0), in an order of this updater's own: the updaters of a worker share
    its data, each with its own stream (Algorithm 1). The shard is reshuffled after each
    pass; a last partial batch is dropped."""

    def __init__(self, dataset: Dataset[Any], rank: int, num_workers: int, batch_size: int,
                 seed: int, stream: int, start: int = 0) -> None:
        self.dataset = dataset
        # ripples.DistributedSampler deals epoch 0 as torch's does.
        self.shard = torch.tensor(list(DistributedSampler(dataset, num_replicas=num_workers,
                                                          rank=rank, seed=seed)))
        if len(self.shard) == 0:
            raise ValueError(f"{num_workers} workers leave rank {rank} no training data")
        self.batch_size = min(batch_size, len(self.shard))
        self._generator = torch.Generator().manual_seed(
            seed * 7919 + rank + 1 + stream * 104729 + start * 15485863)
        self._order = self._shuffled()
        self._pos = 0

    def _shuffled(self) -> torch.Tensor:
        return self.shard[torch.randperm(len(self.shard), generator=self._generator)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pos + self.batch_size > len(self._order):
            self._order, self._pos = self._shuffled(), 0
        indices = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        if isinstance(self.dataset, TensorDataset):  # one gather per tensor, no collate
            inputs, targets = (t[indices] for t in self.dataset.tensors)
            return inputs, targets
        batch = default_collate([self.dataset[int(i)] for i in indices])
        return batch[0], batch[1]


def take_counter(counter: Any, budget: int) -> int | None:
    """read&inc: the counter's value, incremented atomically; None once it reached budget."""
    with counter.get_lock():
        s = int(counter.value)
        if s >= budget:
            return None
        counter.value = s + 1
        return s


def updater_main(job: UpdaterJob, shared: SharedState) -> None:
    """Process entry point: run updates, report a failure on the queue, exit without
    interpreter teardown (the worker's process owns the shared model)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which stops us
    # The averaging processes must run the moment a round is due (the paper gives them a
    # CPU while the GPU computes); on a CPU that the updaters keep busy, a round waits for
    # both members to be scheduled, rounds became rare and the workers' models drifted
    # apart (measured on digits, 2 workers x 2 updaters on 2 cores: 58 rounds in 2,210
    # updates and a useless average). Updaters yield the CPU to them.
    os.nice(UPDATER_NICENESS)
    code = 0
    try:
        run_updates(job, shared)
    except BaseException as err:  # noqa: BLE001 (reported to the averaging process)
        shared.errors.put(f"updater {job.index} of worker rank {job.rank}: "
                          f"{type(err).__name__}: {err}")
        shared.errors.close()
        shared.errors.join_thread()  # the message is in the pipe before the process ends
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_updates(job: UpdaterJob, shared: SharedState) -> None:
    torch.set_num_threads(job.num_threads)
    if shared.flat.device.type == "cuda":
        torch.cuda.set_device(shared.flat.device)  # not GPU 0's context for cuda:k
    task = build_task(job.task, job.options)
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    bind_parameters(model, shared.flat)
    own_buffers = list(model.buffers())
    if len(own_buffers) != len(shared.buffers):
        raise RuntimeError(f"the task built {len(own_buffers)} buffers, the worker shares "
                           f"{len(shared.buffers)}")
    for mine, theirs in zip(own_buffers, shared.buffers, strict=True):
        mine.data = theirs
    params = list(model.parameters())
    first, end = job.blocks[job.index]
    own_block = params[first:end]
    dataset = task.train_data()
    batches = ShardBatches(dataset, job.rank, job.num_workers, task.batch_size, job.seed,
                           stream=job.index + 1, start=job.start)
    selection = BlockSelection(job.index + 1, job.full_until)
    spec = (SlowdownSpec.parse(job.slowdown, seed=job.seed * 1000 + job.rank * 64 + job.index)
            if job.slowdown else SlowdownSpec())
    slowdown = Slowdown(spec)
    device = shared.flat.device
    model.train()
    shared.ready[job.index] = 1

    def orphaned() -> bool:  # the worker died (SIGKILL): nobody will set go or stop
        return os.getppid() != job.parent_pid

    while not shared.go.wait(0.1):  # the averaging process sets it, or stop, at every exit
        if shared.stop.is_set() or orphaned():
            return
    while not shared.stop.is_set() and not orphaned():
        if int(shared.counter.value) - int(shared.averaged_at.value) >= shared.max_lead:
            time.sleep(LEAD_POLL_SECONDS)  # averaging is behind: let a round complete
            continue
        s = take_counter(shared.counter, job.budget)
        if s is None:
            return
        targets = params if selection.select(s) == 0 else own_block
        inputs, labels = batches.next_batch()
        inputs = inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(model(inputs), labels)
        # Partial backpropagation: gradients of the block only; the optimizer skips
        # parameters without one (their momentum stays as it was).
        value = float(loss.detach())
        if not math.isfinite(value):  # before the step: the shared model stays finite
            raise FloatingPointError(f"training loss became {value} at update {s}; lower "
                                     "the learning rate")
        grads = torch.autograd.grad(loss, targets)
        for p, g in zip(targets, grads, strict=True):
            p.grad = g
        optimizer.step()
        compute = time.perf_counter() - t0
        compute += slowdown.after_compute(compute)
        shared.losses[s % LOSS_SLOTS] = value
        shared.compute[job.index] += compute
        shared.done[job.index] += 1
