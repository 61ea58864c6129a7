"""torchft's DiLoCo as the `torchft-diloco` peer of `ripples bench`, for real on loopback:
two workers through the bench's peer launcher (a lighthouse, a Manager each, gloo), H = 4,
16 steps of the digits task; then Ripples' `allreduce --local-steps 4 --outer-optimizer
nesterov` (the bench's allreduce-diloco variant with that H) on the same seed, data and
task, which must end on the same model: both are DiLoCo, and digits' MLP has no buffers
(torchft averages parameters only). Skips, naming the package, without torchft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ripples_cli

from ripples.bench.matrix import diloco_flags
from ripples.bench.peers import missing_package
from ripples.bench.peers.launch import PeerRunConfig, run_peer
from ripples.bench.peers.progress import read_step_logs
from ripples.bench.peers.workloads import build_workload

pytestmark = pytest.mark.slow

WORKERS, H, STEPS, SEED, BATCH = 2, 4, 16, 0, 16


def test_torchft_diloco_trains_in_rounds_and_ends_where_ripples_diloco_does(
        tmp_path: Path) -> None:
    if missing_package("torchft"):
        pytest.skip("torchft is not installed (pip install 'ripples[peers]')")
    per_epoch = build_workload("digits", [], seed=SEED, batch_size=BATCH, rank=0,
                               num_workers=WORKERS, max_epochs=1.0, max_steps=0).planned_steps
    peer = tmp_path / "torchft-diloco"
    summary = run_peer(PeerRunConfig(
        peer="torchft-diloco", workload="digits", num_workers=WORKERS, seed=SEED,
        batch_size=BATCH, max_epochs=STEPS / per_epoch, settings={"sync_every": H},
        output=peer, timeout_seconds=240))
    assert summary["peer_settings"]["sync_every"] == H
    assert [(w["rank"], w["iterations"]) for w in summary["workers"]] == [(0, STEPS), (1, STEPS)]
    model = torch.load(peer / "model.pt", weights_only=True)
    four_p = 4 * sum(v.numel() for v in model.values())  # P fp32 parameters, no buffers
    # One all-reduce of the pseudo-gradients per round, nothing in between: 4P / H a step.
    records = read_step_logs(peer, WORKERS)
    assert len(records) == WORKERS * STEPS
    assert all(r.sent_bytes == (four_p if r.iteration % H == 0 else 0) for r in records)
    assert summary["bytes_per_worker_step"] == four_p / H
    assert [w["preduce_bytes"] for w in summary["workers"]] == [four_p * STEPS // H] * WORKERS
    # The last step closed a round: both replicas hold the new anchor.
    assert summary["consensus_distance_final"] == 0.0
    assert summary["final_loss"] is not None and summary["final_loss"] < 2.3

    ripples = tmp_path / "ripples"
    proc = ripples_cli("run", "--quiet", "--workers", str(WORKERS), "--workers-per-node",
                       str(WORKERS), "--protocol", "allreduce", *diloco_flags({"sync_every": H}),
                       "--task", "digits", "--batch-size", str(BATCH), "--iterations",
                       str(STEPS), "--seed", str(SEED), "--output", str(ripples))
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(ripples / "model.pt", weights_only=True)
    assert set(theirs) == set(model)
    initial = build_workload("digits", [], seed=SEED, batch_size=BATCH, rank=0,
                             num_workers=WORKERS, max_epochs=1.0, max_steps=0).model
    for name, start in initial.state_dict().items():
        assert not torch.allclose(model[name], start)  # it trained
        torch.testing.assert_close(model[name], theirs[name], rtol=1e-5, atol=1e-6)
