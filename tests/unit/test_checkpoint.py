"""A run resumed from a ripples.Checkpointer checkpoint goes on exactly where it was cut.

Single-process, on a real worker: a sampler needs the samples per step; the
DistributedSampler resumes its epoch after the consumed samples (at the same fraction of
the epoch with another shard length); A2CiD2's momentum copy is restored and stale deltas
dropped; and a script as users write them (dropout, BatchNorm, SGD with momentum, StepLR,
a shuffled DistributedSampler in a DataLoader), cut mid-epoch and at an epoch's end and
resumed, ends bit-identical (torch.equal) to an uninterrupted run. The other
test_checkpoint_*.py modules check the options, the files, a script's own format and the
lock-step agreement.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_harness import crash, small_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ripples
from ripples.protocols.gossip.state import GossipState, MomentumParameters
from ripples.worker.launch_env import LaunchEnv

pytestmark = pytest.mark.usefixtures("single_process_worker")  # tests/unit/conftest.py


def test_a_sampler_needs_the_samples_per_step() -> None:
    model, opt = small_model()
    sampler = ripples.DistributedSampler(TensorDataset(torch.zeros(8)))
    with pytest.raises(ValueError, match="samples_per_step"):
        ripples.Checkpointer(opt, directory="unused", sampler=sampler)


def test_the_sampler_resumes_its_epoch_after_the_consumed_samples() -> None:
    sampler = ripples.DistributedSampler(TensorDataset(torch.zeros(10)), shuffle=True, seed=1)
    sampler.set_epoch(2)
    order = list(sampler)
    sampler.advance(4)
    state = sampler.state_dict()
    assert state == {"epoch": 2, "seed": 1, "position": 4, "num_samples": 10}
    fresh = ripples.DistributedSampler(TensorDataset(torch.zeros(10)), shuffle=True, seed=0)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)
    assert list(fresh) == order[4:]
    assert list(fresh) == order  # the next pass is a whole one
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # another epoch than the restored one starts afresh
    assert len(list(fresh)) == 10


def test_a_sampler_of_another_shard_length_resumes_at_the_same_fraction_of_the_epoch() -> None:
    """A lock-step run's restart round formed with 2 workers where 4 saved: each shard is
    twice as long, and 4 of 5 samples consumed become 8 of 10."""
    dataset = TensorDataset(torch.zeros(20))
    saved = ripples.DistributedSampler(dataset, num_replicas=4, rank=1)
    saved.set_epoch(1)
    list(saved)
    saved.advance(4)
    resumed = ripples.DistributedSampler(dataset, num_replicas=2, rank=1)
    resumed.load_state_dict(saved.state_dict())
    resumed.set_epoch(1)
    assert resumed.position == 8 and len(list(resumed)) == 2


def test_a2cid2s_momentum_copy_is_restored_and_stale_deltas_dropped() -> None:
    flat = torch.zeros(4)
    state = GossipState(flat, MomentumParameters(eta=0.5, alpha_tilde=0.5))
    state.add_delta(torch.ones(4))  # an exchange against the model before the restore
    flat.fill_(3.0)
    state.restart(torch.full((4,), 2.0))
    assert state.y is not None and torch.equal(state.y, torch.full((4,), 2.0))
    assert not state.apply_and_publish() and torch.equal(flat, torch.full((4,), 3.0))


STEPS_PER_EPOCH = 6  # 44 samples in batches of 8: five full batches and one of 4
EPOCHS = 3


def _train(directory: Path, *, every: int, crash_after: int | None = None
           ) -> tuple[int, dict[str, torch.Tensor] | None]:
    """A script as users write them: dropout, BatchNorm, SGD with momentum, StepLR, a
    shuffled DistributedSampler in a DataLoader; restores, trains, checkpoints. Returns
    the step it restored and the final state, None if it "crashed" after step
    `crash_after`."""
    ripples.init(env=LaunchEnv(host="test"))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(44, 6, generator=g), torch.randint(0, 3, (44,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                          nn.Linear(16, 3))
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    sampler = ripples.DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    ckpt = ripples.Checkpointer(opt, directory=directory, every=every, scheduler=scheduler,
                                sampler=sampler, samples_per_step=8)
    start = ckpt.restore()
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            scheduler.step()
            ckpt.step()
            if opt.local_step == crash_after:
                crash()
                return start, None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lr"] = torch.tensor(scheduler.get_last_lr())
    crash()
    return start, state


@pytest.mark.parametrize(("every", "crash_after"), [
    (3, 10),  # restored from step 9, mid-epoch (the sampler resumes at its 4th batch)
    (6, 13),  # restored from step 12, the end of an epoch
])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(
        tmp_path: Path, every: int, crash_after: int) -> None:
    crash()
    _, uninterrupted = _train(tmp_path / "whole", every=every)
    assert _train(tmp_path / "cut", every=every, crash_after=crash_after) == (0, None)
    start, resumed = _train(tmp_path / "cut", every=every)
    assert start == crash_after - crash_after % every
    assert uninterrupted is not None and resumed is not None
    assert list(resumed) == list(uninterrupted)
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
