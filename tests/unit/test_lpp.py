"""LAP-SGD / LPP-SGD rules (worker/protocols/lpp/rules.py): blocks, block selection, the
synchronisation scheme, settings; and how an updater shares its worker's model (bind_parameters)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ripples.coordinator.config import RunSettings
from ripples.protocols.lpp.rules import FULL_MODEL, BlockSelection, partition_blocks
from ripples.protocols.lpp.settings import LppSettings
from ripples.protocols.spec import Coordination, Role
from ripples.worker.dataplane.averaged_state import AveragedState, bind_parameters
from ripples.worker.tasks import TaskOptions, build_task


@given(sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=40),
       parts=st.integers(1, 8))
def test_blocks_partition_the_tensors_exactly_into_contiguous_non_empty_runs(
        sizes: list[int], parts: int) -> None:
    if parts > len(sizes):
        with pytest.raises(ValueError, match="too few for"):
            partition_blocks(sizes, parts)
        return
    blocks = partition_blocks(sizes, parts)
    assert len(blocks) == parts
    assert blocks[0][0] == 0 and blocks[-1][1] == len(sizes)
    for (_, end), (start, _) in zip(blocks, blocks[1:], strict=False):
        assert end == start  # contiguous, no gap, no overlap
    assert all(start < end for start, end in blocks)  # every block holds a tensor


def test_blocks_of_a_real_model_cover_every_parameter_once_and_balance_counts() -> None:
    task = build_task("synthetic-cnn", TaskOptions(seed=0))
    params = list(task.build_model().parameters())
    sizes = [p.numel() for p in params]
    blocks = partition_blocks(sizes, 3)
    covered = [i for start, end in blocks for i in range(start, end)]
    assert covered == list(range(len(params)))
    counts = [sum(sizes[start:end]) for start, end in blocks]
    assert sum(counts) == sum(sizes)
    # The nearest tensor boundaries to thirds: no block holds most of the model unless one
    # tensor alone is that large.
    assert max(counts) <= sum(sizes) / 3 + max(sizes)


def test_blocks_are_near_equal_when_tensors_allow() -> None:
    assert partition_blocks([10] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert partition_blocks([1, 1, 1, 97], 2) == [(0, 3), (3, 4)]


def test_block_selection_is_full_until_t_st_then_alternates_per_updater() -> None:
    rule = BlockSelection(own_block=2, full_until=5)
    assert [rule.select(s) for s in range(6)] == [FULL_MODEL] * 6
    # After T_st the updater's own steps alternate, whatever counter values it draws.
    assert [rule.select(s) for s in (6, 9, 10, 17, 30)] == [2, FULL_MODEL, 2, FULL_MODEL, 2]
    assert LppSettings().full_until(1000, partial=False) == 1000  # LAP-SGD: the full model
    assert LppSettings(full_fraction=0.1).full_until(1000, partial=True) == 100


def test_sync_frequency_is_every_update_until_half_the_budget_then_h() -> None:
    cfg = LppSettings(sync_period=16)
    assert [cfg.sync_frequency(s, 100) for s in (0, 49, 50, 99)] == [1, 1, 16, 16]


@pytest.mark.parametrize(("change", "message"), [
    ({"updaters": 0}, "updaters must be in 1..64"),
    ({"sync_period": 0}, "sync_period must be at least 1"),
    ({"full_fraction": 1.5}, "full_fraction must be in [0, 1]"),
    ({"lpp_averaging": "gossip"}, "unknown lpp_averaging 'gossip'"),
    ({"epochs": 0.0, "target_loss": 1.0}, "lpp-sgd needs a budget of iterations or epochs"),
])
def test_run_settings_name_what_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RunSettings.build(protocol="lpp-sgd", **change)


def test_averaging_in_groups_makes_the_coordinator_generate_groups() -> None:
    assert RunSettings(protocol="lap-sgd").role == Role(coordination=Coordination.LOCKSTEP)
    grouped = RunSettings.build(protocol="lpp-sgd", lpp_averaging="ripples-smart")
    assert grouped.role is RunSettings(protocol="ripples-smart").role
    assert grouped.role.coordination is Coordination.GROUPS and grouped.role.forms_groups
    assert not grouped.role.needs_every_worker
    assert RunSettings.build(protocol="lpp-sgd", lpp_averaging="ripples-random",
                             topology="ring").role.label == "random"
    with pytest.raises(ValueError, match="takes no topology"):
        RunSettings(protocol="lap-sgd", topology="ring")


def test_an_updater_model_bound_to_the_flat_buffer_shares_its_storage() -> None:
    worker = build_task("digits", TaskOptions(seed=0)).build_model()
    flat = AveragedState(worker).flat
    updater = build_task("digits", TaskOptions(seed=5)).build_model()  # other initial values
    bind_parameters(updater, flat)
    for mine, theirs in zip(updater.parameters(), worker.parameters(), strict=True):
        assert mine.data_ptr() == theirs.data_ptr()
    first = next(updater.parameters())
    first.data.add_(1.0)  # an updater's in-place step is the worker's
    assert next(worker.parameters()).data.equal(first.data)
    with pytest.raises(ValueError, match="cannot hold"):
        bind_parameters(updater, flat[:10])
