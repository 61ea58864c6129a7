"""Built-in tasks, and the plug-in interface for `--task module:function`.

A task is a factory ``(TaskOptions) -> Task``; the built-in runner (worker/runner.py)
trains it through the public API (`ripples.init`, `ripples.Optimizer`,
`ripples.DistributedSampler`) like any user script. A `Task` holds *builders*, not built
objects, so that each process builds only what it needs: a worker builds the model, the
optimizer and the training data; the launcher that evaluates the consensus model builds
the model and the evaluation data only; an LPP-SGD updater builds its own copy.

It is named either by a built-in name (``BUILTIN_TASKS``) or by ``"module:function"`` for
user code on the import path. Builders must be deterministic given ``TaskOptions.seed``:
every worker then starts from the same model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = [
    "BUILTIN_TASKS",
    "Task",
    "TaskFactory",
    "TaskOptions",
    "build_task",
    "classification_task",
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
    """Torch device the model builder must place the model on (e.g. ``"cuda:0"``)."""
    learning_rate: float | None = None
    """Optimizer learning rate; None uses the task's default."""
    batch_size: int | None = None
    """Per-worker minibatch size; None uses the task's default."""


@dataclass(kw_only=True)
class Task:
    """How to build a model, its optimizer, loss and data: what the runner trains.

    Invariants: ``build_model()`` returns the same model (values included) every call
    with the same options, on ``TaskOptions.device``; the datasets yield ``(input,
    target)`` pairs on CPU (the runner moves each batch to the device).
    """

    build_model: Callable[[], nn.Module]
    """The model, initialised from ``TaskOptions.seed``, on ``TaskOptions.device``."""
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    """The optimizer over the model's parameters."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """``loss_fn(model(inputs), targets)`` returns a scalar mean loss."""
    train_data: Callable[[], Dataset[Any]]
    """The training set: a map-style Dataset (the runner shards it by worker with
    ripples.DistributedSampler) or an IterableDataset (which must shard itself by
    ``ripples.current_worker().rank``)."""
    batch_size: int
    """Per-worker minibatch size."""
    eval_data: Callable[[], Dataset[Any]] | None = None
    """The evaluation set, built only where the consensus model is evaluated."""
    build_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """A learning-rate scheduler over the (ripples) optimizer, stepped once per step."""
    num_classes: int | None = None
    """When set, ``evaluate`` also reports accuracy (argmax over the model's output)."""
    grad_clip_norm: float | None = None
    """Clip the gradients' global norm to this before every step."""
    autocast_dtype: torch.dtype | None = None
    """Run forward and loss under ``torch.autocast`` with this dtype (bf16 on CPU)."""
    loader_workers: int = 0
    """DataLoader worker processes for the training data."""
    iterations_per_epoch: int | None = None
    """Steps per worker per epoch for an IterableDataset (a map-style set has a length)."""


TaskFactory = Callable[[TaskOptions], Task]

BUILTIN_TASKS: dict[str, str] = {
    "digits": "ripples.worker.tasks.digits:digits",
    "synthetic-cnn": "ripples.worker.tasks.synthetic_cnn:synthetic_cnn",
    "synthetic-vgg16": "ripples.worker.tasks.synthetic_cnn:synthetic_vgg16",
}
"""Built-in task name -> ``"module:function"`` of its factory."""


TensorSplit = tuple[Tensor, Tensor, Tensor, Tensor]
"""(train inputs, train targets, eval inputs, eval targets), on CPU."""


def classification_task(options: TaskOptions, *, load: Callable[[], TensorSplit],
                        build_model: Callable[[], nn.Module], learning_rate: float,
                        momentum: float, batch_size: int, num_classes: int) -> Task:
    """A classification task on in-memory tensors, trained with SGD and momentum (the
    built-in tasks): `load` runs where a dataset is asked for, and keeps only its part.

    Args:
        options: The runtime's; its learning rate and batch size override the defaults.
        load: Returns the whole split, deterministically (every worker the same data).
        build_model: The model on CPU; seeded with ``options.seed`` and moved to the device.
    """
    lr = learning_rate if options.learning_rate is None else options.learning_rate

    def model() -> nn.Module:
        torch.manual_seed(options.seed)
        return build_model().to(options.device)

    def train_data() -> TensorDataset:
        train_x, train_y, _, _ = load()
        return TensorDataset(train_x, train_y)

    def eval_data() -> TensorDataset:
        _, _, eval_x, eval_y = load()
        return TensorDataset(eval_x, eval_y)

    return Task(
        build_model=model,
        build_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum),
        loss_fn=nn.CrossEntropyLoss(),
        train_data=train_data,
        eval_data=eval_data,
        batch_size=batch_size if options.batch_size is None else options.batch_size,
        num_classes=num_classes,
    )


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

    Raises:
        ValueError: If the spec cannot be resolved or the factory returns something other
            than a consistent ``Task``.
    """
    task = resolve_task(spec)(options)
    if not isinstance(task, Task):
        raise ValueError(
            f"task {spec!r}: the factory returned a {type(task).__name__}, not a "
            "ripples.worker.tasks.Task; return Task(build_model=..., build_optimizer=..., "
            "loss_fn=..., train_data=..., batch_size=...)"
        )
    if task.batch_size < 1:
        raise ValueError(f"task {spec!r}: batch_size must be at least 1, got {task.batch_size}")
    for name in ("build_model", "build_optimizer", "loss_fn", "train_data"):
        if not callable(getattr(task, name)):
            raise ValueError(f"task {spec!r}: {name} must be callable")
    return task


def evaluate(task: Task, model: nn.Module) -> tuple[float, float | None]:
    """Mean loss, and accuracy when ``task.num_classes`` is set, over the eval data.

    Runs under ``torch.no_grad()`` in eval mode, restoring the model's previous mode.

    Returns:
        ``(mean_loss, accuracy)``; accuracy is None when the task has no ``num_classes``.

    Raises:
        ValueError: If the task has no eval data.
    """
    if task.eval_data is None:
        raise ValueError("this task has no eval data; give its Task an eval_data builder")
    first_param = next(model.parameters(), None)
    device = first_param.device if first_param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    total_loss, num_correct, num_samples = 0.0, 0, 0
    try:
        with torch.no_grad():
            for inputs, targets in DataLoader(task.eval_data(), batch_size=EVAL_BATCH_SIZE):
                inputs, targets = inputs.to(device), targets.to(device)
                outputs = model(inputs)
                # loss_fn returns a batch mean; weight by batch size for an exact overall mean.
                total_loss += float(task.loss_fn(outputs, targets)) * len(inputs)
                num_samples += len(inputs)
                if task.num_classes is not None:
                    num_correct += int((outputs.argmax(dim=1) == targets).sum())
    finally:
        model.train(was_training)
    if num_samples == 0:
        raise ValueError("the task's eval data is empty")
    accuracy = num_correct / num_samples if task.num_classes is not None else None
    return total_loss / num_samples, accuracy
