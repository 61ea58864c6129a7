"""The non-finite gate's pieces (worker/dataplane/nonfinite.py): the flag, the void of a
group result that had a flagged member, the host's watch, and AveragedState carrying the
flag through its staging buffer. The collectives themselves run over real gloo in
tests/integration/test_preduce.py; here a group's SUM is the members' staged buffers
added up, which is what the collective computes."""

from __future__ import annotations

import pytest
import torch

from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.nonfinite import NonfiniteWatch, nonfinite_flag, void_if_flagged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_flag_is_one_for_a_nan_or_an_infinity_and_zero_otherwise(
        dtype: torch.dtype) -> None:
    values = torch.linspace(-3, 3, 101, dtype=dtype)
    assert nonfinite_flag(values).tolist() == [0.0]
    assert nonfinite_flag(values).dtype == dtype
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = values.clone()
        poisoned[17] = bad
        assert nonfinite_flag(poisoned).tolist() == [1.0]


def test_a_flagged_sum_keeps_the_members_own_values_and_an_unflagged_one_the_result() -> None:
    kept = torch.tensor([1.0, 2.0, 3.0])
    result = torch.tensor([float("nan"), 5.0, 6.0])
    void_if_flagged(torch.tensor([2.0]), kept, result)
    assert result.tolist() == [1.0, 2.0, 3.0]
    result = torch.tensor([4.0, 5.0, 6.0])
    void_if_flagged(torch.tensor([0.0]), kept, result)
    assert result.tolist() == [4.0, 5.0, 6.0]


def _members(count: int) -> list[AveragedState]:
    states = []
    for seed in range(count):
        torch.manual_seed(seed)
        states.append(AveragedState(torch.nn.Sequential(
            torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))))
    return states


def _p_reduce(states: list[AveragedState]) -> None:
    staged = [s.stage(1.0 / len(states)) for s in states]
    total = torch.stack(staged).sum(0)
    for buffer in staged:
        buffer.copy_(total)
    for s in states:
        s.commit()


def test_the_staging_buffer_carries_the_flag_after_the_state() -> None:
    state = _members(1)[0]
    staged = state.stage(0.5)
    assert staged.numel() == state.numel + 1
    assert state.staged_bytes == staged.numel() * staged.element_size()
    torch.testing.assert_close(staged[:-1], state.flat * 0.5)
    assert staged[-1].item() == 0.0
    with torch.no_grad():
        state.flat[0] = float("inf")
    assert state.stage(0.5)[-1].item() == 1.0


def test_a_group_with_a_nan_member_keeps_every_members_state_and_views() -> None:
    states = _members(3)
    with torch.no_grad():
        states[2].flat[5] = float("nan")
    before = [s.flat.clone() for s in states]
    _p_reduce(states)
    for s, own in zip(states, before, strict=True):
        torch.testing.assert_close(s.flat, own, rtol=0, atol=0, equal_nan=True)
        # The parameters are views of the adopted buffer, whichever values it holds.
        assert s.params[0].data_ptr() == s.flat.data_ptr()
    # The two finite members, alone, average as before.
    healthy = states[:2]
    mean = (before[0] + before[1]) / 2
    _p_reduce(healthy)
    for s in healthy:
        torch.testing.assert_close(s.flat, mean)


def test_the_host_reads_the_first_flagged_step_and_drops_what_follows() -> None:
    watch = NonfiniteWatch()
    finite, flagged = torch.tensor([0.0]), torch.tensor([1.0])
    watch.note(1, finite)
    watch.note(2, finite)
    assert watch.first_flagged() is None and watch.unread == 0
    watch.note(3, flagged)
    watch.note(4, flagged)
    assert watch.first_flagged() == 3
    assert watch.unread == 0 and watch.first_flagged() is None
    watch.note(5, finite)
    watch.note(6, flagged)
    assert watch.drain() == 6
