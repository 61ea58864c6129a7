"""Workers of several ranks (`ripples run --ranks-per-worker G`): FSDP2-sharded models,
averaged shard by shard. Real worker processes (4: two workers of two ranks) on gloo, a
real coordinator; the test replays the run with two unsharded models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    UNBOUNDED_ITERATIONS,
    finish,
    free_port,
    ripples_cli,
    running_coordinator,
    wait_for,
)

from ripples.worker.client import CoordinatorClient

SCRIPTS = REPO / "tests" / "integration" / "scripts"
SCRIPT = str(SCRIPTS / "sharded_train.py")
sys.path.insert(0, str(SCRIPTS))
import sharded_train  # noqa: E402 (the script's model and batches, for the replay)

ATOL = 1e-5
"""Float tolerance of a sharded step against the unsharded one (the gradient is the mean
of the ranks' half-batch means, summed in another order): about 1e-7 measured."""

State = dict[str, torch.Tensor]


def _local_step(state: State, worker: int, step: int, momentum: float = 0.0,
                buffers: State | None = None) -> tuple[State, State]:
    """One unsharded worker's SGD step from `state` (and its momentum `buffers`, None
    before the first step) on its batch of `step`: the model and the buffers after it."""
    model = sharded_train.build_model()
    model.load_state_dict(state)
    x, y = sharded_train.batch(worker, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    after: State = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert p.grad is not None
            grad = p.grad
            if momentum:
                grad = grad.clone() if buffers is None else momentum * buffers[name] + grad
                after[name] = grad
            p -= sharded_train.LR * grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, after


def _close(a: State, b: State) -> bool:
    return all(torch.allclose(a[k], b[k], atol=ATOL, rtol=0) for k in a)


def _replay(traces: dict[int, list[State]], momentum: float = 0.0,
            buffers: dict[int, list[State]] | None = None) -> int:
    """Check every step of both workers against two unsharded workers given the same
    batches: each recorded model is its worker's local step, or the average of that step
    and the other worker's step whose recorded model is the same (the two members of a
    group leave it with one model); with momentum, the recorded momentum buffers are the
    local step's or that same average of the two (the optimizer state averaged with the
    model). Returns the number of groups seen."""
    start = {k: v.detach().clone() for k, v in sharded_train.build_model().state_dict().items()}
    recorded_buffers = buffers or {w: [{}] * len(t) for w, t in traces.items()}

    def step_from(worker: int, step: int) -> tuple[State, State]:
        """`worker`'s local step `step` from what it recorded after the step before."""
        before = traces[worker][step - 2] if step > 1 else start
        held = recorded_buffers[worker][step - 2] if step > 1 and momentum else None
        return _local_step(before, worker, step, momentum, held)

    groups = 0
    for worker, trace in traces.items():
        other = 1 - worker
        for step, recorded in enumerate(trace, 1):
            local, local_buffers = step_from(worker, step)
            if _close(recorded, local):
                if momentum:
                    assert _close(recorded_buffers[worker][step - 1], local_buffers)
                continue
            partners = [s for s, model in enumerate(traces[other], 1) if _close(model, recorded)]
            assert partners, (f"worker {worker} after step {step}: neither its local step nor "
                              "a model the other worker had")
            partner, partner_buffers = step_from(other, partners[0])
            average = {k: (local[k] + partner[k]) / 2 for k in local}
            assert _close(recorded, average), (
                f"worker {worker} after step {step} averaged with worker {other}'s step "
                f"{partners[0]}, but not to the two unsharded models' average")
            if momentum:
                mean = {k: (local_buffers[k] + partner_buffers[k]) / 2 for k in local_buffers}
                assert _close(recorded_buffers[worker][step - 1], mean), (
                    f"worker {worker} after step {step}: the momentum was not averaged")
            groups += 1
    return groups


@pytest.mark.parametrize("rounds", [[], ["--local-steps", "3"],
                                    ["--local-steps", "2", "--sync-share", "0.05"]],
                         ids=["every-step", "H=3", "sized-rounds"])
def test_two_workers_of_two_ranks_average_shard_by_shard_as_two_unsharded_workers(
        rounds: list[str], tmp_path: Path) -> None:
    steps = 40
    out = tmp_path / "run"
    result = ripples_cli("run", "--workers", "2", "--ranks-per-worker", "2", "--protocol",
                         "ripples-smart", *rounds, "--seed", "1", "--output", str(out),
                         "--quiet", "--", sys.executable, SCRIPT, str(tmp_path), str(steps))
    assert result.returncode == 0, result.stdout + result.stderr
    traces = {w: torch.load(tmp_path / f"worker{w}.pt")["trace"] for w in (0, 1)}
    assert [len(t) for t in traces.values()] == [steps, steps]
    groups = _replay(traces)
    # Sized rounds (rank 0's clock) are at most 8H = 16 steps: two of them in 40 steps.
    assert groups >= 4, f"only {groups} group(s) in {steps} steps of two workers"
    if rounds:  # averaged at the ends of rounds only
        assert groups <= 2 * steps // 3
    # model.pt: the two final models averaged, whole, loading into the unsharded model.
    consensus = torch.load(out / "model.pt")
    sharded_train.build_model().load_state_dict(consensus)
    last = {k: (traces[0][-1][k] + traces[1][-1][k]) / 2 for k in consensus}
    assert _close(consensus, last)


def test_the_optimizer_state_is_averaged_shard_by_shard_with_the_model(tmp_path: Path) -> None:
    """SGD with momentum: each rank's shard of the momentum buffers joins its averaged
    state after the first step, and a group leaves both members the average of their
    buffers, as two unsharded workers averaging their optimizer state."""
    steps, momentum = 30, 0.9
    result = ripples_cli("run", "--workers", "2", "--ranks-per-worker", "2", "--protocol",
                         "ripples-smart", "--seed", "1", "--output", str(tmp_path / "run"),
                         "--quiet", "--", sys.executable, SCRIPT, str(tmp_path), str(steps),
                         env={"SHARDED_TRAIN_MOMENTUM": str(momentum)})
    assert result.returncode == 0, result.stdout + result.stderr
    records = {w: torch.load(tmp_path / f"worker{w}.pt") for w in (0, 1)}
    traces = {w: r["trace"] for w, r in records.items()}
    buffers = {w: r["momentum"] for w, r in records.items()}
    assert _replay(traces, momentum, buffers) >= 4


@pytest.mark.slow
def test_sharded_workers_train_the_example_lm_with_an_outer_optimizer_and_the_int8_wire(
        tmp_path: Path) -> None:
    """examples/transformer_lm.py on two workers of two ranks, with local steps, Nesterov
    outer steps and the int8 wire: the loss falls, and model.pt is the whole model."""
    example = str(REPO / "examples" / "transformer_lm.py")
    small = ["--steps", "60", "--d-model", "64", "--layers", "2", "--warmup", "10"]
    result = ripples_cli("run", "--workers", "2", "--ranks-per-worker", "2", "--protocol",
                         "ripples-smart", "--local-steps", "4", "--outer-optimizer",
                         "nesterov", "--outer-compression", "int8", "--output",
                         str(tmp_path), "--", sys.executable, example, *small, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_train_loss"] < 4.0, summary["final_train_loss"]  # ln 256 = 5.5
    from ripples.examples import transformer_lm

    model = transformer_lm.build_model(transformer_lm.build_parser().parse_args(small))
    model.load_state_dict(torch.load(tmp_path / "model.pt"))


def test_a_worker_sharded_otherwise_is_refused_naming_the_shard(tmp_path: Path) -> None:
    result = ripples_cli("run", "--workers", "2", "--ranks-per-worker", "2", "--protocol",
                         "ripples-smart", "--output", str(tmp_path / "run"), "--quiet",
                         "--", sys.executable, SCRIPT, str(tmp_path), "5",
                         env={"SHARDED_TRAIN_MISMATCH": "1"})
    assert result.returncode == 1
    assert "@shard" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize(("flags", "says"), [
    (["--protocol", "adpsgd"], "does not run on workers of several ranks"),
    (["--protocol", "ripples-smart", "--overlap"], "--overlap does not run"),
    (["--protocol", "ripples-smart", "--ranks-per-worker", "0"], "must be from 1 to 1024"),
])
def test_what_workers_of_several_ranks_do_not_run_is_refused_before_any_start(
        flags: list[str], says: str, tmp_path: Path) -> None:
    result = ripples_cli("run", "--workers", "2", "--ranks-per-worker", "2", *flags,
                         "--output", str(tmp_path), "--", sys.executable, SCRIPT,
                         str(tmp_path), "5", timeout=60)
    assert result.returncode == 2 and says in result.stderr, result.stderr


def test_the_built_in_tasks_are_refused_with_what_to_do(tmp_path: Path) -> None:
    result = ripples_cli("run", "--workers", "2", "--ranks-per-worker", "2", "--task",
                         "digits", "--output", str(tmp_path), timeout=60)
    assert result.returncode == 2 and "give the script after --" in result.stderr


def _start_worker(address: str, host: str, tmp_path: Path) -> list[subprocess.Popen[str]]:
    """A worker of two ranks, started by hand as any launcher would: RIPPLES_* and an
    address of its own for its ranks to meet at."""
    meeting = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "RIPPLES_COORDINATOR": address, "RIPPLES_HOST": host,
           "RIPPLES_RANKS_PER_WORKER": "2", "RIPPLES_REPLICA_ADDRESS": meeting,
           "RIPPLES_METRICS_PORT": "-1",
           "RIPPLES_SAVE_MODEL": str(tmp_path / f"{host}.pt")}
    return [subprocess.Popen([sys.executable, SCRIPT, "-", str(UNBOUNDED_ITERATIONS)],
                             env={**env, "RIPPLES_REPLICA_RANK": str(r)}, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)]


@pytest.mark.slow
def test_a_killed_rank_fails_its_worker_only_and_a_replacement_heals_shard_by_shard(
        tmp_path: Path) -> None:
    with running_coordinator(protocol="ripples-smart", num_workers=3,
                             iterations=UNBOUNDED_ITERATIONS, lease_seconds=2.0,
                             seed=1) as server:
        core = server.service.core  # type: ignore[union-attr]
        workers = [_start_worker(server.address, f"node{k}", tmp_path) for k in range(3)]
        everyone = [p for w in workers for p in w]
        try:
            wait_for(lambda: core.started_at is not None and core.mean_iterations() > 50,
                     "the run to train")
            # `ripples checkpoint`: each worker gathers its shards, rank 0 publishes them.
            consensus = ripples_cli("checkpoint", "--coordinator", server.address,
                                    "--output", str(tmp_path / "consensus.pt"), "--json",
                                    timeout=120)
            assert consensus.returncode == 0, consensus.stderr[-3000:]
            assert len(json.loads(consensus.stdout)["workers"]) == 3
            sharded_train.build_model().load_state_dict(torch.load(tmp_path / "consensus.pt"))
            workers[1][1].send_signal(signal.SIGKILL)  # rank 1 of worker 1
            # Its rank 0 fails (its collectives lost a rank) and says why; nothing hangs.
            out, _ = workers[1][0].communicate(timeout=120)
            assert workers[1][0].returncode not in (0, None), out[-3000:]
            before = {w.worker_id: w.progress.iteration for w in core.live()}
            assert len(before) == 2 and not core.stopped, core.stop_reason
            replacement = _start_worker(server.address, "node1b", tmp_path)
            everyone += replacement
            wait_for(lambda: any(w.replacement and w.healed for w in core.workers.values())
                     or core.stopped, "the replacement to heal", timeout=120)
            assert not core.stopped, core.stop_reason
            joiner = next(w for w in core.workers.values() if w.replacement)
            at = joiner.progress.iteration
            wait_for(lambda: joiner.progress.iteration > at + 20
                     and any(joiner.worker_id in g.members and g.heal_donor is None
                             for g in core.recent_groups),
                     "the replacement to train and average in a group")
            for w in core.live():  # the survivors never stopped
                if w.worker_id in before:
                    assert w.progress.iteration > before[w.worker_id]
            CoordinatorClient(server.address).stop_run("the replacement averaged")
            survivors = [*workers[0], *workers[2], *replacement]
            outputs = finish(survivors, 120)
        finally:
            for p in everyone:
                if p.poll() is None:
                    p.kill()
        for p, text in zip(survivors, outputs, strict=True):
            assert p.returncode == 0, text[-3000:]
        assert joiner.healed
        state = torch.load(tmp_path / "node1b.pt")  # whole, from the replacement's shards
        sharded_train.build_model().load_state_dict(state)
        assert all(torch.isfinite(t).all() for t in state.values())


def test_a_host_launcher_starts_workers_of_several_ranks(tmp_path: Path) -> None:
    """`ripples worker run --nproc-per-node 4 --ranks-per-worker 2 -- python script`: two
    workers of two ranks on one host, each rank 0 writing its worker's whole model."""
    with running_coordinator(protocol="ripples-smart", num_workers=2, iterations=20) as server:
        result = ripples_cli("worker", "run", "--coordinator", server.address,
                             "--nproc-per-node", "4", "--ranks-per-worker", "2",
                             "--metrics-port", "-1", "--save-model", str(tmp_path / "m.pt"),
                             "--", sys.executable, SCRIPT, "-", "20", timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert server.service.core.stopped  # type: ignore[union-attr]
    for local_rank in (0, 1):  # one file per worker, whole
        state = torch.load(tmp_path / f"m.{local_rank}.pt")
        sharded_train.build_model().load_state_dict(state)
    refused = ripples_cli("worker", "run", "--coordinator", "127.0.0.1:1", "--nproc-per-node",
                          "3", "--ranks-per-worker", "2", "--", sys.executable, SCRIPT,
                          timeout=60)
    assert refused.returncode == 2 and "does not divide" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_a_sharded_run_killed_whole_resumes_from_its_shards(tmp_path: Path) -> None:
    """Checkpoints of workers of two ranks (DIR/rank-R/step-S/, a shard per rank, with
    torch.distributed.checkpoint): the launcher and every process SIGKILLed, `ripples run
    --resume` goes on from each worker's newest checkpoint, its model exactly the one
    saved, which loads whole into the unsharded model too."""
    output = tmp_path / "run"

    def command(steps: int, *flags: str) -> list[str]:
        return ["run", "--workers", "2", "--ranks-per-worker", "2", "--protocol",
                "ripples-smart", "--checkpoint-every", "5", "--output", str(output),
                "--quiet", *flags, "--", sys.executable, SCRIPT, str(tmp_path), str(steps)]

    launcher = subprocess.Popen([sys.executable, "-m", "ripples.cli", *command(100_000)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    checkpoints = output / "checkpoints"
    try:
        wait_for(lambda: launcher.poll() is not None or all(
            len(_steps(checkpoints / f"rank-{w}")) >= 2 for w in (0, 1)),
            "two checkpoints of each worker", timeout=180)
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
    finally:
        subprocess.run(["pkill", "-9", "-P", str(launcher.pid)], check=False)
        launcher.kill()
        launcher.communicate()
    newest = {w: _steps(checkpoints / f"rank-{w}")[0] for w in (0, 1)}
    for w, step in newest.items():  # a shard per rank, each rank's own file
        names = {p.name for p in (checkpoints / f"rank-{w}" / f"step-{step}").iterdir()}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rank-0.pt",
                "rank-1.pt"} <= names, names
        assert len(_steps(checkpoints / f"rank-{w}")) <= 3  # --keep-checkpoints
    resumed = ripples_cli(*command(max(newest.values()) + 10, "--resume"), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for w, step in newest.items():
        record = torch.load(tmp_path / f"worker{w}.pt")
        assert record["start"] == step
        saved = _unsharded(checkpoints / f"rank-{w}" / f"step-{step}")
        assert all(torch.equal(saved[k], record["restored"][k]) for k in saved)


def _steps(directory: Path) -> list[int]:
    """The complete checkpoints' steps in a worker's directory, newest first."""
    if not directory.is_dir():
        return []
    return sorted((int(p.name.removeprefix("step-")) for p in directory.iterdir()
                   if p.name.startswith("step-")), reverse=True)


def _unsharded(path: Path) -> State:
    """A sharded checkpoint's model, loaded whole in this one process."""
    import torch.distributed.checkpoint as dcp

    state = {"model": sharded_train.build_model().state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


LM_TARGET = 2.2
"""The slow-links bench's target loss for this LM (docs/benchmarks.md)."""


@pytest.mark.slow
def test_four_workers_of_two_ranks_train_the_lm_to_its_target(tmp_path: Path) -> None:
    """examples/transformer_lm.py (the bench's size) on four workers of two ranks reaches
    the LM's target; model.pt, averaged from the workers' whole models, loads into the
    unsharded model and evaluates near the loss the run reported (about 0.03 apart
    measured: the consensus model on fresh batches against the workers' last batches)."""
    lm = ["--d-model", "64", "--layers", "2", "--heads", "2", "--block-size", "64"]
    result = ripples_cli("run", "--workers", "4", "--ranks-per-worker", "2", "--protocol",
                         "ripples-smart", "--target-loss", str(LM_TARGET), "--seed", "1",
                         "--output", str(tmp_path), "--quiet", "--", sys.executable, "-m",
                         "ripples.examples.transformer_lm", *lm, "--steps", "3000",
                         timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "target loss" in summary["stop_reason"], summary["stop_reason"]
    from ripples.examples import transformer_lm

    args = transformer_lm.build_parser().parse_args(lm)
    model = transformer_lm.build_model(args)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    loss = transformer_lm.evaluate(model, args)
    assert abs(loss - summary["final_train_loss"]) < 0.2, (loss, summary["final_train_loss"])


@pytest.mark.slow
def test_torchrun_splits_its_world_into_workers_of_two_ranks(tmp_path: Path) -> None:
    """Plain torchrun: with RIPPLES_COORDINATOR, 4 nodes of one process each (4 torchrun
    agents, as on 4 hosts) are two workers of two ranks, each spanning two nodes (its
    group split from torchrun's world); without it, 2 processes are one worker of two
    ranks training alone (plain FSDP2)."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("RIPPLES_") and k not in launch}

    def torchrun(processes: int, trace: Path, env: dict[str, str], nodes: int = 1) -> None:
        trace.mkdir(exist_ok=True)
        port = str(free_port())
        started = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
             str(processes), "--nnodes", str(nodes), "--node-rank", str(node),
             "--master-addr", "127.0.0.1", "--master-port", port, SCRIPT, str(trace), "12"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**clean, "RIPPLES_RANKS_PER_WORKER": "2", "RIPPLES_HOST": f"node{node}",
                 **env}) for node in range(nodes)]
        for process in started:
            _, err = process.communicate(timeout=240)
            assert process.returncode == 0, err[-3000:]

    with running_coordinator(protocol="ripples-smart", num_workers=2, iterations=12) as server:
        torchrun(1, tmp_path / "two", {"RIPPLES_COORDINATOR": server.address,
                                       "RIPPLES_METRICS_PORT": "-1"}, nodes=4)
        status = CoordinatorClient(server.address).run_status()
    assert status.stopped and status.stop_reason.startswith("iteration budget")
    assert len(status.workers) == 2 and status.num_groups_formed > 0
    assert sorted(w.host for w in status.workers) == ["node0", "node2"]  # each rank 0's
    traces = {w: torch.load(tmp_path / "two" / f"worker{w}.pt")["trace"] for w in (0, 1)}
    assert _replay(traces) > 0
    torchrun(2, tmp_path / "alone", {})
    alone = torch.load(tmp_path / "alone" / "worker0.pt")["trace"]
    previous = sharded_train.build_model().state_dict()
    for step, recorded in enumerate(alone, 1):  # no group: the unsharded local steps
        previous, _ = _local_step(previous, 0, step)
        assert _close(recorded, previous)
