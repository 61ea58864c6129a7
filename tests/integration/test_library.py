"""Library mode end to end: user scripts written against `import ripples`, launched by
`ripples run -- python script.py`, by `ripples worker run --nproc-per-node K`, by
torchrun, or run alone; real worker processes on gloo, a real coordinator."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, ripples_cli, running_coordinator
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient

pytestmark = pytest.mark.slow

EXAMPLE = str(REPO / "examples" / "ripples_digits.py")
PROBE = str(REPO / "tests" / "integration" / "scripts" / "probe_train.py")
LIBRARY_PROTOCOLS = ["allreduce", "ripples-random", "ripples-smart", "ripples-static",
                     "adpsgd", "a2cid2", "hop"]
TARGET_LOSS = 0.25
TRAINED_ACCURACY = 0.85
"""Held-out accuracy of a model trained to TARGET_LOSS (0.1 by chance): about 0.9-0.95
measured, and a worker's own model of an asynchronous run, saved at the stop, lags its
peers' by some steps (0.8999 seen under load)."""


def _accuracy(state_dict: dict[str, torch.Tensor]) -> float:
    """The example's model, loaded with `state_dict`, on the held-out fifth of digits."""
    data = load_digits()
    _, test_x, _, test_y = train_test_split(data.data / 16.0, data.target, test_size=0.2,
                                            random_state=0, stratify=data.target)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model.load_state_dict(state_dict)
    with torch.no_grad():
        predicted = model(torch.tensor(test_x, dtype=torch.float32)).argmax(dim=1)
    return float((predicted == torch.tensor(test_y)).float().mean())


def _clean_env() -> dict[str, str]:
    """This environment without any launcher's variables (single-process mode)."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RIPPLES_", "SLURM_", "PET_")) and k not in launch}


@pytest.mark.parametrize("protocol", LIBRARY_PROTOCOLS)
def test_every_library_protocol_trains_a_user_script_to_the_target(protocol: str,
                                                                   tmp_path: Path) -> None:
    """The migration example, unchanged, under each protocol, with its DDP habits: a seed
    per rank, accumulation through `require_backward_grad_sync`, rank 0 evaluating and
    saving a checkpoint. The run stops at the target loss; DIR/model.pt, the average of
    the workers' final models, classifies digits; rank 0's checkpoint holds its model and
    optimizer."""
    script = ["python", EXAMPLE, "--epochs", "30", "--accumulate", "2",
              "--save", str(tmp_path / "ckpt.pt")]
    proc = ripples_cli("run", "--workers", "4", "--workers-per-node", "2", "--protocol",
                       protocol, "--target-loss", str(TARGET_LOSS), "--seed", "1",
                       "--output", str(tmp_path), "--quiet", "--", *script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"].startswith("target loss"), summary["stop_reason"]
    assert summary["script"] == script
    assert "ranks 1, 2, 3 built a model whose initial values differ" in proc.stderr
    checkpoint = torch.load(tmp_path / "ckpt.pt")
    assert _accuracy(checkpoint["model"]) >= TRAINED_ACCURACY
    assert checkpoint["optimizer"]["state"]
    assert summary["samples_per_second"] > 0  # the script reports its batch sizes
    assert all(w["iterations"] > 0 for w in summary["workers"])
    # A script's model is not evaluated: its result is the workers' training loss.
    assert summary["final_loss"] is None and summary["final_train_loss"] <= TARGET_LOSS + 0.05
    assert _accuracy(torch.load(tmp_path / "model.pt")) >= TRAINED_ACCURACY
    # --quiet: after the script's own output (rank 0's epoch lines), four lines; the
    # summary is in its file.
    lines = proc.stdout.splitlines()[-4:]
    assert lines[0].startswith(f"{protocol}, 4 workers: target loss"), proc.stdout
    assert "final training loss" in lines[1] and str(tmp_path / "summary.json") in lines[3]
    assert "NaN" not in proc.stdout and "loss_curve" not in proc.stdout


def test_the_same_script_runs_alone_without_a_coordinator(tmp_path: Path) -> None:
    out = tmp_path / "alone.pt"
    proc = subprocess.run([sys.executable, EXAMPLE, "--epochs", "4", "--save", str(out)],
                          capture_output=True, text=True, timeout=240, env=_clean_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 3:" in proc.stdout
    assert _accuracy(torch.load(out)["model"]) >= 0.9  # one process, deterministic


def test_a_worker_whose_loss_turns_nan_fails_and_no_peer_holds_a_non_finite_value(
        tmp_path: Path) -> None:
    proc = ripples_cli("run", "--workers", "3", "--protocol", "ripples-smart",
                       "--group-size", "3", "--output", str(tmp_path), "--quiet", "--",
                       "python", PROBE, "--steps", "60", "--nan-rank", "1", "--nan-at", "20")
    assert proc.returncode == 1
    assert "FloatingPointError" in proc.stderr and "nothing was sent to any peer" in proc.stderr
    assert "worker rank 1" in proc.stderr
    for rank in (0, 2):  # the others trained on and saved finite models
        state = torch.load(tmp_path / "workers" / f"rank{rank}.pt")
        assert all(torch.isfinite(t).all() for t in state.values())
    assert not (tmp_path / "workers" / "rank1.pt").exists()


def test_skipping_non_finite_steps_keeps_training(tmp_path: Path) -> None:
    record = str(tmp_path / "rank{rank}.json")
    proc = ripples_cli("run", "--workers", "2", "--protocol", "allreduce", "--output",
                       str(tmp_path), "--quiet", "--", "python", PROBE, "--steps", "30",
                       "--nan-rank", "1", "--nan-at", "10", "--skip-nonfinite",
                       "--record", record)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # allreduce averages the gradients, so both workers see the NaN and both skip the
    # step: their models stay identical and finite.
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["skipped"] for s in seen] == [1, 1]
    states = [torch.load(tmp_path / "workers" / f"rank{r}.pt") for r in (0, 1)]
    for name in states[0]:
        assert torch.isfinite(states[0][name]).all()
        assert torch.equal(states[0][name], states[1][name])


@pytest.mark.parametrize("protocol", ["ripples-smart", "ripples-static"])
def test_a_worker_whose_first_steps_are_skipped_averages_its_optimizer_state_later(
        protocol: str, tmp_path: Path) -> None:
    """Rank 0 skips its first steps (as GradScaler does), so its momentum appears steps
    after the others': no group may join its smaller buffer with theirs (gloo aborts the
    process on mismatched sizes). Groups form among equal buffers only (smart), or every
    worker adds its momentum after one agreed iteration (static)."""
    record = str(tmp_path / "rank{rank}.json")
    proc = ripples_cli("run", "--workers", "4", "--workers-per-node", "2", "--protocol",
                       protocol, "--checkpoint-interval", "2", "--output", str(tmp_path),
                       "--quiet", "--", "python", PROBE, "--steps", "60", "--nan-rank", "0",
                       "--nan-at", "1", "--nan-steps", "5", "--skip-nonfinite",
                       "--record", record)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [s["skipped"] for s in seen] == [5, 0, 0, 0]
    # Every worker trained (from about 2.3): its loss over the whole dataset is under 1.0.
    # Batch losses were too noisy to judge by: a CI run saw rank 0's last 10 batches
    # average 1.03, its peers' 0.75 to 0.90; the whole dataset's loss was 0.73-0.83 here.
    losses = [(s["initial_loss"], s["final_loss"]) for s in seen]
    assert all(final < 1.0 for _, final in losses), losses


def test_any_exception_marks_the_worker_failed_with_its_error(tmp_path: Path) -> None:
    proc = ripples_cli("run", "--workers", "3", "--protocol", "ripples-random",
                       "--group-size", "2", "--output", str(tmp_path), "--quiet", "--",
                       "python", PROBE, "--steps", "60", "--raise-rank", "2", "--raise-at", "5")
    assert proc.returncode == 1
    assert "KeyError: \"the probe's deliberate failure\"" in proc.stderr
    assert "worker rank 2" in proc.stderr


@pytest.mark.parametrize("protocol", ["ripples-smart", "adpsgd", "allreduce", "hop"])
def test_a_script_seeding_per_rank_starts_every_worker_from_rank_0s_model_and_every_loop_ends(
        protocol: str, tmp_path: Path) -> None:
    """The DDP habit: `torch.manual_seed(1337 + rank)` before building the model (DDP
    broadcasts rank 0's). Every worker starts from rank 0's model, bit for bit, the run
    says so; rank 0, slower (it evaluates), still runs its loop to the end with the
    default min_workers, and the run ends when the last loop has. One protocol per way
    of coordinating (groups, gossip, lock-step, peer to peer): the start's copy is one
    code path for all (the migration example shows every protocol's start log)."""
    record = str(tmp_path / "rank{rank}.json")
    proc = ripples_cli("run", "--workers", "4", "--workers-per-node", "2", "--protocol",
                       protocol, "--output", str(tmp_path / "run"), "--", "python", PROBE,
                       "--steps", "40", "--seed-per-rank", "--slow-rank", "0",
                       "--slow-seconds", "0.05", "--record", record, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert len({r["built_sum"] for r in runs}) == 4  # the script built four models
    assert len({r["start_sum"] for r in runs}) == 1  # and trained one
    assert runs[0]["start_sum"] == runs[0]["built_sum"]  # rank 0's
    assert "ranks 1, 2, 3 built a model whose initial values differ from rank 0's" \
        in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    if protocol == "hop":  # its workers wait on their neighbours: the first end ends all
        assert "(hop's workers end together: each waits for its peers)" \
            in summary["stop_reason"]
        return
    assert [r["steps"] for r in runs] == [40] * 4
    assert [w["iterations"] for w in summary["workers"]] == [40] * 4
    lockstep = protocol in ("allreduce", "ripples-static")
    assert summary["stop_reason"].endswith(
        "end together: each waits for its peers)" if lockstep
        else "ended after 40 steps, the last)"), summary


def test_a_worker_with_another_model_is_refused_naming_the_first_difference(
        tmp_path: Path) -> None:
    proc = ripples_cli("run", "--workers", "2", "--protocol", "ripples-smart", "--output",
                       str(tmp_path), "--quiet", "--", "python", PROBE, "--wider-on-rank", "1")
    assert proc.returncode == 1
    assert "averages other tensors" in proc.stderr
    assert "'param:0.weight' float32 [96, 64]" in proc.stderr
    assert "'param:0.weight' float32 [64, 64]" in proc.stderr


@pytest.mark.parametrize("protocol", ["allreduce", "ripples-static"])
def test_batchnorm_statistics_are_averaged(protocol: str, tmp_path: Path) -> None:
    """Two workers that average everything each step (allreduce: gradients and buffers;
    the static schedule on one node of two: the whole state) end with one model,
    BatchNorm's running statistics included."""
    proc = ripples_cli("run", "--workers", "2", "--workers-per-node", "2", "--protocol",
                       protocol, "--output", str(tmp_path), "--quiet", "--", "python", PROBE,
                       "--steps", "20", "--batchnorm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = [torch.load(tmp_path / "workers" / f"rank{r}.pt") for r in (0, 1)]
    assert "1.running_mean" in states[0]
    for name in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(states[0][name], states[1][name])
    assert not torch.equal(states[0]["1.running_var"], torch.ones(64))  # they did update


def test_gradient_accumulation_and_a_loader_with_worker_processes(tmp_path: Path) -> None:
    record = str(tmp_path / "rank{rank}.json")
    proc = ripples_cli("run", "--workers", "2", "--protocol", "allreduce", "--output",
                       str(tmp_path), "--quiet", "--", "python", PROBE, "--steps", "12",
                       "--accumulate", "3", "--loader-workers", "2", "--record", record)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [w["iterations"] for w in summary["workers"]] == [12, 12]  # one sync per 3 batches
    states = [torch.load(tmp_path / "workers" / f"rank{r}.pt") for r in (0, 1)]
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name])


def test_the_schedule_follows_the_runs_global_step_on_a_slow_worker(tmp_path: Path) -> None:
    record = str(tmp_path / "rank{rank}.json")
    proc = ripples_cli("run", "--workers", "3", "--protocol", "ripples-smart",
                       "--group-size", "2", "--slowdown", "2:6", "--output", str(tmp_path),
                       "--quiet", "--", "python", PROBE, "--steps", "150", "--record", record)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text())["seen"] for r in range(3)}
    assert [len(seen[r]) for r in range(3)] == [150] * 3  # the straggler's loop ends too
    slow = seen[2][74]
    # Halfway, the straggler had made fewer steps than the run's average worker: its
    # schedule follows the run (global_step), not its own count, and its learning rate
    # decayed accordingly.
    # (1.7x-1.9x on an idle machine; global_step comes with heartbeats, which lag under
    # load: 1.4x once in a full test run.)
    assert slow["global_step"] > slow["step"] * 1.25, slow
    assert slow["lr"] == pytest.approx(0.05 / (1 + slow["global_step"] / 50), rel=0.05)
    fast = seen[0][-1]
    assert fast["global_step"] <= fast["step"]


def test_a_protocol_that_needs_the_runner_is_refused_for_scripts() -> None:
    proc = ripples_cli("run", "--workers", "2", "--protocol", "lpp-sgd", "--", "python", PROBE,
                       timeout=60)
    assert proc.returncode == 2
    assert "needs a built-in task" in proc.stderr


@pytest.mark.parametrize("args", [["--task", "digits"], ["--epochs", "3"]])
def test_a_script_run_refuses_task_options(args: list[str]) -> None:
    proc = ripples_cli("run", "--workers", "2", *args, "--", "python", PROBE, timeout=60)
    assert proc.returncode == 2 and "ripples run: error" in proc.stderr


def test_torchrun_with_the_coordinator_in_the_environment() -> None:
    """Plain torchrun starts the script; RIPPLES_COORDINATOR makes it a Ripples run."""
    with running_coordinator(num_workers=2, protocol="ripples-smart", group_size=2,
                             iterations=40) as server:
        env = {**_clean_env(), "RIPPLES_COORDINATOR": server.address,
               "RIPPLES_METRICS_BIND": "127.0.0.1"}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", "0", EXAMPLE, "--epochs", "50"],
            capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        status = CoordinatorClient(server.address).run_status()
    assert status.stopped and status.stop_reason.startswith("iteration budget")
    assert [w.state for w in status.workers] == [pb.WORKER_STATE_LEFT] * 2
    assert sorted(w.local_rank for w in status.workers) == [0, 1]


def test_a_host_daemon_starts_its_workers_with_nproc_per_node(tmp_path: Path) -> None:
    with running_coordinator(num_workers=2, protocol="adpsgd", iterations=30) as server:
        proc = ripples_cli("worker", "run", "--coordinator", server.address,
                           "--nproc-per-node", "2", "--metrics-bind", "127.0.0.1", "--quiet",
                           "--save-model", str(tmp_path / "model.pt"), "--",
                           "python", EXAMPLE, "--epochs", "50", env=_clean_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        status = CoordinatorClient(server.address).run_status()
    assert status.stop_reason.startswith("iteration budget")
    assert sorted(w.local_rank for w in status.workers) == [0, 1]
    for local_rank in (0, 1):  # each process saved its own model
        state = torch.load(tmp_path / f"model.{local_rank}.pt")
        assert all(math.isfinite(float(t.abs().max())) for t in state.values())


def test_the_ddp_example_it_migrates_from_runs_under_torchrun() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(REPO / "examples" / "ddp_digits.py"), "--epochs", "2"],
        capture_output=True, text=True, timeout=240, env=_clean_env(), cwd=REPO)
    assert "epoch 1:" in proc.stdout, proc.stderr[-3000:]  # it trained to its end
    if proc.returncode != 0:
        # Plain torch, no Ripples code: with gloo, a rank sometimes aborts while the
        # process exits, after training and destroy_process_group (std::terminate in a
        # gloo thread at interpreter shutdown; pytorch/pytorch#179291 discusses the
        # teardown). Measured here under load: 2 of 22 runs; a barrier before
        # destroy_process_group (1 of 16) or deleting the DDP model first (1 of 22)
        # did not stop it. That abort, and nothing else, is accepted.
        assert ("terminate called without an active exception" in proc.stderr
                and "exitcode: -6" in proc.stderr), proc.stderr[-3000:]


LM = str(REPO / "examples" / "transformer_lm.py")
SMALL_LM = ["--steps", "40", "--d-model", "64", "--layers", "2", "--heads", "2",
            "--block-size", "64", "--batch-size", "8", "--warmup", "5", "--log-every", "20"]


def test_the_language_model_example_trains_alone_and_on_a_cluster(tmp_path: Path) -> None:
    """AdamW, warm-up + cosine on the global step, clipping and bf16 autocast on CPU, with
    its data streamed from the standard library's source files."""
    alone = subprocess.run([sys.executable, LM, *SMALL_LM], capture_output=True, text=True,
                           timeout=300, env=_clean_env(), cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in alone.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 2 and losses[-1] < math.log(256)  # below a uniform guess
    proc = ripples_cli("run", "--workers", "2", "--protocol", "ripples-smart", "--output",
                       str(tmp_path / "run"), "--quiet", "--", "python", LM, *SMALL_LM,
                       timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # The first worker to finish its 40 planned steps leaves, done: the other trains on
    # to the end of its own loop, which ends the run (its budget: both planned steps).
    assert [w["iterations"] for w in summary["workers"]] == [40, 40]
    assert summary["stop_reason"] == "iteration budget reached (80 iterations)"
    assert summary["final_train_loss"] < math.log(256)
    assert (tmp_path / "run" / "model.pt").exists()


@pytest.mark.parametrize("protocol", ["allreduce", "ripples-static"])
def test_a_signal_to_one_lockstep_worker_stops_every_worker_at_the_same_step(
        protocol: str, tmp_path: Path) -> None:
    """In lock-step protocols a worker that stopped alone would leave its peers inside a
    collective: SIGTERM to one asks the coordinator to stop the run, and all stop together,
    cleanly, at one agreed step; steps after the stop stay local."""
    record = str(tmp_path / "rank{rank}.json")
    with running_coordinator(num_workers=4, workers_per_node=2, protocol=protocol,
                             checkpoint_interval=5, collective_timeout_seconds=20) as server:
        client = CoordinatorClient(server.address)
        procs = [subprocess.Popen(
            [sys.executable, PROBE, "--steps", "100000", "--record", record,
             "--steps-after-stop", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**_clean_env(), "RIPPLES_COORDINATOR": server.address,
                 "RIPPLES_HOST": f"host{i // 2}", "LOCAL_RANK": str(i % 2),
                 "RIPPLES_METRICS_BIND": "127.0.0.1", "RIPPLES_NUM_THREADS": "1"})
            for i in range(4)]
        try:
            deadline = time.monotonic() + 120
            while min((w.iteration for w in client.run_status().workers), default=0) < 10:
                assert time.monotonic() < deadline, "the workers did not start training"
                assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
                time.sleep(0.2)
            procs[1].send_signal(signal.SIGTERM)
            outs = [p.communicate(timeout=90)[0] for p in procs]
            assert [p.returncode for p in procs] == [0] * 4, [o[-2000:] for o in outs]
            status = client.run_status()
        finally:
            client.close()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert "was asked to stop" in status.stop_reason
    assert [w.state for w in status.workers] == [pb.WORKER_STATE_LEFT] * 4
    assert not any(w.error for w in status.workers)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    last_steps = {rec["seen"][-1]["step"] for rec in records}
    assert len(last_steps) == 1, last_steps
    assert all("was asked to stop" in rec["stop_reason"] for rec in records)


def test_sigterm_to_ripples_run_stops_every_worker_cleanly(tmp_path: Path) -> None:
    """SIGTERM (as from a scheduler) stops a local run as Ctrl-C does: the lock-step
    workers stop together, save their models, and the run writes its summary."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ripples.cli", "run", "--workers", "3", "--protocol",
         "allreduce", "--output", str(tmp_path), "--", "python", PROBE, "--steps", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=_clean_env())
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # progress lines, once a second
            if "loss " in line and "iterations [" in line:
                break
        else:
            pytest.fail(f"the run printed no progress; exit code {proc.wait()}")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted by the user"
    assert (tmp_path / "model.pt").exists()
