"""Gradient accumulation as DDP scripts write it, on real workers (gloo) and a real
coordinator: `model.require_backward_grad_sync = ...` (nanoGPT) and `with model.no_sync():`
on the user's own model do what they do on a DDP wrapper under `allreduce`, exactly as
`opt.no_sync()`, and nothing under the protocols that synchronise in step() only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, ripples_cli

pytestmark = pytest.mark.slow

PROBE = str(REPO / "tests" / "integration" / "scripts" / "probe_train.py")
ACCUMULATE = 3


def _accumulate(protocol: str, spelling: str, out: Path, *extra: str,
                run_options: tuple[str, ...] = ()) -> list[dict]:
    """Two workers accumulating ACCUMULATE micro-batches per step; their records."""
    proc = ripples_cli("run", "--workers", "2", "--workers-per-node", "2", "--protocol",
                       protocol, "--output", str(out), "--quiet", *run_options, "--",
                       "python", PROBE,
                       "--accumulate", str(ACCUMULATE), "--accumulate-with", spelling,
                       "--record", str(out / "rank{rank}.json"), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _models(out: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / "workers" / f"rank{r}.pt") for r in (0, 1)]


def test_ddp_spellings_average_only_the_last_micro_batch_as_opt_no_sync(
        tmp_path: Path) -> None:
    """After each micro-batch but the last the two workers' gradients differ (nothing was
    all-reduced); after the last they are equal (averaged). The three spellings train
    bit-identical models, and the ranks hold one model."""
    models = {}
    for spelling in ("opt", "attribute", "model"):
        records = _accumulate("allreduce", spelling, tmp_path / spelling, "--steps", "6")
        fingerprints = [rec["gradients"] for rec in records]
        assert len(fingerprints[0]) == 4 * ACCUMULATE, fingerprints  # the probe's first 4 steps
        synced = [a == b for a, b in zip(*fingerprints, strict=True)]
        assert synced == [False, False, True] * 4, (spelling, fingerprints)
        models[spelling] = _models(tmp_path / spelling)
        for name, tensor in models[spelling][0].items():
            assert torch.equal(tensor, models[spelling][1][name]), (spelling, name)
    for spelling in ("attribute", "model"):
        for name, tensor in models["opt"][0].items():
            assert torch.equal(models[spelling][0][name], tensor), (spelling, name)


def test_backward_after_the_stop_stays_local_whatever_the_attribute_says(
        tmp_path: Path) -> None:
    """The run stops at its budget; rank 0 then makes three more steps with
    `require_backward_grad_sync = True`, while its peer has left: a backward that
    synchronised would fail in gloo (nobody to all-reduce with)."""
    records = _accumulate("allreduce", "attribute", tmp_path, "--steps", "100",
                          "--steps-after-stop", "3", run_options=("--iterations", "8"))
    assert {rec["seen"][-1]["step"] for rec in records} == {8}


@pytest.mark.parametrize("protocol", ["ripples-random", "ripples-static"])
def test_ddp_spellings_are_harmless_where_step_synchronises(protocol: str,
                                                           tmp_path: Path) -> None:
    """Protocols that average in step() never synchronise inside backward: the
    attribute is a plain attribute there, `model.no_sync()` a no-op, and the workers'
    gradients differ after every micro-batch, the last one included."""
    for spelling in ("attribute", "model"):
        records = _accumulate(protocol, spelling, tmp_path / spelling, "--steps", "6")
        fingerprints = [rec["gradients"] for rec in records]
        assert all(a != b for a, b in zip(*fingerprints, strict=True)), fingerprints


def test_ddp_spellings_run_alone(tmp_path: Path) -> None:
    """The same script without a coordinator (single-process mode)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIPPLES_")}
    for spelling in ("attribute", "model"):
        record = tmp_path / f"{spelling}.json"
        proc = subprocess.run(
            [sys.executable, PROBE, "--steps", "4", "--accumulate", str(ACCUMULATE),
             "--accumulate-with", spelling, "--record", str(record)],
            capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(json.loads(record.read_text())["gradients"]) == 4 * ACCUMULATE
