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


def test_overlap_refuses_a_shard_of_a_sharded_job() -> None:
    with pytest.raises(ValueError, match="overlap is not for a shard of a sharded job"):
        RunSettings.build(protocol="ripples-smart", overlap=True, root="127.0.0.1:5000")


def test_overlap_takes_the_outer_optimizer_and_its_compression() -> None:
    config = RunSettings.build(protocol="ripples-random", overlap=True, local_steps=8,
                               outer_optimizer="nesterov", outer_compression="bf16").to_proto()
    assert config.group_generator.overlap and config.outer_compression == "bf16"
