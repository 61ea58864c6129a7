"""The benchmarks run end to end on tiny settings, so they cannot rot between releases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ripples.bench import harness, outer_sync, preduce

pytestmark = pytest.mark.slow


def test_preduce_benchmark_measures_every_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert preduce.main(["--group-size", "2", "--sizes", "1000", "--calls", "3",
                         "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    for method in preduce.METHODS:
        assert method in out
    cfg = preduce.BenchConfig(group_size=2, sizes=(1000,), calls=3, rounds=1)
    rows = preduce.report(cfg, preduce.run(cfg))
    assert [row["method"] for row in rows] == list(preduce.METHODS)
    assert all(row["ms_per_call"] > 0 for row in rows) and rows[0]["ratio"] == 1.0


def test_outer_sync_benchmark_times_every_form_and_its_members_agree(
        capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--members", "2", "--d-model", "16", "--layers", "1", "--heads", "1",
            "--block-size", "8", "--batch-size", "2", "--calls", "1", "--rounds", "2"]
    assert outer_sync.main(tiny) == 0  # non-zero if a form's members disagreed
    out = capsys.readouterr().out
    assert all(method in out for method in outer_sync.METHODS)
    cfg = outer_sync.OuterSyncConfig(members=2, d_model=16, layers=1, heads=1, block_size=8,
                                     batch_size=2, calls=1, rounds=1)
    measured = outer_sync.run(cfg)
    rows = {row["method"]: row for row in outer_sync.report(measured)}
    assert list(rows) == list(outer_sync.METHODS)
    p4 = 4 * int(measured["params"])  # type: ignore[call-overload]
    # What each form feeds in: the model's P values, AdamW's two moments, the momentum,
    # and the non-finite flag (float32, or bfloat16 after a compressed pseudo-gradient).
    assert [rows[form]["bytes"] for form in outer_sync.FORMS] == [
        3 * p4 + 4, p4 + 4, 2 * p4 + 4, p4 + p4 // 2 + 4, p4 + 4, p4 // 2 + 2]
    assert rows[outer_sync.BASELINE]["ratio"] == 1.0
    assert all(row["ms"] > 0 for row in rows.values())


def test_bench_runs_a_tiny_matrix_resumes_it_and_writes_results_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gossip baseline (a variant: a2cid2 --no-momentum) on a ring, beside allreduce.
    args = ["--workers", "2", "--workers-per-node", "2", "--topology", "ring",
            "--protocols", "allreduce,a2cid2-no-momentum", "--scenarios",
            "homogeneous,slow-2x", "--task", "digits", "--batch-size", "16",
            "--target-loss", "1.5", "--max-epochs", "3", "--repeats", "1",
            "--output", str(tmp_path)]
    # An interrupted bench: the matrix dies after its first run ...
    real_run_one, calls = harness.run_one, []

    def run_one_then_die(*a: object) -> harness.RunRecord:
        if calls:
            raise KeyboardInterrupt
        calls.append(a)
        return real_run_one(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(harness, "run_one", run_one_then_die)
    with pytest.raises(KeyboardInterrupt):
        harness.main(args)
    monkeypatch.setattr(harness, "run_one", real_run_one)
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 1
    # ... resuming with other options is refused; with the same ones it runs the other 3.
    with pytest.raises(SystemExit):
        harness.main([*args[:-4], "--target-loss", "1.0", *args[-4:], "--resume"])
    assert "target_loss=1.5" in capsys.readouterr().err
    code = harness.main([*args, "--resume"])
    assert code == 0
    captured = capsys.readouterr()
    assert "resuming: 1 of 4 runs" in captured.err
    table = captured.out
    assert "allreduce" in table and "a2cid2-no-momentum" in table and "slow-2x" in table
    results = json.loads((tmp_path / "results.json").read_text())
    records = results["records"]
    assert {(r["scenario"], r["protocol"]) for r in records} == {
        (s, p) for s in ("homogeneous", "slow-2x") for p in ("allreduce", "a2cid2-no-momentum")}
    required = {"scenario", "protocol", "time_to_target_seconds", "seconds_per_epoch",
                "iterations_to_target", "final_loss", "speedup_vs_allreduce"}
    for rec in records:
        assert required <= rec.keys()
        assert rec["time_to_target_seconds"] is not None, rec  # digits reaches 1.5 at once
        assert rec["seconds_per_epoch"] > 0 and rec["iterations_to_target"] > 0
        assert rec["consensus_distance_final"] is not None
    for rec in records:  # the variant ran a2cid2 without momentum, on the ring
        summary = json.loads((tmp_path / "runs" / f"{rec['scenario']}-{rec['protocol']}-0"
                              / "summary.json").read_text())
        gossip = rec["protocol"] == "a2cid2-no-momentum"
        assert summary["protocol"] == ("a2cid2" if gossip else "allreduce")
        assert summary["topology"] == ("ring" if gossip else "complete")
        if gossip:
            assert summary["settings"]["gossip"]["momentum"] is False
        else:
            assert "gossip" not in summary["settings"]
    allreduce = [r for r in records if r["protocol"] == "allreduce"]
    assert all(r["speedup_vs_allreduce"] == pytest.approx(1.0) for r in allreduce)
    for name in ("loss.png", "iteration_split.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_protocols_and_scenarios(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    for flag, value in (("--protocols", "gossip"), ("--scenarios", "slow-3x")):
        with pytest.raises(SystemExit) as exc:
            harness.main([flag, value])
        assert exc.value.code == 2
        assert value in capsys.readouterr().err


def test_coordinator_load_benchmark_counts_requests_and_latencies() -> None:
    from ripples.bench import coordinator_load

    cfg = coordinator_load.LoadConfig(workers=(4,), client_processes=1, warmup_seconds=0.5,
                                      measure_seconds=1.0)
    result = coordinator_load.measure(4, cfg)
    assert result.workers == 4 and result.requests_per_second > 10
    assert 0 < result.request_p50_ms <= result.request_p99_ms
    # The request that completes a group waits for nobody: it is never the slower kind.
    assert 0 < result.service_p50_ms <= result.service_p99_ms
    assert result.service_p50_ms <= result.request_p99_ms
    assert result.groups_per_second > 0
    # Where the CPU went: the coordinator's process and the load generator's both worked.
    assert result.server_cores > 0 and result.client_cores > 0
    assert 0 < result.server_us_per_request < 1e6
    # gRPC's floor under the same generator: a server doing nothing, every request a group.
    floor = coordinator_load.measure(4, cfg, floor=True)
    assert (result.server, floor.server) == ("coordinator", "grpc floor")
    assert floor.requests_per_second > 10 and floor.groups_per_second > 0
    assert 0 < floor.server_us_per_request < 1e6


def test_service_benchmark_times_handovers_against_workers_started_by_hand(
        capsys: pytest.CaptureFixture[str]) -> None:
    from ripples.bench import service

    assert service.main(["--agents", "1", "--slots", "2", "--runs", "2",
                         "--iterations", "20"]) == 0
    out = capsys.readouterr().out
    assert "median handover" in out and "ratio service / by hand:" in out
    ratio = float(out.split("ratio service / by hand: ")[1].split("x")[0])
    assert ratio > 0
