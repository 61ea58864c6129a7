"""Fixtures shared by several unit test modules (used by name: none is autouse here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from checkpoint_harness import crash

import ripples
from ripples.worker.launch_env import LaunchEnv


@pytest.fixture
def single_process_worker() -> Iterator[None]:
    """Every test starts single-process (whatever the environment says) and leaves no
    worker behind. One torch thread: on a busy machine, threads over tiny tensors only
    contend (a hundredfold slower steps measured here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ripples.init(env=LaunchEnv(host="test"))
    yield
    crash()
    torch.set_num_threads(threads)
