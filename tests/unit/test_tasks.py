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
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    inputs, targets = task.train_data()[:batch_size]
    model.train()
    optimizer.zero_grad()
    loss = task.loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
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
    assert task.build_optimizer(task.build_model()).param_groups[0]["lr"] == 0.01


def test_digits_defaults_and_shapes() -> None:
    task = build_task("digits", TaskOptions())
    assert task.batch_size == digits_module.DEFAULT_BATCH_SIZE
    lr = task.build_optimizer(task.build_model()).param_groups[0]["lr"]
    assert lr == digits_module.DEFAULT_LEARNING_RATE
    assert task.num_classes == 10
    train = task.train_data()
    inputs, _ = train.tensors  # type: ignore[attr-defined]
    assert len(train) == 1437 and inputs.shape == (1437, 64)  # type: ignore[arg-type]
    assert task.eval_data is not None and len(task.eval_data()) == 360  # type: ignore[arg-type]
    assert 0.0 <= float(inputs.min()) and float(inputs.max()) <= 1.0
    assert inputs.device.type == "cpu"


def test_a_task_builds_only_what_is_asked_for() -> None:
    # Building the task loads no data: a worker builds its training set, the launcher the
    # evaluation set, and each only when it needs it.
    calls: list[str] = []
    original = digits_module.load_digits_split

    def counted() -> tuple[torch.Tensor, ...]:
        calls.append("load")
        return original()

    digits_module.load_digits_split = counted  # type: ignore[assignment]
    try:
        task = build_task("digits", TaskOptions())
        assert calls == []
        task.build_model()
        assert calls == []
        task.train_data()
        assert calls == ["load"]
    finally:
        digits_module.load_digits_split = original  # type: ignore[assignment]


@pytest.mark.parametrize("spec", ["digits", "synthetic-cnn"])
def test_same_seed_gives_identical_models_and_data(spec: str) -> None:
    first = build_task(spec, TaskOptions(seed=3)).build_model()
    second = build_task(spec, TaskOptions(seed=3)).build_model()
    other_task = build_task(spec, TaskOptions(seed=4))
    other = other_task.build_model()
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b)
                   for a, b in zip(first.parameters(), other.parameters(), strict=True))
    # The data split does not depend on the seed: every worker sees the same data.
    mine = build_task(spec, TaskOptions(seed=3)).train_data().tensors  # type: ignore[attr-defined]
    theirs = other_task.train_data().tensors  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_digits_trains_to_95_percent_alone() -> None:
    # Pinned to the single-worker recipe (lr 0.05, batch 32) so that tuning the task's
    # defaults for multi-worker runs cannot make this test flaky.
    task = build_task("digits", TaskOptions(seed=0, learning_rate=0.05, batch_size=32))
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    inputs, targets = task.train_data().tensors  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(0)
    num_samples = len(inputs)
    initial_loss, initial_accuracy = evaluate(task, model)
    for _ in range(20):
        order = torch.randperm(num_samples, generator=generator)
        for start in range(0, num_samples, task.batch_size):
            batch = order[start : start + task.batch_size]
            optimizer.zero_grad()
            loss = task.loss_fn(model(inputs[batch]), targets[batch])
            loss.backward()
            optimizer.step()
    loss, accuracy = evaluate(task, model)
    assert accuracy is not None and initial_accuracy is not None
    assert loss < initial_loss
    assert accuracy >= 0.95, f"test accuracy {accuracy:.3f} after 20 epochs"


def test_evaluate_uses_the_given_model_and_restores_its_mode() -> None:
    task = build_task("digits", TaskOptions(seed=0))
    other = build_task("digits", TaskOptions(seed=1)).build_model()
    other.train()
    assert evaluate(task, other) != evaluate(task, task.build_model())
    assert other.training


def test_evaluate_without_eval_data_is_a_value_error() -> None:
    task = build_task("digits", TaskOptions())
    task.eval_data = None
    with pytest.raises(ValueError, match="no eval data"):
        evaluate(task, task.build_model())


def test_evaluate_without_num_classes_reports_no_accuracy() -> None:
    task = build_task("digits", TaskOptions())
    task.num_classes = None
    loss, accuracy = evaluate(task, task.build_model())
    assert math.isfinite(loss) and accuracy is None


def test_synthetic_cnn_is_resnet20_sized_and_steps() -> None:
    task = build_task("synthetic-cnn", TaskOptions(seed=0))
    assert 200_000 <= _num_params(task.build_model()) <= 350_000
    assert task.batch_size == 32
    inputs, targets = task.train_data().tensors  # type: ignore[attr-defined]
    assert inputs.shape == (4096, 3, 32, 32)
    assert task.eval_data is not None and len(task.eval_data()) == 512  # type: ignore[arg-type]
    assert set(targets.unique().tolist()) == set(range(10))
    assert math.isfinite(_train_step(task, batch_size=8))


def test_synthetic_vgg16_is_vgg16_sized_and_steps() -> None:
    task = build_task("synthetic-vgg16", TaskOptions(seed=0))
    assert 14_000_000 <= _num_params(task.build_model()) <= 16_000_000
    assert task.batch_size == 32
    assert math.isfinite(_train_step(task, batch_size=4))


def test_transformer_lm_stream_skips_files_too_short_for_a_block(tmp_path) -> None:
    """The standard library holds empty __init__.py files; a worker whose share of the
    files starts with one trained nothing (torch.frombuffer refuses 0 bytes: the bench's
    8-worker transformer-lm run failed on it). Such files are skipped, and every block
    that the stream yields is a full block from the other files."""
    from ripples.examples.transformer_lm import ByteStream

    (tmp_path / "empty.py").write_bytes(b"")
    (tmp_path / "short.py").write_bytes(b"x = 1\n")
    text = bytes(range(256)) * 4
    (tmp_path / "long.py").write_bytes(text)
    files = sorted(tmp_path.iterdir())
    stream = iter(ByteStream(files, 16, rank=0, num_workers=1, seed=0, shuffle_buffer=4))
    blocks = [next(stream) for _ in range(20)]
    for x, y in blocks:
        assert x.shape == y.shape == (16,)
        assert torch.equal(x[1:], y[:-1])  # y is x shifted by one byte of the same file
        start = int(x[0])
        assert bytes(x.tolist()) == text[start:start + 16]


def test_the_digits_are_read_without_importing_scikit_learn() -> None:
    """The file read straight from scikit-learn's package is what its `load_digits`
    gives; a worker and `ripples run` pay nothing for scikit-learn's imports (this test
    imports it only afterwards, to compare)."""
    import subprocess
    import sys

    check = ("import sys; from ripples.worker.tasks.digits import load_digits_split; "
             "load_digits_split(); print('sklearn' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            timeout=120, check=True)
    assert loaded.stdout.strip() == "False"
    from sklearn.datasets import load_digits

    pixels, labels = digits_module.load_digits_arrays()
    reference = load_digits()
    assert (pixels == reference.data).all() and (labels == reference.target).all()


def test_the_digits_split_is_stratified_disjoint_and_fixed() -> None:
    _, labels = digits_module.load_digits_arrays()
    train, test = digits_module.stratified_split(labels, 0.2, seed=0)
    assert len(test) == math.ceil(0.2 * len(labels)) == 360 and len(train) == 1437
    assert sorted([*train, *test]) == list(range(len(labels)))  # every sample, once
    # Each class's share of the test set is within one sample of its share of the whole.
    whole = torch.bincount(torch.as_tensor(labels)).double()
    held_out = torch.bincount(torch.as_tensor(labels[test]), minlength=len(whole)).double()
    assert ((held_out - 0.2 * whole).abs() < 1).all()
    again = digits_module.stratified_split(labels, 0.2, seed=0)
    assert (again[0] == train).all() and (again[1] == test).all()
    other = digits_module.stratified_split(labels, 0.2, seed=1)
    assert set(other[1]) != set(test)


def test_the_digits_without_scikit_learn_name_the_package(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digits_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="scikit-learn is not installed: pip install"):
        digits_module.load_digits_arrays()
