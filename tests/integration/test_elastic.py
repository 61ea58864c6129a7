"""A worker of a running ripples-smart, adpsgd or a2cid2 run is SIGKILLed and a replacement is
started with `ripples worker run`: the survivors never stop, the replacement takes the dead worker's
rank once its lease expires, heals from a live peer, averages in the policy's groups,
and the run completes its budget."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch

from tests.integration.helpers import (
    finish,
    running_coordinator,
    start_three_then_a_fourth,
    start_worker,
    wait_for,
)

pytestmark = pytest.mark.slow

DEADLINE_SECONDS = 180




# Budgets that outlast the replacement's start-up on a loaded machine (adpsgd never
# waits for a group, so it runs through iterations several times faster).
@pytest.mark.parametrize(("protocol", "iterations"), [("ripples-smart", 1500),
                                                      ("adpsgd", 16000), ("a2cid2", 8000)])
def test_a_killed_worker_is_replaced_and_the_replacement_heals_and_averages(
        protocol: str, iterations: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with running_coordinator(protocol=protocol, num_workers=3, task="digits",
                             iterations=iterations, lease_seconds=2.0, seed=1) as server:
        core = server.service.core  # type: ignore[union-attr]
        address = server.address
        workers = [start_worker(address, "--host", f"node{r}", "--metrics-port", "-1",
                                "--save-model", str(tmp_path / f"w{r}.pt"))
                   for r in range(3)]
        try:
            wait_for(lambda: core.started_at is not None and core.mean_iterations() > 100,
                      "the run to train")
            victim = next(w for w in core.live() if w.host == "node1")
            workers[1].send_signal(signal.SIGKILL)
            workers[1].wait(10)
            killed_at = time.monotonic()
            iterations_at_kill = {w.worker_id: w.progress.iteration for w in core.live()}
            replacement = start_worker(address, "--host", "node1b", "--metrics-port", "-1",
                                       "--save-model", str(tmp_path / "w1b.pt"))
            workers.append(replacement)
            try:
                wait_for(lambda: any(w.replacement for w in core.workers.values()),
                          "the replacement to register")
            except AssertionError:
                replacement.kill()
                raise AssertionError(f"{core.stop_reason=}; the replacement said:\n"
                                     f"{replacement.communicate()[0][-3000:]}") from None
            joiner = next(w for w in core.workers.values() if w.replacement)
            survivors = [w for w in core.live() if not w.replacement]
            # The survivors went on while the dead worker's lease ran out.
            for w in survivors:
                assert w.progress.iteration > iterations_at_kill[w.worker_id]
            assert joiner.rank == victim.rank
            assert core.workers[victim.worker_id].replaced_by == joiner.worker_id
            try:
                wait_for(lambda: joiner.healed or core.stopped, "the replacement to heal")
                assert joiner.healed, f"the run ended before the heal: {core.stop_reason}"
            except AssertionError as err:
                replacement.kill()
                raise AssertionError(f"{err}; the replacement said:\n"
                                     f"{replacement.communicate()[0][-3000:]}") from None
            healed_after = time.monotonic() - killed_at
            start_iteration = joiner.progress.iteration
            outputs = finish([workers[0], workers[2], replacement], DEADLINE_SECONDS)
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
        for p, out in zip([workers[0], workers[2], replacement], outputs, strict=True):
            assert p.returncode == 0, out[-3000:]
        assert core.stopped and "iteration budget reached" in core.stop_reason
        # Healed, the replacement trained on and averaged in the policy's groups.
        assert joiner.progress.iteration > start_iteration
        assert any(joiner.worker_id in g.members and g.heal_donor is None
                   for g in core.recent_groups), "the replacement averaged in no group"
        assert "healed from worker" in outputs[2], outputs[2][-3000:]
        print(f"replacement healed {healed_after:.1f} s after the kill (lease 2 s)")
        for name in ("w0.pt", "w2.pt", "w1b.pt"):
            state = torch.load(tmp_path / name)
            assert all(torch.isfinite(t).all() for t in state.values())


def test_a_run_grows_beyond_its_workers_up_to_max_workers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Scale-up: a 3-worker ripples-smart run with --max-workers 4 takes a fourth worker
    mid-run: it gets rank 3, heals from a live peer, averages in the policy's groups, and
    the run completes with four."""
    with running_coordinator(protocol="ripples-smart", num_workers=3, max_workers=4,
                             task="digits", iterations=1500, lease_seconds=4.0,
                             seed=1) as server:
        core = server.service.core  # type: ignore[union-attr]
        workers: list[subprocess.Popen[str]] = []
        try:
            start_three_then_a_fourth(server.address, core, workers, trained=100)
            wait_for(lambda: any(w.host == "node3" and w.healed
                                  for w in core.workers.values()), "the joiner to heal")
            joiner = next(w for w in core.workers.values() if w.host == "node3")
            assert joiner.rank == 3 and core.registry.size == 4
            outputs = finish(workers, DEADLINE_SECONDS)
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
        for p, out in zip(workers, outputs, strict=True):
            assert p.returncode == 0, out[-3000:]
        assert core.stopped and "iteration budget reached" in core.stop_reason
        assert any(joiner.worker_id in g.members and g.heal_donor is None
                   for g in core.recent_groups), "the joiner averaged in no group"
        assert "healed from worker" in outputs[3], outputs[3][-3000:]
