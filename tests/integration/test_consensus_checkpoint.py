"""`ripples checkpoint`: the consensus model of a running run, on demand. Every live
worker publishes its model at its next step boundary through the rendezvous store, the
coordinator averages them, the CLI writes the average; training goes on throughout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ripples.bench.chaos import evaluate_models
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import ripples_cli, running_coordinator, start_worker, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("protocol", ["ripples-smart", "allreduce"])
def test_the_consensus_model_of_a_running_run_is_written_on_demand(
        protocol: str, tmp_path: Path) -> None:
    # Groups of 2 of the 3 workers: after any P-Reduce one worker's model differs from
    # the others' (groups of 3 would average all of them, and all three could publish
    # between that P-Reduce and their next step: a distance of exactly 0).
    with running_coordinator(protocol=protocol, num_workers=3, task="digits",
                             iterations=3000, lease_seconds=4.0, seed=1,
                             group_size=2) as server:
        core = server.service.core  # type: ignore[union-attr]
        workers = [start_worker(server.address, "--host", f"node{r}", "--metrics-port", "-1")
                   for r in range(3)]
        try:
            wait_for(lambda: core.started_at is not None and core.mean_iterations() > 300,
                      "the run to train")
            outputs = []
            for name in ("first.pt", "second.pt"):
                done = ripples_cli("checkpoint", "--coordinator", server.address, "--output",
                                   str(tmp_path / name), "--json", timeout=120)
                assert done.returncode == 0, done.stderr[-3000:]
                outputs.append(json.loads(done.stdout))
            at = core.mean_iterations()
            assert not core.stopped  # training went on
            # No need to train to the budget: stop the run, as `ripples stop` does.
            CoordinatorClient(server.address).stop_run("both checkpoints are written")
            wait_for(lambda: core.stopped, "the run to stop", timeout=180)
            for p in workers:
                p.communicate(timeout=60)
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
        assert all(p.returncode == 0 for p in workers)
    first, second = outputs
    assert sorted(first["workers"]) == sorted(w.worker_id for w in core.workers.values())
    assert len(first["iterations"]) == 3 and min(first["iterations"]) > 300
    assert second["consensus_id"] > first["consensus_id"]
    assert min(second["iterations"]) >= max(first["iterations"]) - 50 and at > 300
    if protocol == "allreduce":  # published after one agreed step: the same model
        assert len(set(first["iterations"])) == 1, first
        assert first["consensus_distance"] == pytest.approx(0.0, abs=1e-9)
    else:  # each at its own next step boundary, a few steps apart
        assert first["consensus_distance"] > 0.0
    accuracy, nonfinite = evaluate_models([tmp_path / "first.pt"], [], "digits", 1)
    assert accuracy > 0.8 and not nonfinite


def test_a_checkpoint_of_a_run_that_is_not_training_says_why(tmp_path: Path) -> None:
    with running_coordinator(protocol="ripples-smart", num_workers=2, task="digits",
                             iterations=100, seed=1) as server:
        done = ripples_cli("checkpoint", "--coordinator", server.address, "--output",
                           str(tmp_path / "x.pt"), timeout=60)
    assert done.returncode == 1
    assert "the run is not training now" in done.stderr
    assert not (tmp_path / "x.pt").exists()
    bad = ripples_cli("checkpoint", "--coordinator", "nowhere", "--output", "x.pt")
    assert bad.returncode == 2 and "error" in bad.stderr
