"""A worker of several ranks refuses what would leave its ranks unable to meet
(worker/replica.py); forming the group itself is tested with real processes
(tests/integration/test_sharded_workers.py)."""

from __future__ import annotations

import pytest
import torch

from ripples.worker.launch_env import LaunchEnv
from ripples.worker.replica import Replica

TORCHRUN = LaunchEnv(launcher="torchrun", rank=0, world_size=2, ranks_per_worker=2)


def test_torchruns_port_0_is_refused_with_what_to_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(ValueError, match="give a port"):
        Replica(TORCHRUN, torch.device("cpu"))


def test_a_worker_of_one_rank_has_no_replica() -> None:
    with pytest.raises(ValueError, match="one rank"):
        Replica(LaunchEnv(), torch.device("cpu"))
