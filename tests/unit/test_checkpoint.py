"""ripples.Checkpointer in single-process mode (and its lock-step agreement on a store):
atomic files, retention, falling back from a corrupt file, refusing another model, the
interval and launch options, and a resumed run that ends bit-identical to an
uninterrupted one."""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ripples
from ripples.protocols.gossip.state import GossipState, MomentumParameters
from ripples.worker import checkpoint as checkpoint_module
from ripples.worker.api import current_worker
from ripples.worker.checkpoint_store import StoreExchange, agree_on_step
from ripples.worker.launch_env import CheckpointInterval, CheckpointOptions, LaunchEnv
from ripples.worker.process_launcher import launch_environment, runner_argv


@pytest.fixture(autouse=True)
def alone() -> Iterator[None]:
    """Every test starts single-process (whatever the environment says) and leaves no
    worker behind. One torch thread: on a busy machine, threads over tiny tensors only
    contend (a hundredfold slower steps measured here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ripples.init(env=LaunchEnv(host="test"))
    yield
    _crash()
    torch.set_num_threads(threads)


def _crash() -> None:
    """The process is gone: its worker, and where its random generators stood."""
    worker = current_worker()
    if worker is not None:
        worker.shutdown()
    torch.manual_seed(12345)
    random.seed(12345)


def _small(seed: int = 0, width: int = 4) -> tuple[nn.Module, ripples.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))
    return model, ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model)


def _steps(opt: ripples.Optimizer, ckpt: ripples.Checkpointer, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        opt.model(torch.randn(5, 3)).square().mean().backward()
        opt.step()
        ckpt.step()


def _saved(directory: Path) -> list[str]:
    return sorted(p.name for p in (directory / "rank-0").iterdir())


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(("text", "steps", "seconds"), [
    ("500", 500, 0.0), (20, 20, 0.0), ("90s", 0, 90.0), ("1.5S", 0, 1.5), (" 7 ", 7, 0.0),
    ("0", 0, 0.0), (0, 0, 0.0), (None, 0, 0.0)])
def test_intervals_are_steps_or_seconds(text: str | int | None, steps: int,
                                        seconds: float) -> None:
    assert CheckpointInterval.parse(text) == CheckpointInterval(steps=steps, seconds=seconds)


@pytest.mark.parametrize("text", ["x", "-1", "-2s", "5m", "1.5", "nans", "infs", ""])
def test_a_malformed_interval_says_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match=r"give a step count \(500\), seconds \(90s\)"):
        CheckpointInterval.parse(text)


def test_the_options_travel_through_the_launch_environment() -> None:
    options = CheckpointOptions(checkpoint_dir="/ck", checkpoint_every="90s",
                                keep_checkpoints=5)
    env = LaunchEnv(coordinator="c:1", host="h", checkpoint=options)
    child = launch_environment(env, rank=0, world_size=1)
    assert LaunchEnv.from_environ(child).checkpoint == options
    argv = runner_argv(env, "digits", quiet=True)
    flags = argv[argv.index("--checkpoint-dir"):][:6]
    assert flags == ["--checkpoint-dir", "/ck", "--checkpoint-every", "90s",
                     "--keep-checkpoints", "5"]
    assert "RIPPLES_CHECKPOINT_DIR" not in launch_environment(LaunchEnv(host="h"), rank=None,
                                                              world_size=None)


@pytest.mark.parametrize(("variables", "message"), [
    ({"RIPPLES_CHECKPOINT_EVERY": "soon"}, "RIPPLES_CHECKPOINT_EVERY"),
    ({"RIPPLES_KEEP_CHECKPOINTS": "0"}, "at least 1.*RIPPLES_KEEP_CHECKPOINTS"),
    ({"RIPPLES_KEEP_CHECKPOINTS": "all"}, "RIPPLES_KEEP_CHECKPOINTS='all' is not an integer"),
])
def test_malformed_checkpoint_variables_are_named(variables: dict[str, str],
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchEnv.from_environ({"RIPPLES_CHECKPOINT_DIR": "/ck", **variables})


def test_without_a_directory_it_does_nothing(tmp_path: Path) -> None:
    model, opt = _small()
    ckpt = ripples.Checkpointer(opt, every=1)
    assert not ckpt.enabled and ckpt.restore() == 0
    _steps(opt, ckpt, 2)
    assert ckpt.save() is None and not list(tmp_path.iterdir())


def test_the_launch_environment_gives_the_directory_and_interval(tmp_path: Path) -> None:
    _crash()
    options = CheckpointOptions(checkpoint_dir=str(tmp_path), checkpoint_every="2",
                                keep_checkpoints=1)
    ripples.init(env=LaunchEnv(host="test", checkpoint=options))
    model, opt = _small()
    ckpt = ripples.Checkpointer(opt)
    _steps(opt, ckpt, 5)
    assert _saved(tmp_path) == ["step-4.pt"]


# ---------------------------------------------------------------------- saving
def test_saves_every_n_steps_and_keeps_the_newest(tmp_path: Path) -> None:
    model, opt = _small()
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every="3", keep=2)
    _steps(opt, ckpt, 10)
    assert _saved(tmp_path) == ["step-6.pt", "step-9.pt"]
    state = torch.load(tmp_path / "rank-0" / "step-9.pt", weights_only=False)
    assert state["step"] == 9 and state["optimizer"]["ripples"]["local_step"] == 9
    assert set(state) >= {"format", "model", "optimizer", "objects", "rng", "saved_at"}
    # Copies, not views of the averaged state's flat buffer (which holds more).
    weight = state["model"]["0.weight"]
    assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    assert ckpt.save() == tmp_path / "rank-0" / "step-10.pt"
    assert _saved(tmp_path) == ["step-10.pt", "step-9.pt"]


def test_a_time_interval_saves_at_the_first_step_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: now[0])
    model, opt = _small()
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every="90s")
    _steps(opt, ckpt, 2)
    now[0] = 95.0
    _steps(opt, ckpt, 2)
    now[0] = 150.0
    _steps(opt, ckpt, 1)
    assert _saved(tmp_path) == ["step-3.pt"]


def test_the_run_stopping_saves_the_last_step(tmp_path: Path) -> None:
    model, opt = _small()
    opt.planned_steps = 5  # the single-process budget: opt.stopped after step 5
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every=0)
    _steps(opt, ckpt, 5)
    assert opt.stopped and _saved(tmp_path) == ["step-5.pt"]


def test_a_writer_killed_mid_write_leaves_only_whole_checkpoints(tmp_path: Path) -> None:
    """SIGKILL while the third checkpoint is half written: the first two load, the half
    file is under no checkpoint's name, and a restore skips (and removes) it."""
    script = """
import sys, io, torch, ripples
from ripples.worker.launch_env import LaunchEnv
ripples.init(env=LaunchEnv(host="writer"))
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
ckpt = ripples.Checkpointer(opt, directory=sys.argv[1], every=1, keep=5)
real_save = torch.save
def save(obj, f):
    if opt.local_step == 3:
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        print("half written", flush=True)
        sys.stdin.read()  # until killed
    real_save(obj, f)
torch.save = save
for _ in range(5):
    opt.zero_grad(); model(torch.randn(4, 3)).sum().backward(); opt.step(); ckpt.step()
"""
    writer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "half written\n"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    names = sorted(p.name for p in (tmp_path / "rank-0").iterdir())
    assert names == [".step-3.pt.partial", "step-1.pt", "step-2.pt"]
    for name in names[1:]:
        assert torch.load(tmp_path / "rank-0" / name, weights_only=False)["format"] == 1
    model = nn.Linear(3, 2)
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    assert ripples.Checkpointer(opt, directory=tmp_path).restore() == 2
    assert _saved(tmp_path) == ["step-1.pt", "step-2.pt"]


# ---------------------------------------------------------------------- restoring
def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _small()
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every=2)
    _steps(opt, ckpt, 4)
    at_step_2 = torch.load(tmp_path / "rank-0" / "step-2.pt", weights_only=False)["model"]
    newest = tmp_path / "rank-0" / "step-4.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # torn by something else than us
    _crash()
    model, opt = _small(seed=7)
    with caplog.at_level(logging.WARNING):
        assert ripples.Checkpointer(opt, directory=tmp_path).restore() == 2
    assert str(newest) in caplog.text
    assert opt.local_step == 2
    assert all(torch.equal(v, at_step_2[k]) for k, v in model.state_dict().items())


def test_checkpoints_that_all_fail_to_load_are_an_error(tmp_path: Path) -> None:
    (tmp_path / "rank-0").mkdir()
    (tmp_path / "rank-0" / "step-3.pt").write_bytes(b"not a checkpoint")
    model, opt = _small()
    with pytest.raises(RuntimeError, match=r"none of the checkpoints .* \(steps \[3\]\)"):
        ripples.Checkpointer(opt, directory=tmp_path).restore()


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    model, opt = _small(width=4)
    ripples.Checkpointer(opt, directory=tmp_path).save()
    _crash()
    model, opt = _small(width=5)
    with pytest.raises(ValueError, match=r"another model: '0.weight' is \[4, 3\] there, "
                                         r"\[5, 3\] here"):
        ripples.Checkpointer(opt, directory=tmp_path).restore()


def test_a_named_object_missing_from_the_checkpoint_is_refused(tmp_path: Path) -> None:
    model, opt = _small()
    ripples.Checkpointer(opt, directory=tmp_path).save()
    _crash()
    model, opt = _small()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with pytest.raises(ValueError, match=r"holds no state for \['scheduler'\]"):
        ripples.Checkpointer(opt, directory=tmp_path, scheduler=scheduler).restore()


# ---------------------------------------------------------------------- a script's own state
def _own_format(model: nn.Module, opt: ripples.Optimizer, loaded: list[dict[str, int]], *,
                with_optimizer: bool = True) -> dict[str, Callable[..., Any]]:
    """A script's own checkpoint format, as the Checkpointer's callables."""
    def state_dict() -> dict[str, Any]:
        state = {"net": model.state_dict(), "extra": {"epoch": 3}}
        return {**state, "sgd": opt.state_dict()} if with_optimizer else state

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["net"])
        if with_optimizer:
            opt.load_state_dict(state["sgd"])
        loaded.append(state["extra"])

    return {"state_dict": state_dict, "load_state_dict": load_state_dict}


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_scripts_own_state_is_saved_and_given_back(with_optimizer: bool,
                                                      tmp_path: Path) -> None:
    model, opt = _small()
    loaded: list[dict[str, int]] = []
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every=2,
                                **_own_format(model, opt, loaded, with_optimizer=with_optimizer))
    _steps(opt, ckpt, 5)
    assert _saved(tmp_path) == ["step-2.pt", "step-4.pt"]
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save()
    saved = torch.load(tmp_path / "rank-0" / "step-5.pt", weights_only=False)
    assert saved["script_state"]["extra"] == {"epoch": 3}
    assert saved["ripples"] == {"local_step": 5, "skipped_steps": 0}
    assert not {"model", "optimizer", "rng"} & set(saved)  # only what the script gave
    _crash()
    model, opt = _small(seed=1)
    ckpt = ripples.Checkpointer(opt, directory=tmp_path,
                                **_own_format(model, opt, loaded, with_optimizer=with_optimizer))
    assert ckpt.restore() == 5
    # The step goes on from the checkpoint's whether or not the script's state holds it.
    assert opt.local_step == 5 and loaded == [{"epoch": 3}]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    if with_optimizer:
        assert all("momentum_buffer" in s for s in opt.state.values())


def test_the_callables_come_in_pairs() -> None:
    model, opt = _small()
    with pytest.raises(ValueError, match="give both state_dict and load_state_dict"):
        ripples.Checkpointer(opt, directory="unused", state_dict=model.state_dict)
    with pytest.raises(TypeError, match="load_state_dict must be callable"):
        ripples.Checkpointer(opt, state_dict=model.state_dict,
                             load_state_dict={"not": "callable"})  # type: ignore[arg-type]


def test_a_checkpoint_of_the_other_kind_is_refused(tmp_path: Path) -> None:
    model, opt = _small()
    ripples.Checkpointer(opt, directory=tmp_path / "ripples").save()
    ripples.Checkpointer(opt, directory=tmp_path / "own", **_own_format(model, opt, [])).save()
    _crash()
    model, opt = _small()
    with pytest.raises(ValueError, match="holds Ripples' own training state, not a script's"):
        ripples.Checkpointer(opt, directory=tmp_path / "ripples",
                             **_own_format(model, opt, [])).restore()
    with pytest.raises(ValueError, match="holds a script's own state"):
        ripples.Checkpointer(opt, directory=tmp_path / "own").restore()


def test_a_sampler_needs_the_samples_per_step() -> None:
    model, opt = _small()
    sampler = ripples.DistributedSampler(TensorDataset(torch.zeros(8)))
    with pytest.raises(ValueError, match="samples_per_step"):
        ripples.Checkpointer(opt, directory="unused", sampler=sampler)


def test_the_sampler_resumes_its_epoch_after_the_consumed_samples() -> None:
    sampler = ripples.DistributedSampler(TensorDataset(torch.zeros(10)), shuffle=True, seed=1)
    sampler.set_epoch(2)
    order = list(sampler)
    sampler.advance(4)
    state = sampler.state_dict()
    assert state == {"epoch": 2, "seed": 1, "position": 4, "num_samples": 10}
    fresh = ripples.DistributedSampler(TensorDataset(torch.zeros(10)), shuffle=True, seed=0)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)
    assert list(fresh) == order[4:]
    assert list(fresh) == order  # the next pass is a whole one
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # another epoch than the restored one starts afresh
    assert len(list(fresh)) == 10


def test_a_sampler_of_another_shard_length_resumes_at_the_same_fraction_of_the_epoch() -> None:
    """A lock-step run's restart round formed with 2 workers where 4 saved: each shard is
    twice as long, and 4 of 5 samples consumed become 8 of 10."""
    dataset = TensorDataset(torch.zeros(20))
    saved = ripples.DistributedSampler(dataset, num_replicas=4, rank=1)
    saved.set_epoch(1)
    list(saved)
    saved.advance(4)
    resumed = ripples.DistributedSampler(dataset, num_replicas=2, rank=1)
    resumed.load_state_dict(saved.state_dict())
    resumed.set_epoch(1)
    assert resumed.position == 8 and len(list(resumed)) == 2


def test_a2cid2s_momentum_copy_is_restored_and_stale_deltas_dropped() -> None:
    flat = torch.zeros(4)
    state = GossipState(flat, MomentumParameters(eta=0.5, alpha_tilde=0.5))
    state.add_delta(torch.ones(4))  # an exchange against the model before the restore
    flat.fill_(3.0)
    state.restart(torch.full((4,), 2.0))
    assert state.y is not None and torch.equal(state.y, torch.full((4,), 2.0))
    assert not state.apply_and_publish() and torch.equal(flat, torch.full((4,), 3.0))


# ---------------------------------------------------------------------- lock-step
class _Files:
    """A rank's checkpoint files in memory: step -> bytes."""

    def __init__(self, rank: int, steps: list[int], unloadable: set[tuple[int, int]]) -> None:
        self.rank, self.unloadable = rank, unloadable
        self.data = {step: f"state of step {step} from rank {rank}".encode() for step in steps}

    def load(self, step: int) -> tuple[int, bytes] | None:
        return None if (self.rank, step) in self.unloadable else (step, self.data[step])

    def read(self, step: int) -> bytes:
        return self.data[step]

    def write(self, step: int, data: bytes) -> None:
        self.data[step] = data


def _agree(held: dict[int, list[int]], unloadable: set[tuple[int, int]] = frozenset()  # type: ignore[assignment]
           ) -> tuple[dict[int, object], dict[int, str]]:
    store = dist.HashStore()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}

    def rank(r: int) -> None:
        exchange = StoreExchange(store, "run", r, len(held), 10.0)
        try:
            results[r] = agree_on_step(exchange, held[r], _Files(r, held[r], unloadable))
        except RuntimeError as err:
            errors[r] = str(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(held))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    steps = {step for mine in held.values() for step in mine}
    assert not any(store.check([f"run/file/{step}"]) for step in steps)  # no copy is kept
    return results, errors


@pytest.mark.parametrize(("held", "unloadable", "expected"), [
    ({0: [6, 4, 2], 1: [6, 4, 2], 2: [6, 4, 2]}, set(), 6),
    ({0: [6, 4, 2], 1: [6, 4, 2], 2: [6, 4, 2]}, {(1, 6), (2, 4)}, 2),
    ({0: [], 1: [], 2: []}, set(), None),
])
def test_lockstep_ranks_agree_on_the_newest_step_every_rank_loads(
        held: dict[int, list[int]], unloadable: set[tuple[int, int]],
        expected: int | None) -> None:
    results, errors = _agree(held, unloadable)
    assert not errors
    steps = {r: None if found is None else found[0] for r, found in results.items()}  # type: ignore[index]
    assert steps == {0: expected, 1: expected, 2: expected}


@pytest.mark.parametrize("held", [
    {0: [], 1: [8, 4], 2: [8, 4]},  # rank 0 joined at a restart round on a host of its own
    {0: [4, 2], 1: [8, 4], 2: [8, 4]},  # rank 0 was killed before it saved step 8
    {0: [80, 40], 1: [280, 240], 2: [280, 240]},  # rank 0's directory is a stale one
])
def test_a_rank_without_the_newest_step_takes_it_from_the_lowest_holder(
        held: dict[int, list[int]]) -> None:
    """Lock-step workers hold the same state at the same step: a rank that lacks the run's
    newest step gets its file through the store, and the store keeps no copy."""
    results, errors = _agree(held)
    assert not errors
    newest = held[1][0]
    assert results == {0: (newest, f"state of step {newest} from rank 1".encode()),
                       1: (newest, f"state of step {newest} from rank 1".encode()),
                       2: (newest, f"state of step {newest} from rank 2".encode())}


def test_a_step_nobody_can_load_fails_every_rank_naming_the_steps() -> None:
    results, errors = _agree({0: [6], 1: [6]}, {(0, 6)})
    assert sorted(errors) == [0, 1] and "no checkpoint step ([6]) loads" in errors[0]


# ---------------------------------------------------------------------- bit-identical resume
STEPS_PER_EPOCH = 6  # 44 samples in batches of 8: five full batches and one of 4
EPOCHS = 3


def _train(directory: Path, *, every: int, crash_after: int | None = None
           ) -> tuple[int, dict[str, torch.Tensor] | None]:
    """A script as users write them: dropout, BatchNorm, SGD with momentum, StepLR, a
    shuffled DistributedSampler in a DataLoader; restores, trains, checkpoints. Returns
    the step it restored and the final state, None if it "crashed" after step
    `crash_after`."""
    ripples.init(env=LaunchEnv(host="test"))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(44, 6, generator=g), torch.randint(0, 3, (44,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                          nn.Linear(16, 3))
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    sampler = ripples.DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    ckpt = ripples.Checkpointer(opt, directory=directory, every=every, scheduler=scheduler,
                                sampler=sampler, samples_per_step=8)
    start = ckpt.restore()
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            scheduler.step()
            ckpt.step()
            if opt.local_step == crash_after:
                _crash()
                return start, None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lr"] = torch.tensor(scheduler.get_last_lr())
    _crash()
    return start, state


@pytest.mark.parametrize(("every", "crash_after"), [
    (3, 10),  # restored from step 9, mid-epoch (the sampler resumes at its 4th batch)
    (6, 13),  # restored from step 12, the end of an epoch
])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(
        tmp_path: Path, every: int, crash_after: int) -> None:
    _crash()
    _, uninterrupted = _train(tmp_path / "whole", every=every)
    assert _train(tmp_path / "cut", every=every, crash_after=crash_after) == (0, None)
    start, resumed = _train(tmp_path / "cut", every=every)
    assert start == crash_after - crash_after % every
    assert uninterrupted is not None and resumed is not None
    assert list(resumed) == list(uninterrupted)
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
