"""The run options of local steps and the outer optimizer: their defaults are
today's run, their values are checked, they reach the workers in RunConfig, and a protocol
whose runtime has no outer step refuses them at submission, saying why."""

from __future__ import annotations

import pytest

from ripples.cli import main as cli
from ripples.coordinator.config import RunSettings
from ripples.protocols.registry import PROTOCOLS


def test_the_defaults_are_todays_run_and_travel_to_the_workers() -> None:
    settings = RunSettings.build()
    assert (settings.local_steps, settings.outer_optimizer) == (1, "none")
    config = settings.to_proto()
    assert (config.local_steps, config.outer_optimizer) == (1, "none")
    assert (config.outer_lr, config.outer_momentum) == pytest.approx((0.7, 0.5))
    assert config.outer_compression == "none"
    compressed = RunSettings.build(protocol="ripples-smart", local_steps=8,
                                   outer_optimizer="nesterov", outer_compression="bf16")
    assert compressed.to_proto().outer_compression == "bf16"
    for name in PROTOCOLS:  # every protocol runs with them as they are
        RunSettings.build(protocol=name, task="digits", num_workers=4)


@pytest.mark.parametrize("options, expected", [
    ({"local_steps": 0}, "local_steps must be at least 1, got 0"),
    ({"local_steps": 100_001}, "local_steps must be at most 100000"),
    ({"local_steps": 2.0}, "local_steps must be an integer"),
    ({"outer_optimizer": "adam"}, "outer_optimizer must be one of none, nesterov, got 'adam'"),
    ({"outer_optimizer": "n" * 17}, "outer_optimizer must be at most 16 characters"),
    ({"outer_optimizer": "nesterov", "outer_lr": 0.0}, "outer_lr must be positive, got 0"),
    ({"outer_optimizer": "nesterov", "outer_lr": 10.5}, "outer_lr must be at most 10"),
    ({"outer_optimizer": "nesterov", "outer_momentum": 1.0},
     "outer_momentum must be below 1"),
    ({"outer_optimizer": "nesterov", "outer_momentum": -0.5},
     "outer_momentum must be at least 0"),
    ({"outer_optimizer": "nesterov", "outer_momentum": float("nan")},
     "outer_momentum must be a finite number"),
    ({"outer_lr": 0.5}, "outer_lr, outer_momentum and outer_compression are for "
     "outer_optimizer nesterov"),
    ({"outer_compression": "bf16"}, "outer_compression are for outer_optimizer nesterov; "
     ".* would lose their low bits in bf16"),
    ({"outer_optimizer": "nesterov", "outer_compression": "int4"},
     "outer_compression must be one of none, bf16, int8, got 'int4'"),
])
def test_a_bad_value_is_refused_naming_the_option(options: dict[str, object],
                                                 expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        RunSettings.build(**options)


@pytest.mark.parametrize("protocol, why", [
    ("a2cid2", "continuous momentum already accelerates the consensus"),
    ("hop", "queues bound the iteration gap"),
    ("lap-sgd", "average in the background every --sync-period updates"),
    ("lpp-sgd", "outside ripples.Optimizer"),
])
@pytest.mark.parametrize("options", [{"local_steps": 4}, {"outer_optimizer": "nesterov"}])
def test_a_protocol_without_an_outer_step_refuses_them_saying_why(
        protocol: str, why: str, options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"{protocol} takes no local_steps or "
                                         f"outer_optimizer \\(its [^)]*{why}"):
        RunSettings.build(protocol=protocol, task="digits", **options)


def test_every_protocol_either_takes_them_or_says_why_not() -> None:
    for spec in PROTOCOLS.values():
        refused = bool(spec.no_local_steps)
        try:
            RunSettings.build(protocol=spec.name, task="digits", local_steps=8,
                              outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.5)
        except ValueError as err:
            assert refused and spec.no_local_steps in str(err), (spec.name, err)
        else:
            assert not refused, spec.name


def test_the_cli_refuses_them_for_such_a_protocol_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run", "--workers", "2", "--protocol", "a2cid2", "--local-steps", "4",
                     "--", "python", "train.py"])
    assert code == 2
    err = capsys.readouterr().err
    assert "a2cid2 takes no local_steps or outer_optimizer" in err
    assert "Traceback" not in err
