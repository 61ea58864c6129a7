"""A worker of a running ripples-smart, adpsgd or a2cid2 run is SIGKILLed and a replacement is
started with `ripples worker run`: the survivors never stop, the replacement takes the dead worker's
rank once its lease expires, heals from a live peer, averages in the policy's groups,
and the run goes on until it is stopped."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch

from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import (
    UNBOUNDED_ITERATIONS,
    finish,
    running_coordinator,
    start_three_then_a_fourth,
    start_worker,
    wait_for,
)

pytestmark = pytest.mark.slow

DEADLINE_SECONDS = 180




def _averaged_in_a_group(core, worker_id: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether `worker_id` took part in a group of the policy (not a heal)."""
    return any(worker_id in g.members and g.heal_donor is None for g in core.recent_groups)


@pytest.mark.parametrize("protocol", ["ripples-smart", "adpsgd", "a2cid2"])
def test_a_killed_worker_is_replaced_and_the_replacement_heals_and_averages(
        protocol: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with running_coordinator(protocol=protocol, num_workers=3, task="digits",
                             iterations=UNBOUNDED_ITERATIONS, lease_seconds=2.0,
                             seed=1) as server:
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
            # Healed, the replacement trains on and averages in the policy's groups.
            wait_for(lambda: joiner.progress.iteration > start_iteration
                     and _averaged_in_a_group(core, joiner.worker_id),
                     "the replacement to train and average in a group")
            CoordinatorClient(address).stop_run("the replacement healed and averaged")
            outputs = finish([workers[0], workers[2], replacement], DEADLINE_SECONDS)
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
        for p, out in zip([workers[0], workers[2], replacement], outputs, strict=True):
            assert p.returncode == 0, out[-3000:]
        assert core.stopped and "the replacement healed and averaged" in core.stop_reason
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
                             task="digits", iterations=UNBOUNDED_ITERATIONS,
                             lease_seconds=4.0, seed=1) as server:
        core = server.service.core  # type: ignore[union-attr]
        workers: list[subprocess.Popen[str]] = []
        try:
            start_three_then_a_fourth(server.address, core, workers, trained=100)
            wait_for(lambda: any(w.host == "node3" and w.healed
                                  for w in core.workers.values()), "the joiner to heal")
            joiner = next(w for w in core.workers.values() if w.host == "node3")
            assert joiner.rank == 3 and core.registry.size == 4
            wait_for(lambda: _averaged_in_a_group(core, joiner.worker_id),
                     "the joiner to average in a group")
            CoordinatorClient(server.address).stop_run("the joiner healed and averaged")
            outputs = finish(workers, DEADLINE_SECONDS)
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
        for p, out in zip(workers, outputs, strict=True):
            assert p.returncode == 0, out[-3000:]
        assert core.stopped and "the joiner healed and averaged" in core.stop_reason
        assert "healed from worker" in outputs[3], outputs[3][-3000:]
