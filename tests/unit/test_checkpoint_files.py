"""ripples.Checkpointer's files: saved atomically, kept, and restored or refused.

Single-process, on a real worker and real files under tmp_path: it saves every n steps or
seconds and at the run's stop, keeping the newest; a writer SIGKILLed mid-write (a real
subprocess) leaves only whole checkpoints; a restore falls back from a corrupt newest file
(and fails when none loads) and refuses a checkpoint of another model or one missing a
named object.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_harness import crash, run_steps, saved_files, small_model
from torch import nn

import ripples
from ripples.worker import checkpoint as checkpoint_module

pytestmark = pytest.mark.usefixtures("single_process_worker")  # tests/unit/conftest.py


def test_saves_every_n_steps_and_keeps_the_newest(tmp_path: Path) -> None:
    model, opt = small_model()
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every="3", keep=2)
    run_steps(opt, ckpt, 10)
    assert saved_files(tmp_path) == ["step-6.pt", "step-9.pt"]
    state = torch.load(tmp_path / "rank-0" / "step-9.pt", weights_only=False)
    assert state["step"] == 9 and state["optimizer"]["ripples"]["local_step"] == 9
    assert set(state) >= {"format", "model", "optimizer", "objects", "rng", "saved_at"}
    # Copies, not views of the averaged state's flat buffer (which holds more).
    weight = state["model"]["0.weight"]
    assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    assert ckpt.save() == tmp_path / "rank-0" / "step-10.pt"
    assert saved_files(tmp_path) == ["step-10.pt", "step-9.pt"]


def test_a_time_interval_saves_at_the_first_step_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: now[0])
    model, opt = small_model()
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every="90s")
    run_steps(opt, ckpt, 2)
    now[0] = 95.0
    run_steps(opt, ckpt, 2)
    now[0] = 150.0
    run_steps(opt, ckpt, 1)
    assert saved_files(tmp_path) == ["step-3.pt"]


def test_the_run_stopping_saves_the_last_step(tmp_path: Path) -> None:
    model, opt = small_model()
    opt.planned_steps = 5  # the single-process budget: opt.stopped after step 5
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every=0)
    run_steps(opt, ckpt, 5)
    assert opt.stopped and saved_files(tmp_path) == ["step-5.pt"]


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
    assert saved_files(tmp_path) == ["step-1.pt", "step-2.pt"]


# ---------------------------------------------------------------------- restoring
def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = small_model()
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every=2)
    run_steps(opt, ckpt, 4)
    at_step_2 = torch.load(tmp_path / "rank-0" / "step-2.pt", weights_only=False)["model"]
    newest = tmp_path / "rank-0" / "step-4.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # torn by something else than us
    crash()
    model, opt = small_model(seed=7)
    with caplog.at_level(logging.WARNING):
        assert ripples.Checkpointer(opt, directory=tmp_path).restore() == 2
    assert str(newest) in caplog.text
    assert opt.local_step == 2
    assert all(torch.equal(v, at_step_2[k]) for k, v in model.state_dict().items())


def test_checkpoints_that_all_fail_to_load_are_an_error(tmp_path: Path) -> None:
    (tmp_path / "rank-0").mkdir()
    (tmp_path / "rank-0" / "step-3.pt").write_bytes(b"not a checkpoint")
    model, opt = small_model()
    with pytest.raises(RuntimeError, match=r"none of the checkpoints .* \(steps \[3\]\)"):
        ripples.Checkpointer(opt, directory=tmp_path).restore()


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    model, opt = small_model(width=4)
    ripples.Checkpointer(opt, directory=tmp_path).save()
    crash()
    model, opt = small_model(width=5)
    with pytest.raises(ValueError, match=r"another model: '0.weight' is \[4, 3\] there, "
                                         r"\[5, 3\] here"):
        ripples.Checkpointer(opt, directory=tmp_path).restore()


def test_a_named_object_missing_from_the_checkpoint_is_refused(tmp_path: Path) -> None:
    model, opt = small_model()
    ripples.Checkpointer(opt, directory=tmp_path).save()
    crash()
    model, opt = small_model()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with pytest.raises(ValueError, match=r"holds no state for \['scheduler'\]"):
        ripples.Checkpointer(opt, directory=tmp_path, scheduler=scheduler).restore()
