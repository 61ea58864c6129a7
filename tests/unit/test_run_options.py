"""The one schema of run options (coordinator/config.py, protocols/settings.py): every
field of a run and of every protocol's settings has a strict type and bounds, and the
bounds fit the proto field that carries it to the workers (a value the proto cannot hold
once wedged the service)."""

from __future__ import annotations

import dataclasses

import pytest

from ripples.coordinator.config import CHECKED_APART, MAX_WORKERS, RUN_LIMITS, RunSettings
from ripples.protocols.registry import SETTINGS_CLASSES
from ripples.protocols.settings import _PROTO_INTS, value_limits
from ripples.v1 import coordinator_pb2 as pb

CLASSES = [(RunSettings, pb.RunConfig.DESCRIPTOR, RUN_LIMITS)] + [
    (cls, cls._message_type().DESCRIPTOR, cls.limits) for cls in SETTINGS_CLASSES]


@pytest.mark.parametrize("cls, message, explicit", CLASSES,
                         ids=[c[0].__name__ for c in CLASSES])
def test_every_option_has_a_type_and_bounds_that_fit_its_proto_field(
        cls: type, message: object, explicit: dict[str, tuple[float, float]]) -> None:
    limits = value_limits(cls, message, explicit, skip=CHECKED_APART)  # type: ignore[arg-type]
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - CHECKED_APART
    assert set(limits) == fields
    for name, (kind, low, high) in limits.items():
        proto = message.fields_by_name.get(name)  # type: ignore[attr-defined]
        assert low <= high, name
        if proto is not None and kind is int:
            proto_low, proto_high = _PROTO_INTS[proto.type]
            assert proto_low <= low and high <= proto_high, f"{cls.__name__}.{name}"
        if kind is float:
            assert high <= 1e9, f"{cls.__name__}.{name}: an unbounded float"


def test_worker_counts_are_bounded_by_max_workers_and_the_defaults_validate() -> None:
    for name in ("num_workers", "min_workers", "max_workers", "workers_per_node"):
        assert RUN_LIMITS[name][1] == MAX_WORKERS
    RunSettings.build(num_workers=MAX_WORKERS, task="digits", iterations=1)
    with pytest.raises(ValueError, match="num_workers must be at most 100000"):
        RunSettings.build(num_workers=MAX_WORKERS + 1)
    with pytest.raises(ValueError, match="group_size must be at most 100000"):
        RunSettings.build(group_size=MAX_WORKERS + 1)


@pytest.mark.parametrize("option, value, expected", [
    ("seed", -1, "seed must be at least 0, got -1"),
    ("epochs", float("nan"), "epochs must be a finite number"),
    ("heartbeat_interval_seconds", float("inf"), "must be a finite number"),
    ("iterations", 2.0, "iterations must be an integer, got 2.0"),
    ("final_average", 1, "final_average must be true or false"),
    ("hop_mode", 3, "hop_mode must be a string"),
    ("lpp_averaging", "all\x1b[2J", "lpp_averaging must not hold control characters"),
    ("task", "t" * 2000, "task must be at most 1024 characters, got 2000"),
    ("max_ig", 10**9, "max_ig must be at most 10000"),
    ("rate_com", True, "rate_com must be a number, got True"),
])
def test_a_value_of_the_wrong_type_or_out_of_bounds_is_refused_naming_the_option(
        option: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=expected.replace("[", r"\[")):
        RunSettings.build(**{option: value})
