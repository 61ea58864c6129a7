"""Ripples' data plane on each device this machine has: gloo on the CPU (always, so that
CI checks everything these tests check but the device), NCCL on a GPU (marker `gpu`,
skipped without CUDA). Ranks share the one GPU as separate NCCL hosts: each process gets
its own NCCL_HOSTID and NCCL talks over its sockets on loopback (docs/gpu.md), as on the
GPU machines this project is lent.

- P-Reduce in groups of 2, 3 and 4 ranks equals the mean computed on the CPU;
- a member with a NaN voids its group for every member (the non-finite flag rides the
  collective), and the next group without it averages as before;
- the outer step's synchronisation equals the CPU's, and on the int8 wire leaves every
  member the same bits within half its step of it;
- a checkpoint of the averaged state round-trips;
- on a GPU, every library protocol (and ripples-smart with `--overlap`) runs a few steps
  of a real `ripples run` with two workers sharing the GPU (`--share-gpus`), and so do
  lap-sgd and lpp-sgd, whose updater processes share each worker's CUDA model;
- on a GPU, workers of two ranks shard their model with FSDP2 (NCCL inside a worker and
  between workers' shards);
- on a GPU, a background P-Reduce (`--overlap`) starts and lands without a host-device
  synchronisation and equals the CPU's arithmetic (tests/integration/
  test_background_preduce.py has its CPU half).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from ripples.bench.members import run_members
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import CommunicatorFactory, connect_store
from ripples.worker.dataplane.outer_state import OuterState, outer_preduce
from ripples.worker.dataplane.preduce import preduce

REPO = Path(__file__).resolve().parents[2]
PROBE = str(REPO / "tests" / "integration" / "scripts" / "probe_train.py")
SHARDED = str(REPO / "tests" / "integration" / "scripts" / "sharded_train.py")
TIMEOUT = 120.0
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _device(name: str, rank: int) -> torch.device:
    """This member's device; on a GPU, with the NCCL environment of a shared one."""
    if name == "cpu":
        return torch.device("cpu")
    os.environ["NCCL_HOSTID"] = f"ripples-test-{os.getpid()}-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _member(rank: int, port: int, config: tuple[str, int], out: mp.Queue) -> None:
    device_name, size = config
    torch.set_num_threads(1)
    device = _device(device_name, rank)
    factory = CommunicatorFactory(connect_store("127.0.0.1", port, TIMEOUT), device, TIMEOUT,
                                  gloo_hostname="127.0.0.1")
    comm = factory.build(f"all-{size}", rank, size, peers_within=TIMEOUT)
    model = _model(rank).to(device)
    state = AveragedState(model)
    preduce(state, comm, TIMEOUT)
    averaged = state.flat.cpu().tolist()
    if rank == 0:
        with torch.no_grad():
            state.flat[1] = float("nan")
    before = state.flat.cpu().clone()
    preduce(state, comm, TIMEOUT)  # void: every member keeps its own values
    kept = torch.equal(state.flat.cpu().nan_to_num(7.0), before.nan_to_num(7.0))
    # The outer step (group form, then the same-anchor form) on fresh models.
    fresh = _model(rank).to(device)
    outer_state = AveragedState(fresh)
    outer = OuterState(outer_state, lr=0.7, momentum=0.5)
    with torch.no_grad():
        outer.take_anchor()
        outer_state.flat.mul_(1.0 + 0.1 * rank)  # a made-up round of local progress
    outer.record_step()
    outer_preduce(outer, comm, TIMEOUT)
    checkpoint = {k: v.cpu() for k, v in outer.state_dict().items()
                  if isinstance(v, torch.Tensor)}
    # The outer step on the int8 wire (an all-gather and two MAX collectives), from one
    # shared start as in a run (its members agree on the high bits).
    wired_state = AveragedState(_model(0).to(device))
    wired = OuterState(wired_state, lr=0.7, momentum=0.5, compression="int8")
    with torch.no_grad():
        wired.take_anchor()
        wired_state.flat.mul_(1.0 + 0.1 * rank)
    wired.record_step()
    outer_preduce(wired, comm, TIMEOUT)
    assert wired.modular is not None
    out.put((rank, averaged, kept, outer_state.flat.cpu().tolist(),
             {k: v.tolist() for k, v in checkpoint.items()},
             (wired_state.flat.cpu().tolist(), int(wired.modular.voided_blocks))))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_p_reduce_the_gate_and_the_outer_step_equal_the_cpu_reference(
        device: str, size: int) -> None:
    results = {rank: rest for rank, *rest in run_members(
        _member, size, (device, size), replies=size, timeout_seconds=TIMEOUT)}
    initial = [AveragedState(_model(r)).flat for r in range(size)]
    mean = sum(initial) / size
    for rank, (averaged, kept, _, _, _) in results.items():
        torch.testing.assert_close(torch.tensor(averaged), mean, rtol=1e-6, atol=1e-6)
        assert kept, f"rank {rank} adopted a group result that had a NaN member"
    # The outer step: the CPU's own arithmetic on the same inputs (outer_state.py's
    # provisional steps, averaged), and every member leaves with the same model.
    flats = [torch.tensor(results[r][2]) for r in range(size)]
    for other in flats[1:]:
        torch.testing.assert_close(other, flats[0], rtol=0, atol=0)
    n = sum(p.numel() for p in _model(0).parameters())
    anchors = torch.stack([f[:n] for f in initial])
    progress = torch.stack([f[:n] * (1.0 + 0.1 * r) for r, f in enumerate(initial)])
    delta = (anchors - progress).mean(0)
    expected = anchors.mean(0) - 0.7 * (1 + 0.5) * delta  # momentum starts at 0
    torch.testing.assert_close(flats[0][:n], expected, rtol=1e-5, atol=1e-6)
    # The outer state's checkpoint holds the same anchor on every member.
    anchors_saved = [torch.tensor(results[r][3]["anchor"]) for r in range(size)]
    for saved in anchors_saved:
        torch.testing.assert_close(saved, flats[0][:n], rtol=0, atol=0)
    # The int8 wire: the same bits on every member, within half a step of the float
    # average (the width is at most 8 x (1.05 + 1) x the largest pseudo-gradient, or its
    # floor: worker/dataplane/modular_wire.py), no block voided.
    wired = [torch.tensor(results[r][4][0]) for r in range(size)]
    assert all(results[r][4][1] == 0 for r in range(size))
    for other in wired[1:]:
        torch.testing.assert_close(other, wired[0], rtol=0, atol=0)
    start = initial[0][:n]
    deltas = torch.stack([-0.1 * r * start for r in range(size)])  # φ − x, each member
    shared = start - 0.7 * (1 + 0.5) * deltas.mean(0)
    largest = float(deltas.abs().max())
    step = (8 * 2.05 * largest + 2 ** -12 * float(shared.abs().max() + largest)) / 512
    assert 0 < float((wired[0][:n] - shared).abs().max()) <= step * 1.01


def _run_on_the_gpu(tmp_path: Path, protocol: str, *options: str) -> None:
    """`ripples run` with two workers sharing the GPU; both end with finite models. (From
    tmp_path: on a GPU machine the package is installed apart, and the checkout's source
    folders would shadow it from the checkout's root.)"""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ripples.cli", "run", "--workers", "2", "--workers-per-node",
         "2", "--device", "cuda", "--share-gpus", "--protocol", protocol, "--output",
         str(tmp_path), "--quiet", "--timeout-seconds", "240", *options],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        state = torch.load(tmp_path / "workers" / f"rank{rank}.pt")
        assert all(torch.isfinite(t).all() for t in state.values())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("protocol", ["ripples-smart", "ripples-random", "ripples-static",
                                      "allreduce", "adpsgd", "a2cid2",
                                      "ripples-smart --overlap --local-steps 2",
                                      "ripples-smart --overlap --local-steps 2 "
                                      "--outer-optimizer nesterov --outer-compression int8"])
def test_every_library_protocol_trains_on_a_shared_gpu(protocol: str, tmp_path: Path) -> None:
    name, *options = protocol.split()
    _run_on_the_gpu(tmp_path, name, *options, "--", "python", PROBE, "--steps", "20")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rounds", [[], ["--local-steps", "2", "--outer-optimizer", "nesterov"]],
                         ids=["every-step", "outer"])
def test_workers_of_two_ranks_shard_with_fsdp2_on_a_shared_gpu(rounds: list[str],
                                                               tmp_path: Path) -> None:
    """Two workers of two ranks, all four on the GPU (FSDP2 over NCCL inside a worker,
    P-Reduce of each shard over NCCL between workers); each worker's model.pt whole."""
    _run_on_the_gpu(tmp_path, "ripples-smart", "--ranks-per-worker", "2", *rounds, "--",
                    "python", SHARDED, "-", "20")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("protocol", ["lap-sgd", "lpp-sgd"])
def test_lap_and_lpp_updaters_share_a_cuda_model(protocol: str, tmp_path: Path) -> None:
    """The runner-only protocols: each worker's updater processes share its model on the
    GPU (bind_parameters over the worker's flat CUDA buffer)."""
    _run_on_the_gpu(tmp_path, protocol, "--task", "digits", "--iterations", "60")


def _background_member(rank: int, port: int, form: str, out: mp.Queue) -> None:
    """A background P-Reduce among 3 ranks on the GPU (`form`: of the state, or the int8
    wire's outer step from one shared start), with an update made while it is in
    flight, started and landed with any host-device synchronisation an error."""
    from ripples.worker.dataplane.background import BackgroundAverage

    torch.set_num_threads(1)
    device = _device("cuda", rank)
    factory = CommunicatorFactory(connect_store("127.0.0.1", port, TIMEOUT), device, TIMEOUT)
    comm = factory.build("background", rank, 3, peers_within=TIMEOUT)
    state = AveragedState(_model(0 if form == "int8" else rank).to(device))
    outer = None
    if form == "int8":
        outer = OuterState(state, lr=0.7, momentum=0.5, compression="int8")
        with torch.no_grad():
            outer.take_anchor()
            state.flat.mul_(1.0 + 0.01 * rank)  # a made-up round of local progress
        outer.record_step()
    started_from = state.flat.cpu().clone()
    update = torch.full_like(state.flat, 1e-3 * (rank + 1))
    background = BackgroundAverage(state, outer)
    background.start(comm, TIMEOUT)  # the first: NCCL sets its communicator up
    background.wait()
    torch.cuda.synchronize()
    with torch.no_grad():
        state.flat.copy_(started_from.to(device))
    if outer is not None:
        outer.record_step()  # the round again, from the anchor the first one left
    torch.cuda.set_sync_debug_mode("error")
    try:
        background.start(comm, TIMEOUT)
        with torch.no_grad():
            state.flat.add_(update)  # the steps taken meanwhile
        background.wait()  # on a GPU: enqueued after the collective, no host wait
    finally:
        torch.cuda.set_sync_debug_mode("default")
    anchor = [] if outer is None else outer.anchor.cpu().tolist()
    out.put((rank, started_from.tolist(), state.flat.cpu().tolist(), anchor))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", ["state", "int8"])
def test_a_background_p_reduce_lands_on_the_gpu_without_a_host_sync(form: str) -> None:
    results = {rank: rest for rank, *rest in run_members(
        _background_member, 3, form, replies=3, timeout_seconds=TIMEOUT)}
    if form == "int8":  # every member's anchor the same bits; the update on top of it
        anchors = [torch.tensor(results[r][2]) for r in range(3)]
        n = anchors[0].numel()
        for rank, (_, end, anchor) in results.items():
            assert torch.equal(torch.tensor(anchor), anchors[0])
            torch.testing.assert_close(torch.tensor(end)[:n], anchors[0] + 1e-3 * (rank + 1),
                                       rtol=1e-5, atol=1e-5)
        return
    mean = sum(torch.tensor(start) for start, _, _ in results.values()) / 3
    for rank, (_, end, _) in results.items():
        torch.testing.assert_close(torch.tensor(end), mean + 1e-3 * (rank + 1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gate_reads_a_gpu_flag_without_waiting_for_the_device() -> None:
    from ripples.worker.dataplane.nonfinite import NonfiniteWatch, nonfinite_flag

    values = torch.randn(1 << 20, device="cuda")
    watch = NonfiniteWatch()
    watch.note(0, nonfinite_flag(values))  # the first note allocates its pinned slot
    assert watch.drain() is None
    # Poisoned before the mode is set: writing a Python scalar into a CUDA tensor is itself
    # a host-to-device copy, which the mode would count against the gate. Its flag is still
    # computed (and its note taken) while the stream is busy, below.
    poisoned = values.clone()
    poisoned[12345] = float("nan")
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync raises from here on
    try:
        torch.cuda._sleep(200_000_000)  # the stream is busy for a while: nothing is done
        watch.note(1, nonfinite_flag(values))
        assert watch.first_flagged() is None and watch.unread == 1  # not waited for
        watch.note(2, nonfinite_flag(poisoned))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert watch.drain() == 2
