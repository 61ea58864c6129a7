"""The ``digits`` task: a small MLP on scikit-learn's bundled 8x8 handwritten digits.

The data ships with scikit-learn (1797 images, no download), so this task runs anywhere,
offline, in seconds: the default task for tests, demos and convergence checks.
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
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


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deterministic stratified 80/20 split, features scaled to [0, 1].

    Returns:
        ``(train_inputs, train_targets, test_inputs, test_targets)`` on CPU: float32
        inputs of shape ``(n, 64)`` and int64 class labels.
    """
    data = load_digits()
    inputs = data.data / 16.0  # pixel intensities are 0..16
    train_x, test_x, train_y, test_y = train_test_split(
        inputs,
        data.target,
        test_size=TEST_FRACTION,
        random_state=SPLIT_RANDOM_STATE,
        stratify=data.target,
    )
    return (
        torch.as_tensor(train_x, dtype=torch.float32),
        torch.as_tensor(train_y, dtype=torch.int64),
        torch.as_tensor(test_x, dtype=torch.float32),
        torch.as_tensor(test_y, dtype=torch.int64),
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
