"""lap/lpp-sgd round checkpoints (worker/protocols/lpp/checkpoints.py): when a worker
wishes one, what a file holds, retention, and the restore through a real rendezvous store
(one rank: the agreement is the library's, tested with several ranks in test_checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ripples.protocols.lpp.checkpoints import LppCheckpoints
from ripples.worker.checkpoint_store import StoreExchange
from ripples.worker.launch_env import CheckpointOptions


def _checkpoints(tmp_path: Path, model: torch.nn.Module, every: str = "100",
                 keep: int = 2) -> LppCheckpoints:
    options = CheckpointOptions(checkpoint_dir=str(tmp_path), checkpoint_every=every,
                                keep_checkpoints=keep)
    return LppCheckpoints(options, model, rank=0, num_workers=1, protocol="lap-sgd")


def _exchange() -> StoreExchange:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return StoreExchange(store, "run", 0, 1, 10.0)


def test_a_worker_wishes_a_checkpoint_every_interval_of_updates(tmp_path: Path) -> None:
    ckpt = _checkpoints(tmp_path, torch.nn.Linear(2, 1))
    assert not ckpt.wish(99) and ckpt.wish(100)
    ckpt.save(7, [60, 45])
    assert not ckpt.wish(200) and ckpt.wish(205)  # 100 updates since the save (105)
    off = LppCheckpoints(CheckpointOptions(), torch.nn.Linear(2, 1), rank=0, num_workers=1,
                         protocol="lap-sgd")
    assert not off.enabled and not off.wish(10**6) and off.save(1, [1]) is None


def test_the_newest_round_is_restored_into_the_model_and_older_ones_pruned(
        tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    ckpt = _checkpoints(tmp_path, model, keep=2)
    saved = {}
    for round_, counts in [(3, [10, 12]), (6, [30, 31]), (9, [50, 49])]:
        with torch.no_grad():
            model.weight.fill_(float(round_))
        ckpt.save(round_, counts)
        saved[round_] = model.weight.clone()
    assert sorted(p.name for p in (tmp_path / "rank-0").iterdir()) == ["round-6.pt",
                                                                     "round-9.pt"]
    (tmp_path / "rank-0" / ".round-12.pt.partial").write_bytes(b"torn")  # a killed writer
    with torch.no_grad():
        model.weight.zero_()
    restored = ckpt.restore(_exchange(), updaters=2)
    assert restored is not None and restored.round == 9 and restored.updates == (50, 49)
    assert restored.counter == 99
    torch.testing.assert_close(model.weight, saved[9])
    assert not (tmp_path / "rank-0" / ".round-12.pt.partial").exists()


def test_another_number_of_updaters_spreads_the_count(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    _checkpoints(tmp_path, model).save(4, [50, 51])
    restored = _checkpoints(tmp_path, model).restore(_exchange(), updaters=3)
    assert restored is not None and restored.updates == (34, 34, 33)


def test_an_unreadable_round_falls_back_and_another_model_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    ckpt = _checkpoints(tmp_path, model, keep=5)
    ckpt.save(1, [5])
    ckpt.save(2, [9])
    (tmp_path / "rank-0" / "round-2.pt").write_bytes(b"not a checkpoint")
    restored = _checkpoints(tmp_path, model).restore(_exchange(), updaters=1)
    assert restored is not None and restored.round == 1
    with pytest.raises(ValueError, match="another model"):
        _checkpoints(tmp_path, torch.nn.Linear(3, 1)).restore(_exchange(), updaters=1)


def test_nothing_to_restore_without_files(tmp_path: Path) -> None:
    assert _checkpoints(tmp_path, torch.nn.Linear(2, 1)).restore(_exchange(), 2) is None
