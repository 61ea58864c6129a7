"""The ``digits`` task: a small MLP on scikit-learn's bundled 8x8 handwritten digits.

The data ships with scikit-learn (1797 images, no download), so this task runs anywhere,
offline, in seconds: the default task for tests, demos and convergence checks.

The file is read straight from scikit-learn's installed package, without importing
scikit-learn: its import (scipy and all) takes about a second of CPU, in every worker
and in `ripples run` itself, which was a fifth of a short local run's start-up on two
cores. The split is this module's own (`stratified_split`), so it needs nothing of
scikit-learn either.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ripples.worker.tasks import Task, TaskOptions, classification_task

DEFAULT_LEARNING_RATE = 0.1
DEFAULT_BATCH_SIZE = 16
MOMENTUM = 0.9
NUM_CLASSES = 10
NUM_FEATURES = 64
TEST_FRACTION = 0.2
SPLIT_RANDOM_STATE = 0
"""Fixed, independent of ``TaskOptions.seed``: every worker must see the same split."""


DATA_FILE = Path("datasets", "data", "digits.csv.gz")
"""Where scikit-learn keeps the digits, inside its package: one row per image, 64 pixel
intensities then the label."""


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 images as ``(pixels, labels)``: float64 intensities 0..16, shape
    ``(1797, 64)``, and int64 labels, in the file's order (scikit-learn's
    ``load_digits``'s ``data`` and ``target``).

    Raises:
        RuntimeError: scikit-learn is not installed, or its package has no digits file.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder, DATA_FILE)
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    raise RuntimeError(
        "the digits task reads its data from scikit-learn's package "
        f"(sklearn/{DATA_FILE.as_posix()}), and "
        + ("scikit-learn is not installed: pip install scikit-learn" if spec is None
           else f"no such file is in {', '.join(folders) or 'its package'}"))


def stratified_split(labels: np.ndarray, test_fraction: float,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, test)`` that hold each class in the proportions of the whole.

    The test set has ``ceil(test_fraction * n)`` samples; each class gives the floor of
    its share, and the samples left over go to the classes with the largest remainders
    (the lowest label first on a tie). Which samples of a class are held out, and both
    sets' order, are random under `seed` and nothing else.
    """
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    shares = counts * test_fraction
    taken = np.floor(shares).astype(np.int64)
    left = math.ceil(test_fraction * len(labels)) - int(taken.sum())
    by_remainder = sorted(range(len(classes)), key=lambda c: (-(shares[c] - taken[c]), c))
    taken[by_remainder[:left]] += 1
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label, count in zip(classes, taken, strict=True):
        members = rng.permutation(np.flatnonzero(labels == label))
        test.append(members[:count])
        train.append(members[count:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deterministic stratified 80/20 split, features scaled to [0, 1].

    Returns:
        ``(train_inputs, train_targets, test_inputs, test_targets)`` on CPU: float32
        inputs of shape ``(n, 64)`` and int64 class labels.
    """
    pixels, labels = load_digits_arrays()
    inputs = pixels / 16.0  # pixel intensities are 0..16
    train, test = stratified_split(labels, TEST_FRACTION, SPLIT_RANDOM_STATE)
    return (
        torch.as_tensor(inputs[train], dtype=torch.float32),
        torch.as_tensor(labels[train], dtype=torch.int64),
        torch.as_tensor(inputs[test], dtype=torch.float32),
        torch.as_tensor(labels[test], dtype=torch.int64),
    )


def build_digits_model() -> nn.Module:
    """The 64 -> 128 -> 64 -> 10 ReLU MLP (about 17k parameters), on CPU."""
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, NUM_CLASSES),
    )


def digits(options: TaskOptions) -> Task:
    """Build the digits task.

    Args:
        options: Seed for model initialisation, device, and optional overrides of the
            learning rate (default 0.1) and batch size (default 16).

    Returns:
        The task: the 1437-sample training set and the 360-sample test set, each loaded
        only by the process that asks for it.
    """
    return classification_task(
        options, load=load_digits_split, build_model=build_digits_model,
        learning_rate=DEFAULT_LEARNING_RATE, momentum=MOMENTUM,
        batch_size=DEFAULT_BATCH_SIZE, num_classes=NUM_CLASSES)
