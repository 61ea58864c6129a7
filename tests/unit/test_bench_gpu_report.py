"""The GPU bench's arithmetic and goal checks on figures as a GPU run reports them (the
CPU run counts no synchronisations: this is where their path is checked)."""

from __future__ import annotations

import dataclasses

import pytest

from ripples.bench import gpu
from ripples.bench.gpu_rank import Measured, RankSettings
from ripples.bench.gpu_report import Outcome, goal_lines, report_lines, rows
from ripples.bench.gpu_syncs import (
    LOSS_READ_RANGE,
    STEP_RANGE,
    TracedCall,
    count_blocking_calls,
    is_blocking_call,
)

STEPS = 48


def _measured(label: str, rank: int, seconds: float, *, syncs: int = 0,
              other_seconds: float | None = None, blocking: int = 0) -> Measured:
    loss_reads = STEPS // 16
    profiled = 16
    return Measured(
        step_host_seconds=seconds / 4 * STEPS, profiled_steps=profiled,
        blocking_calls=blocking, loss_read_blocking_calls=1,
        blocking_sites={"cudaStreamSynchronize": blocking,
                        "loss read: cudaStreamSynchronize": 1},
        label=label, rank=rank, device_name="NVIDIA H200", parameters=100, gradient_bytes=400,
        window_seconds=[seconds * 1.1, seconds, seconds * 0.9], timed_steps=STEPS,
        syncs=syncs, loss_read_syncs=loss_reads,
        sync_sites={"gate @ averaged_state.py:1": syncs, "loss @ optimizer.py:2": loss_reads},
        step_times=None if other_seconds is None else {
            "steps": STEPS, "local_seconds": 0.0, "sync_seconds": 0.0,
            "injected_seconds": 0.0, "other_seconds": other_seconds * STEPS})


def test_rows_and_goals_from_a_gpu_run() -> None:
    configs = gpu.configurations(2, 8)
    outcomes = [
        Outcome(config=configs["single"], measured=[
            _measured("plain", 0, 0.010), _measured("ripples.Optimizer", 0, 0.0105)]),
        Outcome(config=configs["plain"], measured=[_measured("plain", r, 0.040)
                                                   for r in (0, 1)]),
        Outcome(config=configs["ddp"], measured=[_measured("ddp", r, 0.200) for r in (0, 1)]),
        Outcome(config=configs["smart"], bytes_per_step=1204.0, measured=[
            _measured("ripples", r, 0.400, syncs=STEPS, other_seconds=0.004, blocking=8)
            for r in (0, 1)]),
        Outcome(config=configs["smart-overlap"], bytes_per_step=1204.0, measured=[
            _measured("ripples", r, 0.048, other_seconds=0.0024) for r in (0, 1)]),
        Outcome(config=configs["smart-local-bf16"], status="failed: timed out after 120 s"),
        Outcome(config=configs["smart-local-bf16-overlap"],
                status="skipped: this ripples has no --overlap"),
    ]
    table = rows(outcomes, 2, "cuda")
    by_label = {r.label: r for r in table}
    single = by_label["1 process: ripples.Optimizer"]
    assert single.ratio == pytest.approx(1.05) and single.bytes_per_step == 0
    assert single.syncs_per_step == 0 and single.loss_reads_per_step == 1 / 16
    assert single.bookkeeping is None  # single-process mode: no synchronisation to account
    assert by_label["2 ranks: plain, no communication"].ratio == 1.0
    ddp = by_label["2 ranks: DDP"]
    assert ddp.ratio == pytest.approx(5.0) and ddp.bytes_per_step == 400
    smart = by_label["2 ranks: ripples-smart"]
    assert smart.ms_per_step == pytest.approx(400) and smart.ratio == pytest.approx(10)
    assert smart.syncs_per_step == 1.0 and smart.bookkeeping == pytest.approx(0.01)
    assert smart.host_step_ms == pytest.approx(100)
    assert smart.blocking_per_step == pytest.approx(0.5)  # 8 calls in each rank's 16 steps
    assert smart.loss_read_blocking_per_step == pytest.approx(1 / 16)
    assert smart.blocking_sites == {"cudaStreamSynchronize": 16,
                                    "loss read: cudaStreamSynchronize": 2}
    assert smart.sync_sites["gate @ averaged_state.py:1"] == 2 * STEPS
    overlap = by_label["2 ranks: ripples-smart overlap"]
    assert overlap.ratio == pytest.approx(1.2) and overlap.bookkeeping == pytest.approx(0.05)
    assert by_label["2 ranks: ripples-smart H=8 bf16"].status.startswith("failed")

    goals = "\n".join(goal_lines(table, "cuda"))
    assert "1 process: ripples.Optimizer 0.000 (met); 2 ranks: ripples-smart 1.000 (NOT met)" \
        in goals
    assert "2 ranks: ripples-smart 1.00% (met); 2 ranks: ripples-smart overlap 5.00% (NOT met)" \
        in goals
    assert ("in the profiler, loss read-back apart (goal 0): 1 process: ripples.Optimizer "
            "0.000 (met); 2 ranks: ripples-smart 0.500 (NOT met)") in goals
    assert ("(DDP's: 0.000 MB): 2 ranks: ripples-smart overlap 1.20x at 0.001 MB (3.01x "
            "DDP's) (met)") in goals
    assert "2 ranks: ripples-smart H=8 bf16 overlap: skipped: this ripples has no --overlap" \
        in goals
    printed = report_lines(RankSettings(), 2, outcomes, table)
    assert printed[0].startswith("NVIDIA H200: GPT of 0.00M parameters")
    assert "2 ranks: ripples-smart H=8 bf16          failed: timed out after 120 s" in printed
    assert any(line.startswith("2 ranks: ripples-smart overlap ") and line.endswith("5.00%")
               for line in printed)


def test_ratios_wait_for_their_plain_step_and_a_missing_one_is_said() -> None:
    configs = gpu.configurations(2, 8)
    outcomes = [Outcome(config=configs["smart-overlap"], bytes_per_step=8.0,
                        measured=[_measured("ripples", r, 0.05) for r in (0, 1)])]
    (row,) = rows(outcomes, 2, "cpu")
    assert row.ratio is None and row.syncs_per_step is None
    goals = goal_lines([row], "cpu")
    assert "not counted on the CPU" in goals[1]
    assert goals[-1] == ("  2 ranks: ripples-smart overlap: no plain step to compare with "
                         "(--configs plain)")
    assert row.blocking_per_step is None and row.host_step_ms == pytest.approx(12.5)


def test_a_failed_profiler_leaves_the_blocking_count_unknown_and_says_why() -> None:
    configs = gpu.configurations(2, 8)
    broken = [dataclasses.replace(_measured("ripples", r, 0.05), blocking_calls=None,
                                  profiler_error="RuntimeError: CUPTI unavailable")
              for r in (0, 1)]
    (row,) = rows([Outcome(config=configs["smart"], measured=broken)], 2, "cuda")
    assert row.blocking_per_step is None and row.syncs_per_step == 0
    assert "  2 ranks: ripples-smart: profiler failed: RuntimeError: CUPTI unavailable" \
        in goal_lines([row], "cuda")


def test_blocking_calls_are_counted_inside_steps_with_the_loss_read_apart() -> None:
    events = [
        TracedCall(STEP_RANGE, 0, 100), TracedCall(STEP_RANGE, 200, 300),
        TracedCall(LOSS_READ_RANGE, 80, 100),
        TracedCall("cudaLaunchKernel", 10, 11),  # not blocking
        TracedCall("cudaMemcpyAsync", 12, 13),  # asynchronous
        TracedCall("cudaStreamSynchronize", 20, 30),  # Ripples' own, inside a step
        TracedCall("cudaMemcpy_v3020", 210, 220),  # a synchronous copy (versioned name)
        TracedCall("cuEventSynchronize", 230, 240),
        TracedCall("cudaStreamSynchronize", 85, 90),  # the loss read-back
        TracedCall("cudaStreamSynchronize", 150, 160),  # between steps: the window's
    ]
    sites, loss_reads = count_blocking_calls(events)
    assert loss_reads == 1
    assert sites == {"cudaStreamSynchronize": 1, "cudaMemcpy_v3020": 1,
                     "cuEventSynchronize": 1, "loss read: cudaStreamSynchronize": 1}
    assert is_blocking_call("cudaDeviceSynchronize") and is_blocking_call("cuMemcpyDtoH_v2")
    assert not is_blocking_call("cudaMemcpy2DAsync") and not is_blocking_call("cudaEventQuery")
