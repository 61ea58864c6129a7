"""The overlap option (a background P-Reduce, docs/gpu.md): off by default, it reaches the
workers in RunConfig, and a run that could not overlap refuses it at submission, saying
why, rather than ignore it."""

from __future__ import annotations

import pytest

from ripples.coordinator.config import RunSettings
from ripples.protocols.group_generator.settings import OVERLAP_PROTOCOLS


def test_overlap_is_off_by_default_and_travels_to_the_workers() -> None:
    assert not RunSettings.build().to_proto().group_generator.overlap
    for protocol in OVERLAP_PROTOCOLS:
        config = RunSettings.build(protocol=protocol, overlap=True, local_steps=4).to_proto()
        assert config.group_generator.overlap and config.local_steps == 4


@pytest.mark.parametrize("protocol", ["allreduce", "ripples-static", "adpsgd", "hop",
                                      "lap-sgd", "lpp-sgd"])
def test_a_protocol_that_cannot_overlap_refuses_the_option(protocol: str) -> None:
    with pytest.raises(ValueError, match=f"overlap is for ripples-random and ripples-smart, "
                                         f"not {protocol}"):
        RunSettings.build(protocol=protocol, overlap=True, task="digits", num_workers=4)


@pytest.mark.parametrize("options, expected", [
    ({"outer_optimizer": "nesterov"}, "overlap averages models and takes no outer optimizer"),
    ({"root": "127.0.0.1:5000"}, "overlap is not for a shard of a sharded job"),
])
def test_overlap_refuses_what_it_does_not_take_yet(options: dict[str, object],
                                                   expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        RunSettings.build(protocol="ripples-smart", overlap=True, **options)
