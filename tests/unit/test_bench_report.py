"""Unit tests of the benchmark harness's scenarios and its arithmetic over run records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ripples.bench import harness
from ripples.bench.bench_run import RunRecord
from ripples.sim.scenarios import SCENARIOS


def test_scenarios_translate_to_slowdown_flags() -> None:
    assert SCENARIOS["homogeneous"].slowdown_flags(8) == []
    assert SCENARIOS["slow-5x"].slowdown_flags(8) == ["--slowdown", "0:5"]
    assert SCENARIOS["slow-4x"].slowed_ranks() == {0}
    assert SCENARIOS["random-6x"].slowed_ranks() == SCENARIOS["homogeneous"].slowed_ranks() == set()
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
    for rec, rate in zip(records, (100.0, 150.0, 20.0, 30.0, 80.0, 90.0), strict=True):
        rec.samples_per_second = rate
    harness.add_speedups(records)
    assert records[1].throughput_vs_allreduce == pytest.approx(1.5)
    assert records[5].throughput_vs_allreduce == pytest.approx(3.0)  # repeat 1: vs 30
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


def test_matrix_entries_become_run_commands(tmp_path: Path) -> None:
    cfg = harness.HarnessConfig(topology="ring", rate_com=0.5)
    homogeneous = SCENARIOS["homogeneous"]

    def flags(protocol: str) -> list[str]:
        cmd = harness.run_command(cfg, homogeneous, protocol, 0, tmp_path)
        return cmd[cmd.index("--protocol"):cmd.index("--target-loss")]

    # A variant runs its protocol with its flags, on the topology, at the common rate.
    assert flags("a2cid2-no-momentum") == ["--protocol", "a2cid2", "--no-momentum",
                                           "--topology", "ring", "--rate-com", "0.5"]
    assert flags("adpsgd") == ["--protocol", "adpsgd", "--topology", "ring", "--rate-com", "0.5"]
    assert flags("ripples-smart") == ["--protocol", "ripples-smart", "--topology", "ring"]
    # Lockstep protocols synchronise everyone: no topology for them.
    assert flags("allreduce") == ["--protocol", "allreduce"]
    assert "a2cid2-no-momentum" in harness.HarnessConfig().protocols  # joins the matrix
    assert flags("hop-skip") == ["--protocol", "hop", "--hop-mode", "backup",
                                 "--backup-workers", "1", "--max-jump", "4",
                                 "--topology", "ring"]
    assert flags("lpp-sgd-smart") == ["--protocol", "lpp-sgd", "--lpp-averaging", "ripples-smart"]
    assert flags("ripples-smart-overlap") == ["--protocol", "ripples-smart", "--overlap",
                                              "--topology", "ring"]
    # DiLoCo in Ripples runs the torchft-diloco peer's H and outer step, its overrides too.
    assert flags("allreduce-diloco") == ["--protocol", "allreduce", "--local-steps", "8",
                                         "--outer-optimizer", "nesterov", "--outer-lr", "0.7",
                                         "--outer-momentum", "0.5"]
    cfg.peer_settings = {"torchft-diloco": {"sync_every": 4, "outer_lr": 1.0}}
    assert flags("allreduce-diloco") == ["--protocol", "allreduce", "--local-steps", "4",
                                         "--outer-optimizer", "nesterov", "--outer-lr", "1",
                                         "--outer-momentum", "0.5"]
    # So do the group forms: the same H and outer step on every such row.
    assert flags("ripples-smart-outer") == ["--protocol", "ripples-smart", "--local-steps",
                                            "4", "--outer-optimizer", "nesterov",
                                            "--outer-lr", "1", "--outer-momentum", "0.5",
                                            "--topology", "ring"]
    assert flags("adpsgd-outer")[:4] == ["--protocol", "adpsgd", "--local-steps", "4"]
    overlap = flags("ripples-smart-int8-overlap")  # rounds of 2H, here 8
    assert overlap[2:4] == ["--local-steps", "8"]
    assert overlap[-5:] == ["--outer-compression", "int8", "--overlap", "--topology", "ring"]
    # The stretched all-worker form: the outer lr is √N of the bench's workers.
    assert flags("allreduce-stretch") == ["--protocol", "allreduce", "--local-steps", "1",
                                          "--outer-optimizer", "nesterov", "--outer-lr",
                                          "2.828", "--outer-momentum", "0"]  # 8 workers
    cfg.workers = 4
    assert flags("allreduce-stretch")[6:8] == ["--outer-lr", "2"]


def test_the_others_iteration_time_leaves_out_the_deterministic_straggler() -> None:
    """Hop §7.3.5's measure: the iteration time of the workers a scenario does not slow,
    against the same protocol's homogeneous run."""
    def summary(iterations: list[int], wall: float) -> dict:
        return {"protocol": "hop", "workers": [
                    {"rank": r, "iterations": n, "compute_seconds": 1.0, "wait_seconds": 0.0,
                     "preduce_seconds": 0.0} for r, n in enumerate(iterations)],
                "time_to_target_seconds": wall, "seconds_per_epoch": 1.0,
                "iterations_to_target": 10.0, "final_loss": 1.0, "final_train_loss": 1.0,
                "wall_seconds": wall, "loss_curve": []}

    homogeneous = harness.record_from_summary(summary([100, 100, 100], 10.0),
                                              SCENARIOS["homogeneous"], 0, "hop-skip")
    straggler = harness.record_from_summary(summary([25, 90, 110], 10.0),
                                            SCENARIOS["slow-4x"], 0, "hop-skip")
    assert homogeneous.others_seconds_per_iteration == pytest.approx(0.1)
    assert straggler.others_seconds_per_iteration == pytest.approx(10.0 / 100)  # 90, 110
    assert straggler.seconds_per_iteration == pytest.approx(10.0 / 75)
    rows = {r["scenario"]: r for r in harness.medians([homogeneous, straggler])}
    assert rows["slow-4x"]["others_iteration_time_vs_homogeneous"] == pytest.approx(1.0)
    assert "1.00x" in harness.format_markdown([rows["slow-4x"]])


@pytest.mark.parametrize(("change", "message"), [
    ({"topology": "file"}, "unknown topology 'file'"),
    ({"topology": "torus"}, "unknown topology 'torus'"),
    ({"rate_com": 0.0}, "rate_com must be in (0, 100]"),
    ({"protocols": ("a2cid2-no-nothing",)}, "a2cid2-no-momentum"),
    ({"device": "tpu"}, "device must be one of cpu, cuda, got 'tpu'"),
    ({"device": "cuda", "protocols": ("allreduce", "torchft")},
     "device cuda runs Ripples' protocols only: the peers (torchft) train on the CPU"),
])
def test_harness_config_names_what_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        harness.HarnessConfig(**change).validate()
    assert message in str(exc.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_the_gpu_bench_is_refused_where_there_is_no_gpu() -> None:
    with pytest.raises(ValueError, match="device cuda: this machine has no CUDA device"):
        harness.HarnessConfig(device="cuda", protocols=("allreduce",)).validate()


def test_resume_accepts_a_bench_from_before_an_option_existed(tmp_path: Path) -> None:
    cfg = harness.HarnessConfig(output=tmp_path)
    old = harness.config_dict(cfg)
    del old["topology"], old["rate_com"]  # written by a version without these options
    (tmp_path / harness.CONFIG_FILE).write_text(json.dumps(old))
    (tmp_path / harness.RECORDS_FILE).write_text("")
    assert harness.load_finished(cfg) == []
    with pytest.raises(ValueError, match="topology='complete'"):
        harness.load_finished(harness.HarnessConfig(output=tmp_path, topology="ring"))


def test_table_shows_consensus_distance_only_when_a_protocol_gossiped() -> None:
    row = {"scenario": "homogeneous", "protocol": "allreduce", "time_to_target_seconds": 9.0,
           "speedup_vs_allreduce": 1.0, "seconds_per_epoch": 2.0,
           "epoch_time_vs_homogeneous": 1.0, "iterations_to_target": 10.0,
           "seconds_per_iteration": 0.1, "compute_seconds_per_iteration": 0.05,
           "wait_seconds_per_iteration": 0.0, "preduce_seconds_per_iteration": 0.05,
           "consensus_distance_mean": None}
    assert "consensus" not in harness.format_table([row])
    gossip = {**row, "protocol": "a2cid2", "consensus_distance_mean": 0.0123}
    table = harness.format_table([row, gossip])
    assert "consensus" in table and "0.0123" in table.splitlines()[2]


def test_markdown_table_has_a_row_per_median_and_marks_missed_targets() -> None:
    row = {"scenario": "slow-10x", "protocol": "a2cid2", "time_to_target_seconds": None,
           "runs": 2, "reached_target": 0, "speedup_vs_allreduce": None,
           "seconds_per_epoch": 2.0, "epoch_time_vs_homogeneous": 1.04,
           "iterations_to_target": None, "seconds_per_iteration": 0.1,
           "compute_seconds_per_iteration": 0.05, "wait_seconds_per_iteration": 0.0,
           "preduce_seconds_per_iteration": 0.05, "consensus_distance_mean": 0.5}
    lines = harness.format_markdown([row]).splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| slow-10x | a2cid2 | not reached (0/2) | - |" in lines[2]
    # ... bytes per step, compute utilization, loss at equal steps, consensus
    assert "| 1.04x | - | - | - | - | - | - | 0.5 |" in lines[2]


def test_a_script_workload_runs_the_script_after_the_run_options(tmp_path: Path) -> None:
    cfg = harness.HarnessConfig(task="transformer-lm", max_steps=300, batch_size=8)
    cmd = harness.run_command(cfg, SCENARIOS["slow-5x"], "ripples-smart", 1, tmp_path)
    options, script = cmd[:cmd.index("--")], cmd[cmd.index("--") + 1:]
    assert "--task" not in options and "--epochs" not in options  # the script's own loop
    assert options[options.index("--slowdown") + 1] == "0:5"
    assert script[:3] == ["python", "-m", "ripples.examples.transformer_lm"]
    assert script[-6:] == ["--steps", "300", "--seed", "1", "--batch-size", "8"]


def _curve_record(protocol: str, points: list[tuple[float, float, float]]) -> RunRecord:
    record = harness.record_from_summary(
        {"protocol": protocol, "time_to_target_seconds": points[-1][0],
         "seconds_per_epoch": 1.0, "iterations_to_target": points[-1][2], "final_loss": None,
         "final_train_loss": points[-1][1], "wall_seconds": 10.0,
         "loss_curve": [[t, loss] for t, loss, _ in points],
         "loss_curve_iterations": [it for _, _, it in points],
         "workers": [{"rank": r, "iterations": 50, "compute_seconds": 2.5,
                      "wait_seconds": 0.0, "preduce_seconds": 7.5} for r in range(2)]},
        SCENARIOS["homogeneous"], 0, network="slow")
    return record


def test_runs_are_compared_at_the_fewest_steps_any_of_them_took() -> None:
    fast = _curve_record("allreduce", [(1.0, 3.0, 10.0), (2.0, 2.0, 30.0)])
    slow = _curve_record("ripples-smart", [(1.0, 3.5, 20.0), (3.0, 2.5, 40.0),
                                           (5.0, 1.0, 90.0)])
    harness.add_equal_step_losses([fast, slow])
    assert fast.equal_steps == slow.equal_steps == 30.0
    assert fast.loss_at_equal_steps == 2.0
    assert slow.loss_at_equal_steps == pytest.approx(3.0)  # halfway from 20 to 40 steps
    # A quarter of the wall time in compute: 2.5 s of 10 s per worker.
    assert fast.compute_utilization == pytest.approx(0.25) and fast.network == "slow"
    row = harness.medians([fast, slow])[1]
    assert "3.000@30" in harness.format_table([row]).splitlines()[1]
    assert "| 25% | 3.000@30 |" in harness.format_markdown([row])


def test_a_shaped_network_reaches_every_run_s_command() -> None:
    from ripples.bench.network import SLOW_MBIT, UNEVEN_FAST_MBIT, link_flags, network_rates
    from ripples.netshape import unavailable_reason

    with pytest.raises(ValueError, match="unknown network 'lan'"):
        network_rates("lan", (), 4)
    assert network_rates("loopback", (), 4) == ()
    assert link_flags([None, 5.0]) == ["--link-mbit", "1:5"]
    if unavailable_reason() is not None:  # the refusal, where namespaces cannot be made
        with pytest.raises(ValueError, match="cannot be made here"):
            network_rates("slow", (), 4)
        return
    assert network_rates("uneven", (), 4) == (UNEVEN_FAST_MBIT,) * 3 + (SLOW_MBIT,)
    assert network_rates("slow", ("0:2.5",), 3) == (2.5, SLOW_MBIT, SLOW_MBIT)
    cfg = harness.HarnessConfig(workers=3, network="slow", link_mbit=("2:7",))
    command = harness.run_command(cfg, SCENARIOS["homogeneous"], "ripples-smart", 0,
                                  Path("out"))
    flags = ["--link-mbit", f"0:{SLOW_MBIT:g}", "--link-mbit", f"1:{SLOW_MBIT:g}",
             "--link-mbit", "2:7"]
    assert any(command[i:i + 6] == flags for i in range(len(command)))
    assert cfg.network_name == "custom"
