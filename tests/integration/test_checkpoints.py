"""Checkpoints of a real local run (`ripples run --checkpoint-dir`): every worker writes
its own, they load, and a second run on the same directory goes on from them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from helpers import REPO, ripples_cli


def _steps(directory: Path) -> list[int]:
    names = (re.fullmatch(r"step-(\d+)\.pt", p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in names if m)


def _records(output: Path) -> dict[int, dict]:
    records = (json.loads(p.read_text()) for p in (output / "workers").glob("rank*.json"))
    return {r["rank"]: r for r in records}


def test_a_run_checkpoints_every_worker_and_the_next_run_goes_on_from_them(
        tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    common = ("run", "--workers", "2", "--protocol", "ripples-smart", "--task", "digits",
              "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "20", "--quiet")
    first = ripples_cli(*common, "--iterations", "60", "--output", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr[-3000:]
    newest = {}
    for rank, record in _records(tmp_path / "first").items():
        steps = _steps(checkpoints / f"rank-{rank}")
        # Every 20 steps, and the last step when the run stopped; the newest 3 kept.
        assert len(steps) == 3 and steps[-1] == record["iterations"], (steps, record)
        assert all(s % 20 == 0 for s in steps[:-1])
        for step in steps:
            state = torch.load(checkpoints / f"rank-{rank}" / f"step-{step}.pt",
                               weights_only=False)
            assert state["step"] == step and state["rank"] == rank
            assert state["optimizer"]["ripples"]["local_step"] == step
            assert all(torch.isfinite(t).all() for t in state["model"].values())
            assert state["optimizer"]["state"]  # SGD's momentum came along
        newest[rank] = steps[-1]

    second = ripples_cli(*common, "--iterations", "100", "--output", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.8
    for rank, record in _records(tmp_path / "second").items():
        # Its step count went on from its newest checkpoint: the steps this process made
        # are what it added to the restored one.
        assert record["iterations"] - record["step_times"]["steps"] == newest[rank], record
        assert _steps(checkpoints / f"rank-{rank}")[-1] == record["iterations"]
        assert record["iterations"] > 60


def test_a_malformed_interval_is_refused_before_anything_starts(tmp_path: Path) -> None:
    proc = ripples_cli("run", "--workers", "2", "--task", "digits", "--checkpoint-dir",
                       str(tmp_path), "--checkpoint-every", "5min")
    assert proc.returncode == 2
    assert "checkpoint interval '5min'" in proc.stderr and "--checkpoint-every" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_a_run_killed_whole_goes_on_with_ripples_run_resume(tmp_path: Path) -> None:
    """A total failure: the launcher and every worker SIGKILLed. `ripples run --resume`
    restarts the coordinator from OUTPUT/state and new workers from OUTPUT/checkpoints
    (the default place): each rank goes on from its newest checkpoint, the run's
    counters and loss curve go on, and it completes its budget."""
    output = tmp_path / "run"
    common = ("run", "--workers", "2", "--protocol", "ripples-smart", "--task", "digits",
              "--iterations", "1500", "--checkpoint-every", "100", "--output", str(output),
              "--quiet")
    launcher = subprocess.Popen([sys.executable, "-m", "ripples.cli", *common], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    try:
        while not (len(dirs := _rank_dirs(output)) == 2
                   and all(len(_steps(d)) >= 2 for d in dirs)):
            assert launcher.poll() is None, launcher.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoints within 120 s"
            time.sleep(0.2)
    finally:
        subprocess.run(["pkill", "-9", "-P", str(launcher.pid)], check=False)
        launcher.kill()
        launcher.communicate()
    time.sleep(0.5)  # the workers' last writes are done: every file is whole or absent
    newest = {int(d.name.removeprefix("rank-")): _steps(d)[-1] for d in _rank_dirs(output)}
    assert len(newest) == 2
    resumed = ripples_cli(*common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((output / "summary.json").read_text())
    assert "iteration budget reached" in summary["stop_reason"]
    for rank, record in _records(output).items():
        # The steps this process made continued from the checkpoint it restored.
        restored = record["iterations"] - record["step_times"]["steps"]
        assert restored == newest[rank], (rank, record["iterations"], newest)
    assert summary["final_accuracy"] >= 0.85
    assert summary["loss_curve"][0][0] < 1.0  # the curve kept its start


def _rank_dirs(output: Path) -> list[Path]:
    checkpoints = output / "checkpoints"
    return sorted(checkpoints.glob("rank-*")) if checkpoints.exists() else []
