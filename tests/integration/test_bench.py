"""The benchmarks run end to end on tiny settings, so they cannot rot between releases."""

from __future__ import annotations

import pytest

from ripples.bench import iteration_time, preduce

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


def test_iteration_time_summary_relates_protocols_and_scenarios() -> None:
    def result(scenario: str, protocol: str, seconds: float) -> iteration_time.RunResult:
        return iteration_time.RunResult(scenario=scenario, protocol=protocol,
                                        seconds_per_iteration=seconds, compute=seconds / 2,
                                        wait=0.0, preduce=seconds / 2)

    rows = iteration_time.summarise([
        result("homogeneous", "allreduce", 1.0), result("homogeneous", "ripples-smart", 0.8),
        result("slow", "allreduce", 4.0), result("slow", "ripples-smart", 1.0),
        result("slow", "ripples-smart", 1.2),
    ])
    by_key = {(r["scenario"], r["protocol"]): r for r in rows}
    smart_slow = by_key[("slow", "ripples-smart")]
    assert smart_slow["seconds_per_iteration"] == pytest.approx(1.1)  # median of two runs
    assert smart_slow["vs_allreduce"] == pytest.approx(1.1 / 4.0)
    assert smart_slow["vs_own_homogeneous"] == pytest.approx(1.1 / 0.8)


def test_iteration_time_benchmark_runs_one_tiny_matrix() -> None:
    cfg = iteration_time.IterationBenchConfig(workers=2, protocols=("allreduce",), task="digits",
                                              iterations=3, repeats=1, slowdown=2.0)
    results = iteration_time.run(cfg)
    assert [(r.scenario, r.protocol) for r in results] == [
        ("homogeneous", "allreduce"), ("rank 0 2x slower", "allreduce")]
    assert all(r.seconds_per_iteration > 0 and r.compute > 0 for r in results)
