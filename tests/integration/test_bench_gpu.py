"""`python -m ripples.bench.gpu` end to end on the CPU (gloo, a tiny GPT): every
configuration runs in its processes and gets its row; and a configuration's processes
are stopped, with what they started, at its deadline or at the first failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_for

from ripples.bench import gpu
from ripples.bench.gpu_rank import build_model

RANKS = 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if _alive(pid)]


@pytest.mark.slow
def test_gpu_bench_on_the_cpu_prints_a_row_per_loop_with_numbers(tmp_path: Path) -> None:
    work, results = tmp_path / "work", tmp_path / "bench.json"
    # Two ranks share the CPU (the GPU preset's four would test nothing more here).
    proc = subprocess.run([sys.executable, "-m", "ripples.bench.gpu", "--device", "cpu",
                           "--workers", str(RANKS), "--work-dir", str(work),
                           "--json", str(results)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert not _processes_naming(str(work))  # every rank, worker and coordinator ended
    configs = gpu.configurations(RANKS, gpu.LOCAL_STEPS["cpu"])
    overlap = gpu.has_overlap()
    labels = ["1 process: plain", "1 process: ripples.Optimizer",
              *(c.label for c in configs.values() if c.kind != "single")]
    rows = {r["label"]: r for r in json.loads(results.read_text())["rows"]}
    assert list(rows) == labels
    for label, row in rows.items():
        if row["overlap"] and not overlap:  # not in this branch yet: said, not crashed
            assert row["status"] == "skipped: this ripples has no --overlap"
            assert re.search(rf"^{re.escape(label)}\s+skipped: this ripples has no --overlap$",
                             proc.stdout, re.M)
            continue
        assert row["status"] == "", row
        # Workers of two ranks: 4 processes here, against no plain row of 4.
        sharded = label == configs["smart-sharded"].label
        ratio = "n/a" if sharded else r"\d+\.\d+x"
        assert re.search(rf"^{re.escape(label)}\s+\d+\.\d+\s+{ratio}\s+\d+\.\d+\s",
                         proc.stdout, re.M), (label, proc.stdout)
        assert row["ms_per_step"] > 0
        assert row["ratio"] is None if sharded else row["ratio"] > 0
        assert row["syncs_per_step"] is None  # counted on a GPU only
        assert row["blocking_per_step"] is None and not row["profiler_error"]
        assert row["host_step_ms"] > 0
        if row["kind"] == "plain":
            assert row["ratio"] == 1.0 and row["bytes_per_step"] == 0
    p4 = 4 * sum(p.numel() for p in build_model(gpu.CPU_SETTINGS).parameters())
    assert rows[f"{RANKS} ranks: DDP"]["bytes_per_step"] == p4  # its gradients, every step
    smart = rows[f"{RANKS} ranks: ripples-smart"]
    # At most a P-Reduce of the parameters, both AdamW moments and the flag every step.
    assert 0 < smart["bytes_per_step"] <= 3 * p4 + 4
    local = rows[f"{RANKS} ranks: ripples-smart H={gpu.LOCAL_STEPS['cpu']} bf16"]
    # Every H steps at most: the parameters in float32, the momentum in bfloat16, the flag.
    assert 0 < local["bytes_per_step"] <= (p4 + p4 // 2 + 4) / gpu.LOCAL_STEPS["cpu"]
    # A worker of two ranks: each rank averages its shard, about half the model.
    sharded = rows[configs["smart-sharded"].label]
    assert 0 < sharded["bytes_per_step"] < smart["bytes_per_step"]
    for row in (smart, local, sharded):
        assert 0 <= row["bookkeeping"] < 1
    assert rows["1 process: ripples.Optimizer"]["bookkeeping"] is None  # nothing to sync
    profiled = [m for o in json.loads(results.read_text())["outcomes"] for m in o["measured"]]
    assert profiled and all(m["profiled_steps"] == gpu.CPU_SETTINGS.window_steps
                            for m in profiled)  # every loop ran its profiled window
    assert "goals:" in proc.stdout
    assert ("Ripples' bookkeeping (goal < 3% of a step): "
            f"{RANKS} ranks: ripples-smart") in proc.stdout


def test_a_configuration_is_stopped_with_its_children_at_its_deadline_or_first_failure(
        tmp_path: Path) -> None:
    hung_log, failing_log = tmp_path / "hung.log", tmp_path / "failing.log"
    hang = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            "print(child.pid, flush=True); time.sleep(300)")
    hung = gpu.Command([sys.executable, "-c", hang], dict(os.environ), hung_log)
    started = time.monotonic()
    assert gpu.run_processes([hung], tmp_path, started + 3) == "timed out"
    assert time.monotonic() - started < 3 + gpu.STOP_GRACE_SECONDS
    grandchild = int(hung_log.read_text())
    wait_for(lambda: not _alive(grandchild), "the hung process's child to be killed", 10)
    # One that fails (once the hung one has started its child) stops the others at once.
    fail = (f"import pathlib, time; log = pathlib.Path({str(hung_log)!r})\n"
            "deadline = time.monotonic() + 60\n"
            "while not log.read_text() and time.monotonic() < deadline: time.sleep(0.05)\n"
            "raise SystemExit(3)")
    failing = gpu.Command([sys.executable, "-c", fail], dict(os.environ), failing_log)
    started = time.monotonic()
    failure = gpu.run_processes([hung, failing], tmp_path, started + 120)
    assert failure == "failing exited with code 3"
    assert time.monotonic() - started < 60
    grandchild = int(hung_log.read_text())
    wait_for(lambda: not _alive(grandchild), "the other process's child to be killed", 10)


def test_a_work_dir_holding_an_earlier_run_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plain" / "results").mkdir(parents=True)  # an earlier run's configuration
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--device", "cpu", "--configs", "single,plain", "--work-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "already holds an earlier run's plain" in capsys.readouterr().err


@pytest.mark.slow
def test_to_loss_on_the_cpu_runs_ddp_and_ripples_to_the_target(tmp_path: Path) -> None:
    """--to-loss: the bench's LM, one run each of allreduce, ripples-smart and
    ripples-smart-int8, every one to the (CPU) target within its step cap: the bench's
    table, results and loss plot in the work dir."""
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "ripples.bench.gpu", "--to-loss",
                           "--device", "cpu", "--workers", str(RANKS), "--work-dir",
                           str(work)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    results = json.loads((work / "results.json").read_text())
    protocols = [r["protocol"] for r in results["medians"]]
    assert protocols == list(gpu.TO_LOSS_PROTOCOLS)
    for row in results["medians"]:
        assert row["reached_target"] == 1 and row["time_to_target_seconds"] > 0, row
    assert (work / "loss.png").stat().st_size > 0
    for protocol in gpu.TO_LOSS_PROTOCOLS:
        assert re.search(rf"^\| homogeneous \| {re.escape(protocol)} \| \d+\.\d+ s \|",
                         proc.stdout, re.M), proc.stdout
    again = subprocess.run([sys.executable, "-m", "ripples.bench.gpu", "--to-loss",
                            "--device", "cpu", "--work-dir", str(work)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 2 and "already holds an earlier bench's results" in again.stderr
