"""Checkpoints of a real local run (`ripples run --checkpoint-dir`): every worker writes
its own, they load, and a second run on the same directory goes on from them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from helpers import ripples_cli


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
