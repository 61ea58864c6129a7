"""Where and how often ripples.Checkpointer saves: its interval and launch options.

Intervals parse as steps or seconds (a malformed one says what to write); the checkpoint
options travel through the launch environment and the runner's command line, malformed
RIPPLES_* variables are named; without a directory the Checkpointer does nothing, and the
launch environment gives it its directory and interval. Single-process, on a real worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_harness import crash, run_steps, saved_files, small_model

import ripples
from ripples.worker.launch_env import CheckpointInterval, CheckpointOptions, LaunchEnv
from ripples.worker.process_launcher import launch_environment, runner_argv

pytestmark = pytest.mark.usefixtures("single_process_worker")  # tests/unit/conftest.py


@pytest.mark.parametrize(("text", "steps", "seconds"), [
    ("500", 500, 0.0), (20, 20, 0.0), ("90s", 0, 90.0), ("1.5S", 0, 1.5), (" 7 ", 7, 0.0),
    ("0", 0, 0.0), (0, 0, 0.0), (None, 0, 0.0)])
def test_intervals_are_steps_or_seconds(text: str | int | None, steps: int,
                                        seconds: float) -> None:
    assert CheckpointInterval.parse(text) == CheckpointInterval(steps=steps, seconds=seconds)


@pytest.mark.parametrize("text", ["x", "-1", "-2s", "5m", "1.5", "nans", "infs", ""])
def test_a_malformed_interval_says_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match=r"give a step count \(500\), seconds \(90s\)"):
        CheckpointInterval.parse(text)


def test_the_options_travel_through_the_launch_environment() -> None:
    options = CheckpointOptions(checkpoint_dir="/ck", checkpoint_every="90s",
                                keep_checkpoints=5)
    env = LaunchEnv(coordinator="c:1", host="h", checkpoint=options)
    child = launch_environment(env, rank=0, world_size=1)
    assert LaunchEnv.from_environ(child).checkpoint == options
    argv = runner_argv(env, "digits", quiet=True)
    flags = argv[argv.index("--checkpoint-dir"):][:6]
    assert flags == ["--checkpoint-dir", "/ck", "--checkpoint-every", "90s",
                     "--keep-checkpoints", "5"]
    assert "RIPPLES_CHECKPOINT_DIR" not in launch_environment(LaunchEnv(host="h"), rank=None,
                                                              world_size=None)


@pytest.mark.parametrize(("variables", "message"), [
    ({"RIPPLES_CHECKPOINT_EVERY": "soon"}, "RIPPLES_CHECKPOINT_EVERY"),
    ({"RIPPLES_KEEP_CHECKPOINTS": "0"}, "at least 1.*RIPPLES_KEEP_CHECKPOINTS"),
    ({"RIPPLES_KEEP_CHECKPOINTS": "all"}, "RIPPLES_KEEP_CHECKPOINTS='all' is not an integer"),
])
def test_malformed_checkpoint_variables_are_named(variables: dict[str, str],
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchEnv.from_environ({"RIPPLES_CHECKPOINT_DIR": "/ck", **variables})


def test_without_a_directory_it_does_nothing(tmp_path: Path) -> None:
    model, opt = small_model()
    ckpt = ripples.Checkpointer(opt, every=1)
    assert not ckpt.enabled and ckpt.restore() == 0
    run_steps(opt, ckpt, 2)
    assert ckpt.save() is None and not list(tmp_path.iterdir())


def test_the_launch_environment_gives_the_directory_and_interval(tmp_path: Path) -> None:
    crash()
    options = CheckpointOptions(checkpoint_dir=str(tmp_path), checkpoint_every="2",
                                keep_checkpoints=1)
    ripples.init(env=LaunchEnv(host="test", checkpoint=options))
    model, opt = small_model()
    ckpt = ripples.Checkpointer(opt)
    run_steps(opt, ckpt, 5)
    assert saved_files(tmp_path) == ["step-4.pt"]
