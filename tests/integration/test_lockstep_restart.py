"""Lock-step runs (allreduce) survive a member's death with a restart round, as
torchelastic does: a worker of a running 3-worker run is SIGKILLed; the survivors'
processes restart in place (same pid: `ripples worker run` execs itself), register anew,
restore the last checkpoint every rank holds, and go on, with a replacement (back to 3
workers) or without one (2 workers after the join window). The run trains on until it
is stopped, no survivor's process ends before the run, and at most one checkpoint
interval is lost. The runs' budgets are beyond reach: each ends when the test has seen
training go on after the restart (a stop), never by a budget a loaded machine might
spend before the fault."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import (
    UNBOUNDED_ITERATIONS,
    explained_on_failure,
    finish,
    running_coordinator,
    start_worker,
    wait_for,
)

pytestmark = pytest.mark.slow

DEADLINE_SECONDS = 240
SCRIPTS = Path(__file__).parent / "scripts"
CHECKPOINT_EVERY = 40


def _stop_once_trained_on(core, address: str, reason: str) -> None:  # type: ignore[no-untyped-def]
    """Once every live worker has trained some steps past where it stands now (after a
    restart round), stop the run."""
    resumed = min(w.progress.iteration for w in core.live())
    wait_for(lambda: min(w.progress.iteration for w in core.live()) > resumed + 10,
             "training to go on after the restart")
    CoordinatorClient(address).stop_run(reason)




def _worker(address: str, host: str, tmp_path: Path) -> subprocess.Popen[str]:
    return start_worker(address, "--host", host, "--metrics-port", "-1",
                        "--checkpoint-dir", str(tmp_path / "checkpoints"),
                        "--checkpoint-every", str(CHECKPOINT_EVERY),
                        "--save-model", str(tmp_path / f"{host}.pt"))


@pytest.mark.parametrize("replace", [True, False], ids=["replaced", "shrunk"])
def test_a_killed_allreduce_worker_restarts_the_run_from_the_last_checkpoint(
        replace: bool, tmp_path: Path) -> None:
    with running_coordinator(protocol="allreduce", num_workers=3, min_workers=2,
                             task="digits", iterations=UNBOUNDED_ITERATIONS,
                             lease_seconds=2.0, seed=1, join_window_seconds=4.0) as server:
        core = server.service.core  # type: ignore[union-attr]
        address = server.address
        workers = [_worker(address, f"node{r}", tmp_path) for r in range(3)]
        with explained_on_failure(workers, core):
            wait_for(lambda: core.started_at is not None
                      and min(w.progress.iteration for w in core.live()) > 2 * CHECKPOINT_EVERY,
                      "two checkpoints")
            at_kill = max(w.progress.iteration for w in core.live())
            workers[1].send_signal(signal.SIGKILL)
            workers[1].wait(10)
            killed_at = time.monotonic()
            if replace:
                workers.append(_worker(address, "node1b", tmp_path))
            wait_for(lambda: core.restarts >= 1, "a restart round")
            # The replacement joins the first round, or (when it started after the join
            # window) opens a second one: either way the run is back to 3 workers.
            size = 3 if replace else 2
            wait_for(lambda: core.registry.generation >= 1 and core.started_at is not None
                      and core.registry.size == size,
                      f"training to go on with {size} workers")
            resumed_after = time.monotonic() - killed_at
            survivors = [workers[0], workers[2]]
            assert all(p.poll() is None for p in survivors)  # restarted in place, same pid
            if not replace:
                # The killed host comes back later: a round grows the run to 3 again.
                # Ranks are dealt anew (node2 held rank 1 of 2, takes rank 2 again), and
                # rank-2's directory is stale (the steps before the shrink): every rank
                # restores the run's newest step all the same.
                shrunk_at = max(w.progress.iteration for w in core.live())
                wait_for(lambda: min(w.progress.iteration for w in core.live())
                          > shrunk_at + CHECKPOINT_EVERY, "a checkpoint of the 2 workers")
                workers.append(_worker(address, "node1", tmp_path))
                wait_for(lambda: core.restarts >= 2 and core.started_at is not None
                          and core.registry.size == 3, "the run to grow back to 3")
            _stop_once_trained_on(core, address, "trained on after the restart")
            outputs = finish([p for i, p in enumerate(workers) if i != 1], DEADLINE_SECONDS)
        log = "\n".join(outputs)
        assert all(p.returncode == 0 for i, p in enumerate(workers) if i != 1), log[-4000:]
        assert core.stopped and "trained on after the restart" in core.stop_reason
        restored = [int(s) for s in re.findall(r"restored step (\d+)", log)]
        assert restored, log[-4000:]
        print(f"\n{'replaced' if replace else 'shrunk, then grown back'}: training went on "
              f"{resumed_after:.1f} s after the kill with {size} workers, "
              f"{core.restarts} restart round(s); iteration {at_kill} at the kill, "
              f"step {min(restored)} restored")
        # At most one checkpoint interval lost (and the steps since the kill's report).
        assert min(restored) >= at_kill - 2 * CHECKPOINT_EVERY
        if not replace:  # the stale rank-2 directory got the newest step from a peer
            assert "took the checkpoint of step" in log
        models = [torch.load(tmp_path / f"{h}.pt") for h in
                  ["node0", "node2", "node1b" if replace else "node1"]]
        for model in models[1:]:  # lock-step: every worker ends with the same model
            for name, tensor in model.items():
                assert torch.allclose(tensor, models[0][name], atol=1e-5), name


@pytest.mark.parametrize(("protocol", "settings", "fault"), [
    ("ripples-static", {"workers_per_node": 2}, signal.SIGKILL),
    ("hop", {"topology": "ring"}, signal.SIGKILL),
    ("hop", {"topology": "ring"}, signal.SIGTERM),
], ids=["static", "hop", "hop-sigterm"])
def test_a_run_restarts_with_a_replacement_on_the_same_host(
        protocol: str, settings: dict[str, object], fault: signal.Signals,
        tmp_path: Path) -> None:
    """ripples-static on 2 hosts of 2 workers (the round waits for the killed worker's
    replacement on its host: the schedule needs full hosts), and hop on a ring of 4 (its
    queues and tokens start afresh at the restored step), its worker killed or asked to
    leave (SIGTERM: a graceful leave, which opens a round without it): every worker goes
    on from the last checkpoint and trains on until the run is stopped."""
    def worker(address: str, host: str, local_rank: int) -> subprocess.Popen[str]:
        return start_worker(address, "--host", host, "--local-rank", str(local_rank),
                            "--metrics-port", "-1",
                            "--checkpoint-dir", str(tmp_path / "checkpoints"),
                            "--checkpoint-every", str(CHECKPOINT_EVERY))

    with running_coordinator(protocol=protocol, num_workers=4, task="digits",
                             iterations=UNBOUNDED_ITERATIONS, lease_seconds=2.0, seed=1,
                             join_window_seconds=4.0, **settings) as server:
        core = server.service.core  # type: ignore[union-attr]
        workers = [worker(server.address, f"node{i // 2}", i % 2) for i in range(4)]
        with explained_on_failure(workers, core):
            wait_for(lambda: core.started_at is not None
                      and min(w.progress.iteration for w in core.live()) > 2 * CHECKPOINT_EVERY,
                      "two checkpoints")
            workers[3].send_signal(fault)
            assert workers[3].wait(30) == (0 if fault == signal.SIGTERM else -signal.SIGKILL)
            workers.append(worker(server.address, "node1", 1))
            wait_for(lambda: core.restarts >= 1 and core.registry.generation >= 1
                      and core.started_at is not None and core.registry.size == 4,
                      "training to go on with 4 workers")
            _stop_once_trained_on(core, server.address, "trained on after the restart")
            outputs = finish([p for i, p in enumerate(workers) if i != 3], DEADLINE_SECONDS)
        log = "\n".join(outputs)
        assert all(p.returncode == 0 for i, p in enumerate(workers) if i != 3), log[-4000:]
        assert core.stopped and "trained on after the restart" in core.stop_reason
        assert re.search(r"restored step \d+", log), log[-4000:]


@pytest.mark.parametrize("script_name", ["checkpointed_train.py", "own_format_train.py"],
                         ids=["ripples-state", "own-format"])
def test_a_users_script_restarts_under_its_launcher(script_name: str, tmp_path: Path) -> None:
    """`ripples worker run -- python train.py` with a script that restores a
    ripples.Checkpointer (of Ripples' own state with a sampler and a scheduler, or of
    the script's own format through its state_dict/load_state_dict callables, with
    neither): the killed host's script dies; the survivors' scripts exit 75, their
    launchers start them again, and with a replacement host the run completes."""
    script = ["--", sys.executable, str(SCRIPTS / script_name), "--steps", "500",
              "--save", str(tmp_path / "final-{rank}.pt")]

    def host(address: str, name: str) -> subprocess.Popen[str]:
        return start_worker(address, "--host", name, "--metrics-port", "-1",
                            "--checkpoint-dir", str(tmp_path / "checkpoints"),
                            "--checkpoint-every", str(CHECKPOINT_EVERY), *script)

    with running_coordinator(protocol="allreduce", num_workers=3, lease_seconds=2.0,
                             task="", seed=1, join_window_seconds=4.0) as server:
        core = server.service.core  # type: ignore[union-attr]
        hosts = [host(server.address, f"node{r}") for r in range(3)]
        with explained_on_failure(hosts, core, label="host", tail=2500):
            wait_for(lambda: core.started_at is not None
                     and min(w.progress.iteration for w in core.live()) > 2 * CHECKPOINT_EVERY,
                     "two checkpoints")
            # The host dies: its script (a process group of its own) and its launcher.
            children = Path(f"/proc/{hosts[1].pid}/task/{hosts[1].pid}/children")
            for pid in children.read_text().split():
                os.kill(int(pid), signal.SIGKILL)
            hosts[1].send_signal(signal.SIGKILL)
            hosts[1].wait(10)
            hosts.append(host(server.address, "node1b"))
            wait_for(lambda: core.restarts >= 1 and core.started_at is not None
                     and core.registry.size == 3, "training to go on with 3 workers")
            outputs = finish([p for i, p in enumerate(hosts) if i != 1], DEADLINE_SECONDS)
        log = "\n".join(outputs)
        codes = [p.returncode for i, p in enumerate(hosts) if i != 1]
        assert codes == [0, 0, 0], f"{codes}\n{log[-6000:]}"
        assert "restarts (restart 1)" in log  # the launchers started the scripts again
        assert re.search(r"rank \d restored step [1-9]\d*", log), log[-4000:]
        assert core.stopped and "iteration budget reached" in core.stop_reason
        finals = [torch.load(p) for p in sorted(tmp_path.glob("final-*.pt"))]
        assert len(finals) == 3
        for final in finals[1:]:  # lock-step: every worker ends with the same model
            for name, tensor in final.items():
                assert torch.allclose(tensor, finals[0][name], atol=1e-5), name
        if script_name == "own_format_train.py":
            # Every survivor and the replacement got the script's own state back, of the
            # step the checkpoint was taken at, through its load_state_dict.
            restored = re.findall(r"rank \d restored step ([1-9]\d*) \(its own state says "
                                  r"\[(\d+)\]\)", log)
            assert len(restored) >= 3 and all(a == b for a, b in restored), log[-4000:]
            saved = torch.load(next((tmp_path / "checkpoints").glob("rank-*/step-*.pt")),
                               weights_only=False)
            assert saved["script_state"]["format"] == "own-v1"
            assert "model" not in saved and "rng" not in saved


@pytest.mark.parametrize("protocol", ["lap-sgd", "lpp-sgd"])
def test_an_lpp_run_averaging_over_all_workers_restarts_from_its_round_checkpoints(
        protocol: str, tmp_path: Path) -> None:
    """lap-sgd/lpp-sgd averaging over all workers (lock-step rounds), 3 workers x 2
    updaters: a worker is SIGKILLed (its updaters see themselves orphaned and end); the
    survivors restart in place with a replacement and every worker restores the newest
    round all of them saved (the counter and the updaters' counts go on from it); the
    run trains on until it is stopped and no updater process outlives its worker."""
    every = 400
    with running_coordinator(protocol=protocol, num_workers=3, task="digits",
                             iterations=UNBOUNDED_ITERATIONS, lease_seconds=2.0, seed=1,
                             updaters=2,
                             join_window_seconds=4.0) as server:
        core = server.service.core  # type: ignore[union-attr]
        workers = [start_worker(server.address, "--host", f"node{r}", "--metrics-port", "-1",
                                "--checkpoint-dir", str(tmp_path / "checkpoints"),
                                "--checkpoint-every", str(every),
                                "--save-model", str(tmp_path / f"node{r}.pt"))
                   for r in range(3)]
        with explained_on_failure(workers, core):
            wait_for(lambda: core.started_at is not None
                     and min(w.progress.checkpoint_step for w in core.live()) > 0,
                     "a round checkpoint on every worker")
            at_kill = max(w.progress.iteration for w in core.live())
            updaters = Path(f"/proc/{workers[1].pid}/task/{workers[1].pid}/children")
            orphans = [int(pid) for pid in updaters.read_text().split()]
            workers[1].send_signal(signal.SIGKILL)
            workers[1].wait(10)
            killed_at = time.monotonic()
            workers.append(start_worker(server.address, "--host", "node1b", "--metrics-port",
                                        "-1", "--checkpoint-dir", str(tmp_path / "checkpoints"),
                                        "--checkpoint-every", str(every),
                                        "--save-model", str(tmp_path / "node1b.pt")))
            wait_for(lambda: core.restarts >= 1 and core.registry.generation >= 1
                     and core.started_at is not None and core.registry.size == 3,
                     "training to go on with 3 workers")
            resumed_after = time.monotonic() - killed_at
            wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in orphans),
                     "the killed worker's updaters to end", timeout=10)
            _stop_once_trained_on(core, server.address, "trained on after the restart")
            outputs = finish([p for i, p in enumerate(workers) if i != 1], DEADLINE_SECONDS)
        log = "\n".join(outputs)
        assert all(p.returncode == 0 for i, p in enumerate(workers) if i != 1), log[-4000:]
        assert core.stopped and "trained on after the restart" in core.stop_reason
        restored = [int(n) for n in re.findall(r"restored round \d+ \((\d+) updates\)", log)]
        assert len(restored) >= 3, log[-4000:]  # every member of the round restored
        print(f"\n{protocol}: training went on {resumed_after:.1f} s after the kill; "
              f"{at_kill} updates at the kill, {min(restored)}-{max(restored)} restored")
        for name in ["node0", "node2", "node1b"]:
            model = torch.load(tmp_path / f"{name}.pt")
            assert all(torch.isfinite(t).all() for t in model.values()), name
