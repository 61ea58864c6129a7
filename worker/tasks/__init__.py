"""The task plug-in interface: what a worker trains, and how a task is named on the CLI.

A task is a factory ``(TaskOptions) -> Task``. It is named either by a built-in name
(see ``BUILTIN_TASKS``) or by ``"module:function"`` for user code on the import path.
Every worker of a run builds the same task with the same seed, so factories must be
deterministic given ``TaskOptions.seed``: all workers then start from identical models
and see the same data split (the runtime shards ``train_inputs`` by worker rank).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

__all__ = [
    "BUILTIN_TASKS",
    "Task",
    "TaskFactory",
    "TaskOptions",
    "build_task",
    "evaluate",
    "resolve_task",
]

EVAL_BATCH_SIZE = 512
"""Evaluation runs in chunks of this many samples to bound memory on large eval sets."""


@dataclass(kw_only=True)
class TaskOptions:
    """What the runtime tells a task factory."""

    seed: int = 0
    """Seeds model initialisation; workers given the same seed start identical."""
    device: str = "cpu"
    """Torch device the factory must place the model on (e.g. ``"cuda:0"``)."""
    learning_rate: float | None = None
    """Optimizer learning rate; None uses the task's default."""
    batch_size: int | None = None
    """Per-worker minibatch size; None uses the task's default."""


@dataclass(kw_only=True)
class Task:
    """A model, its optimizer and loss, and the data to train and evaluate it on.

    Invariants: ``model`` is on the requested device and ``optimizer`` is built over
    ``model.parameters()``; data tensors stay on CPU (the runtime moves each batch to
    the device); ``train_inputs`` and ``train_targets`` have the same first dimension,
    and so do the eval tensors when present.
    """

    model: torch.nn.Module
    """Already on ``TaskOptions.device``."""
    optimizer: torch.optim.Optimizer
    """Built over ``model.parameters()``."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """``loss_fn(model(inputs), targets)`` returns a scalar mean loss."""
    train_inputs: Tensor
    """The full training set on CPU; the runtime shards it by worker rank."""
    train_targets: Tensor
    batch_size: int
    """Per-worker minibatch size."""
    eval_inputs: Tensor | None = None
    eval_targets: Tensor | None = None
    num_classes: int | None = None
    """When set, ``evaluate`` also reports accuracy (argmax over the model's output)."""


TaskFactory = Callable[[TaskOptions], Task]

BUILTIN_TASKS: dict[str, str] = {
    "digits": "ripples.worker.tasks.digits:digits",
    "synthetic-cnn": "ripples.worker.tasks.synthetic_cnn:synthetic_cnn",
    "synthetic-vgg16": "ripples.worker.tasks.synthetic_cnn:synthetic_vgg16",
}
"""Built-in task name -> ``"module:function"`` of its factory."""


def resolve_task(spec: str) -> TaskFactory:
    """Find the factory a task spec names, without calling it.

    Args:
        spec: A built-in name (a key of ``BUILTIN_TASKS``) or ``"module:function"``.

    Returns:
        The factory callable.

    Raises:
        ValueError: If the name is unknown, the module cannot be imported, the attribute
            is missing, or it is not callable.
    """
    target = BUILTIN_TASKS.get(spec, spec)
    if ":" not in target:
        raise ValueError(
            f"unknown task {spec!r}: use one of the built-in tasks "
            f"({', '.join(sorted(BUILTIN_TASKS))}) or 'module:function' for your own factory"
        )
    module_name, _, attr_path = target.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"task {spec!r} must look like 'module:function', with both parts set")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"task {spec!r}: cannot import module {module_name!r} ({exc}); check the name "
            "and that it is on PYTHONPATH on every worker"
        ) from exc
    factory: object = module
    for part in attr_path.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise ValueError(
                f"task {spec!r}: module {module_name!r} has no attribute {attr_path!r}; "
                "check the function name after the colon"
            ) from None
    if not callable(factory):
        raise ValueError(
            f"task {spec!r}: {target!r} is a {type(factory).__name__}, not a callable; "
            "point it at a function taking TaskOptions and returning Task"
        )
    return cast(TaskFactory, factory)


def build_task(spec: str, options: TaskOptions) -> Task:
    """Resolve a task spec, call its factory and check what it returned.

    Args:
        spec: A built-in name or ``"module:function"`` (see ``resolve_task``).
        options: Passed to the factory.

    Returns:
        The task the factory built.

    Raises:
        ValueError: If the spec cannot be resolved or the factory returns something other
            than a consistent ``Task``.
    """
    task = resolve_task(spec)(options)
    if not isinstance(task, Task):
        raise ValueError(
            f"task {spec!r}: the factory returned a {type(task).__name__}, not a "
            "ripples.worker.tasks.Task; return Task(model=..., optimizer=..., ...)"
        )
    _validate(spec, task)
    return task


def _validate(spec: str, task: Task) -> None:
    """Check a factory's result for the mistakes that would otherwise fail mid-run."""
    if task.batch_size < 1:
        raise ValueError(f"task {spec!r}: batch_size must be at least 1, got {task.batch_size}")
    if len(task.train_inputs) != len(task.train_targets):
        raise ValueError(
            f"task {spec!r}: train_inputs has {len(task.train_inputs)} samples but "
            f"train_targets has {len(task.train_targets)}; they must match"
        )
    if (task.eval_inputs is None) != (task.eval_targets is None):
        raise ValueError(f"task {spec!r}: set both eval_inputs and eval_targets, or neither")
    if task.eval_inputs is not None and task.eval_targets is not None:
        if len(task.eval_inputs) != len(task.eval_targets):
            raise ValueError(
                f"task {spec!r}: eval_inputs has {len(task.eval_inputs)} samples but "
                f"eval_targets has {len(task.eval_targets)}; they must match"
            )


def evaluate(task: Task, model: torch.nn.Module | None = None) -> tuple[float, float | None]:
    """Mean loss, and accuracy when ``task.num_classes`` is set, over the eval data.

    Runs under ``torch.no_grad()`` in eval mode, restoring the model's previous mode.

    Args:
        task: The task whose eval data and loss are used.
        model: The model to evaluate; defaults to ``task.model``. Its device is used for
            the data.

    Returns:
        ``(mean_loss, accuracy)``; accuracy is None when the task has no ``num_classes``.

    Raises:
        ValueError: If the task has no eval data.
    """
    if task.eval_inputs is None or task.eval_targets is None or len(task.eval_inputs) == 0:
        raise ValueError(
            "this task has no eval data; set eval_inputs and eval_targets in its factory "
            "to evaluate it"
        )
    model = task.model if model is None else model
    first_param = next(model.parameters(), None)
    device = first_param.device if first_param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    total_loss = 0.0
    num_correct = 0
    num_samples = len(task.eval_inputs)
    try:
        with torch.no_grad():
            for start in range(0, num_samples, EVAL_BATCH_SIZE):
                inputs = task.eval_inputs[start : start + EVAL_BATCH_SIZE].to(device)
                targets = task.eval_targets[start : start + EVAL_BATCH_SIZE].to(device)
                outputs = model(inputs)
                # loss_fn returns a batch mean; weight by batch size for an exact overall mean.
                total_loss += float(task.loss_fn(outputs, targets)) * len(inputs)
                if task.num_classes is not None:
                    num_correct += int((outputs.argmax(dim=1) == targets).sum())
    finally:
        model.train(was_training)
    mean_loss = total_loss / num_samples
    accuracy = num_correct / num_samples if task.num_classes is not None else None
    return mean_loss, accuracy
