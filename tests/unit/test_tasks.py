"""Unit tests for the task plug-in interface and the built-in tasks."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from ripples.worker.tasks import (
    BUILTIN_TASKS,
    Task,
    TaskOptions,
    build_task,
    evaluate,
    resolve_task,
)
from ripples.worker.tasks import digits as digits_module
from ripples.worker.tasks.digits import digits
from ripples.worker.tasks.synthetic_cnn import synthetic_cnn, synthetic_vgg16


@pytest.fixture(autouse=True)
def single_intra_op_thread() -> Iterator[None]:
    """Runs each test on one intra-op thread, restoring the previous count after.

    These models are tiny, and on a busy CI host oversubscribed intra-op threads slowed
    the digits training loop twentyfold (0.5 s -> 12 s).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _train_step(task: Task, batch_size: int) -> float:
    task.model.train()
    task.optimizer.zero_grad()
    loss = task.loss_fn(task.model(task.train_inputs[:batch_size]), task.train_targets[:batch_size])
    loss.backward()
    task.optimizer.step()
    return loss.item()


# --- resolution -------------------------------------------------------------------------


def test_builtin_names_resolve_to_their_factories() -> None:
    assert resolve_task("digits") is digits
    assert resolve_task("synthetic-cnn") is synthetic_cnn
    assert resolve_task("synthetic-vgg16") is synthetic_vgg16
    assert set(BUILTIN_TASKS) == {"digits", "synthetic-cnn", "synthetic-vgg16"}


def test_module_function_spec_resolves() -> None:
    assert resolve_task("ripples.worker.tasks.digits:digits") is digits


def test_unknown_name_lists_the_builtins() -> None:
    with pytest.raises(ValueError, match="unknown task 'mnist'") as info:
        resolve_task("mnist")
    for name in BUILTIN_TASKS:
        assert name in str(info.value)


def test_unimportable_module_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_task("no_such_module_xyz:factory")


def test_missing_attribute_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="has no attribute 'no_such_factory'"):
        resolve_task("ripples.worker.tasks.digits:no_such_factory")


def test_non_callable_attribute_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a callable"):
        resolve_task("ripples.worker.tasks.digits:NUM_CLASSES")


@pytest.mark.parametrize("spec", [":digits", "ripples.worker.tasks.digits:"])
def test_half_empty_spec_is_a_value_error(spec: str) -> None:
    with pytest.raises(ValueError, match="module:function"):
        resolve_task(spec)


def test_factory_returning_wrong_type_is_a_value_error() -> None:
    # builtins.vars is an importable one-argument callable that returns a dict, not a Task.
    with pytest.raises(ValueError, match="the factory returned a dict, not a"):
        build_task("builtins:vars", TaskOptions())


# --- build_task and the built-in tasks --------------------------------------------------


def test_build_task_applies_overrides() -> None:
    task = build_task("digits", TaskOptions(learning_rate=0.01, batch_size=7))
    assert task.batch_size == 7
    assert task.optimizer.param_groups[0]["lr"] == 0.01


def test_digits_defaults_and_shapes() -> None:
    task = build_task("digits", TaskOptions())
    assert task.batch_size == digits_module.DEFAULT_BATCH_SIZE
    assert task.optimizer.param_groups[0]["lr"] == digits_module.DEFAULT_LEARNING_RATE
    assert task.num_classes == 10
    assert task.train_inputs.shape == (1437, 64)
    assert task.eval_inputs is not None and task.eval_inputs.shape == (360, 64)
    assert 0.0 <= float(task.train_inputs.min()) and float(task.train_inputs.max()) <= 1.0
    assert task.train_inputs.device.type == "cpu"


@pytest.mark.parametrize("spec", ["digits", "synthetic-cnn"])
def test_same_seed_gives_identical_models_and_data(spec: str) -> None:
    first = build_task(spec, TaskOptions(seed=3))
    second = build_task(spec, TaskOptions(seed=3))
    other = build_task(spec, TaskOptions(seed=4))
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(first.model.parameters(), other.model.parameters(), strict=True)
    )
    # The data split does not depend on the seed: every worker sees the same data.
    assert torch.equal(first.train_inputs, other.train_inputs)
    assert torch.equal(first.train_targets, other.train_targets)


def test_digits_trains_to_95_percent_alone() -> None:
    # Pinned to the single-worker recipe (lr 0.05, batch 32) so that tuning the task's
    # defaults for multi-worker runs cannot make this test flaky.
    task = build_task("digits", TaskOptions(seed=0, learning_rate=0.05, batch_size=32))
    generator = torch.Generator().manual_seed(0)
    num_samples = len(task.train_inputs)
    initial_loss, initial_accuracy = evaluate(task)
    for _ in range(20):
        order = torch.randperm(num_samples, generator=generator)
        for start in range(0, num_samples, task.batch_size):
            batch = order[start : start + task.batch_size]
            task.optimizer.zero_grad()
            loss = task.loss_fn(task.model(task.train_inputs[batch]), task.train_targets[batch])
            loss.backward()
            task.optimizer.step()
    loss, accuracy = evaluate(task)
    assert accuracy is not None and initial_accuracy is not None
    assert loss < initial_loss
    assert accuracy >= 0.95, f"test accuracy {accuracy:.3f} after 20 epochs"


def test_evaluate_uses_the_given_model_and_restores_its_mode() -> None:
    task = build_task("digits", TaskOptions(seed=0))
    other = build_task("digits", TaskOptions(seed=1)).model
    other.train()
    assert evaluate(task, other) != evaluate(task)
    assert other.training


def test_evaluate_without_eval_data_is_a_value_error() -> None:
    task = build_task("digits", TaskOptions())
    task.eval_inputs = None
    task.eval_targets = None
    with pytest.raises(ValueError, match="no eval data"):
        evaluate(task)


def test_evaluate_without_num_classes_reports_no_accuracy() -> None:
    task = build_task("digits", TaskOptions())
    task.num_classes = None
    loss, accuracy = evaluate(task)
    assert math.isfinite(loss) and accuracy is None


def test_synthetic_cnn_is_resnet20_sized_and_steps() -> None:
    task = build_task("synthetic-cnn", TaskOptions(seed=0))
    assert 200_000 <= _num_params(task.model) <= 350_000
    assert task.batch_size == 32
    assert task.train_inputs.shape == (4096, 3, 32, 32)
    assert task.eval_inputs is not None and task.eval_inputs.shape == (512, 3, 32, 32)
    assert set(task.train_targets.unique().tolist()) == set(range(10))
    assert math.isfinite(_train_step(task, batch_size=8))


def test_synthetic_vgg16_is_vgg16_sized_and_steps() -> None:
    task = build_task("synthetic-vgg16", TaskOptions(seed=0))
    assert 14_000_000 <= _num_params(task.model) <= 16_000_000
    assert task.batch_size == 32
    assert math.isfinite(_train_step(task, batch_size=4))
