"""Rounds sized to the link (--sync-share, worker/dataplane/local_rounds.py): the next
round is the fewest steps, from H to 8H, whose compute keeps the synchronisation within
its share; the option reaches the workers, and a run that cannot size its rounds refuses
it, saying why."""

from __future__ import annotations

import math

import pytest

from ripples.coordinator.config import RunSettings
from ripples.sim.config import SimConfig
from ripples.worker.dataplane.local_rounds import LONGEST_ROUND, SMOOTHING, RoundSizer


def test_a_slow_synchronisation_lengthens_the_rounds_and_a_fast_one_keeps_h() -> None:
    sizer = RoundSizer(8, 0.1)
    # 1 s to synchronise, 0.05 s a step: 0.9 / (0.1 * 0.05) = 180 steps, capped at 8H.
    assert sizer.next_round(1.0, 0.05) == LONGEST_ROUND * 8
    fast = RoundSizer(8, 0.1)
    assert fast.next_round(0.01, 0.05) == 8  # 1.8 steps would do: never below H
    exact = RoundSizer(4, 0.2)
    # 0.2 s and 0.01 s: 0.2 * 0.8 / (0.2 * 0.01) = 80, capped at 32; 0.04 s: 16 steps.
    assert exact.next_round(0.04, 0.01) == 16


def test_the_round_follows_running_means_not_one_slow_group() -> None:
    sizer = RoundSizer(8, 0.5)
    assert sizer.next_round(0.8, 0.1) == 8   # 0.8 s over 0.1 s steps: 8 steps
    # One group four times as slow moves the mean by SMOOTHING of the difference.
    expected = (1 - SMOOTHING) * 0.8 + SMOOTHING * 3.2
    assert sizer.next_round(3.2, 0.1) == math.ceil(expected / 0.1) == 16
    assert sizer.next_round(0.8, 0.0) == sizer.steps  # no step time: the length stays


def test_sync_share_is_off_by_default_and_travels_to_the_workers() -> None:
    assert RunSettings.build().to_proto().group_generator.sync_share == 0
    config = RunSettings.build(protocol="ripples-smart", local_steps=8, sync_share=0.1,
                               outer_optimizer="nesterov", outer_compression="int8")
    assert config.to_proto().group_generator.sync_share == pytest.approx(0.1)


@pytest.mark.parametrize("options, expected", [
    ({"protocol": "allreduce"}, "sync_share is for ripples-random and ripples-smart, not "
     "allreduce"),
    ({"protocol": "ripples-static"}, "not ripples-static"),
    ({"protocol": "ripples-smart", "overlap": True}, "with overlap they are hidden already"),
    ({"protocol": "ripples-smart", "root": "127.0.0.1:5000"},
     "sync_share is not for a shard of a sharded job"),
    ({"protocol": "ripples-smart", "sync_share": 0.95}, "sync_share must be from 0 .* to "
     "0.9, got 0.95"),
    ({"protocol": "ripples-smart", "sync_share": -0.1}, "sync_share must be at least 0"),
])
def test_a_run_that_cannot_size_its_rounds_refuses_the_option(
        options: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        RunSettings.build(**{"task": "digits", "num_workers": 4, "local_steps": 4,
                             "sync_share": 0.1, **options})


def test_the_simulator_refuses_sync_share_having_no_links() -> None:
    with pytest.raises(ValueError, match="the simulator does not size rounds to a link"):
        SimConfig(protocol="ripples-smart", run_options={"sync_share": 0.1, "local_steps": 4})
