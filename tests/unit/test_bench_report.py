"""Unit tests of the benchmark harness's scenarios and its arithmetic over run records."""

from __future__ import annotations

import pytest

from ripples.bench import harness
from ripples.bench.scenarios import SCENARIOS


def test_scenarios_translate_to_slowdown_flags() -> None:
    assert SCENARIOS["homogeneous"].slowdown_flags(8) == []
    assert SCENARIOS["slow-5x"].slowdown_flags(8) == ["--slowdown", "0:5"]
    flags = SCENARIOS["random-6x"].slowdown_flags(4)
    assert flags == [x for r in range(4) for x in ("--slowdown", f"{r}:6@0.25")]


def test_medians_and_speedups_relate_protocols_and_scenarios() -> None:
    def record(scenario: str, protocol: str, ttt: float | None, epoch: float, repeat: int = 0
               ) -> harness.RunRecord:
        return harness.RunRecord(
            scenario=scenario, protocol=protocol, repeat=repeat, time_to_target_seconds=ttt,
            seconds_per_epoch=epoch, iterations_to_target=10.0, final_loss=1.0,
            final_train_loss=1.0, wall_seconds=ttt or 9.0, seconds_per_iteration=0.1,
            compute_seconds_per_iteration=0.05, wait_seconds_per_iteration=0.0,
            preduce_seconds_per_iteration=0.05)

    records = [record("homogeneous", "allreduce", 10.0, 2.0),
               record("homogeneous", "ripples-smart", 8.0, 2.5),
               record("slow-5x", "allreduce", 40.0, 8.0),
               record("slow-5x", "allreduce", 60.0, 9.0, repeat=1),
               record("slow-5x", "ripples-smart", 12.5, 3.0),
               record("slow-5x", "ripples-smart", None, 3.0, repeat=1)]
    harness.add_speedups(records)
    assert records[1].speedup_vs_allreduce == pytest.approx(10.0 / 8.0)
    assert records[4].speedup_vs_allreduce == pytest.approx(40.0 / 12.5)  # same repeat
    assert records[5].speedup_vs_allreduce is None  # never reached the target
    records.append(record("slow-5x", "ripples-static", 30.0, 4.0, repeat=1))
    harness.add_speedups(records)
    assert records[6].speedup_vs_allreduce == pytest.approx(60.0 / 30.0)
    rows = {(r["scenario"], r["protocol"]): r for r in harness.medians(records)}
    slow_smart = rows[("slow-5x", "ripples-smart")]
    assert slow_smart["reached_target"] == 1 and slow_smart["runs"] == 2
    assert slow_smart["epoch_time_vs_homogeneous"] == pytest.approx(3.0 / 2.5)
    assert rows[("slow-5x", "allreduce")]["epoch_time_vs_homogeneous"] == pytest.approx(4.25)
    assert "slow-5x" in harness.format_table(list(rows.values()))
