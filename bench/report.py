"""The results of `ripples bench`: ratios, medians and tables.

Over every run's record (bench/bench_run.py): the ratios to allreduce in the same
scenario and repeat, the medians over repeats (one row per scenario and protocol, with
the ratios to the protocol's own homogeneous run), the text table the command prints,
the Markdown table of docs/benchmarks.md, and results.json.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from ripples.bench.bench_run import RunRecord
from ripples.bench.matrix import HarnessConfig, config_dict


def _median(values: list[float | None]) -> float | None:
    """The median of the values that are not None (None if none is)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def add_speedups(records: list[RunRecord]) -> None:
    """Fill in every record's ratios to allreduce, in place.

    speedup_vs_allreduce = allreduce's time to target / this run's, in the same scenario
    and repeat (so with the same seed), and throughput_vs_allreduce = this run's samples
    per second / allreduce's; the median over repeats goes in the table.

    Args:
        records: Every run's record, allreduce's among them (else no ratio).
    """
    for rec in records:
        same = [r for r in records if (r.scenario, r.repeat) == (rec.scenario, rec.repeat)
                and r.protocol == "allreduce"]
        base = _median([r.time_to_target_seconds for r in same])
        if base is not None and rec.time_to_target_seconds:
            rec.speedup_vs_allreduce = base / rec.time_to_target_seconds
        base = _median([r.samples_per_second for r in same])
        if base and rec.samples_per_second is not None:
            rec.throughput_vs_allreduce = rec.samples_per_second / base


def _loss_at(record: RunRecord, steps: float) -> float | None:
    """The record's mean training loss when an average worker had taken `steps` steps
    (between two points of its curve: the straight line through them)."""
    points = list(zip(record.loss_curve_iterations, (p[1] for p in record.loss_curve),
                      strict=False))
    for (i0, l0), (i1, l1) in zip(points, points[1:], strict=False):
        if i0 <= steps <= i1:
            return l0 if i1 == i0 else l0 + (l1 - l0) * (steps - i0) / (i1 - i0)
    return points[-1][1] if points and points[-1][0] == steps else None


def add_equal_step_losses(records: list[RunRecord]) -> None:
    """Fill in every record's loss at equal steps, in place: in each scenario and repeat,
    at the fewest steps any run of it reached (runs stop at the target, so a system
    that needs more steps per unit of loss is compared where the others are too).

    Args:
        records: Every run's record (those without an iteration curve are left out).
    """
    for rec in records:
        same = [r for r in records if (r.scenario, r.repeat) == (rec.scenario, rec.repeat)
                and r.loss_curve_iterations]
        if not rec.loss_curve_iterations or not same:
            continue
        rec.equal_steps = min(r.loss_curve_iterations[-1] for r in same)
        rec.loss_at_equal_steps = _loss_at(rec, rec.equal_steps)


def medians(records: list[RunRecord]) -> list[dict]:
    """The table's rows: medians over repeats.

    Args:
        records: Every run's record (their ratios to allreduce filled in).

    Returns:
        One row per (scenario, protocol), in the records' order: the median of every
        numeric field over the repeats, how many runs and how many reached the target,
        and each protocol's epoch and others' iteration times over its homogeneous ones.
    """
    keys = list(dict.fromkeys((r.scenario, r.protocol) for r in records))
    numeric = ["time_to_target_seconds", "seconds_per_epoch", "iterations_to_target",
               "final_loss", "final_train_loss", "seconds_per_iteration",
               "compute_seconds_per_iteration", "wait_seconds_per_iteration",
               "preduce_seconds_per_iteration", "speedup_vs_allreduce",
               "consensus_distance_mean", "consensus_distance_final",
               "others_seconds_per_iteration", "samples_per_second",
               "throughput_vs_allreduce", "bytes_per_worker_step", "compute_utilization",
               "equal_steps", "loss_at_equal_steps"]
    rows = []
    for scenario, protocol in keys:
        runs = [r for r in records if (r.scenario, r.protocol) == (scenario, protocol)]
        row: dict[str, object] = {"scenario": scenario, "protocol": protocol,
                                  "runs": len(runs),
                                  "reached_target": sum(r.time_to_target_seconds is not None
                                                        for r in runs)}
        for name in numeric:
            row[name] = _median([getattr(r, name) for r in runs])
        rows.append(row)
    for name, ratio in (("seconds_per_epoch", "epoch_time_vs_homogeneous"),
                        ("others_seconds_per_iteration", "others_iteration_time_vs_homogeneous")):
        homogeneous = {row["protocol"]: row[name] for row in rows
                       if row["scenario"] == "homogeneous"}
        for row in rows:
            base, value = homogeneous.get(row["protocol"]), row[name]
            row[ratio] = (value / base if isinstance(base, float) and isinstance(value, float)
                          else None)
    return rows



def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _percent(value: object) -> str:
    return "-" if value is None else f"{float(value):.0%}"  # type: ignore[arg-type]


def _at_steps(row: dict) -> str:
    """'LOSS@STEPS' of a row (the median loss at the median equal step count)."""
    loss, steps = row.get("loss_at_equal_steps"), row.get("equal_steps")
    return "-" if loss is None or steps is None else f"{loss:.3f}@{steps:.0f}"


def format_bytes(value: object) -> str:
    """A byte count with its unit (kB = 1000 B), three significant digits; "-" for None
    (a system whose bytes are not counted, or a record from before they were)."""
    if value is None:
        return "-"
    size = float(value)  # type: ignore[arg-type]
    for unit in ("B", "kB", "MB"):
        if abs(size) < 999.5:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} GB"


def format_table(rows: list[dict]) -> str:
    """The medians as the text table `ripples bench` prints.

    'vs homog': epoch time over the protocol's own homogeneous one; 'others': the same
    for the iteration time of the workers that the scenario does not slow in every
    iteration; 'thruput': samples per second over allreduce's; 'bytes/step': what a
    worker fed into its collectives per step; a consensus-distance column (mean of the
    run's estimates) when some protocol gossiped.

    Args:
        rows: The medians (`medians`).

    Returns:
        The table, a header line and one line per row.
    """
    gossip = any(row.get("consensus_distance_mean") is not None for row in rows)
    lines = [f"{'scenario':<12} {'protocol':<18} {'to target':>10} {'speedup':>8} "
             f"{'s/epoch':>8} {'vs homog':>8} {'others':>7} {'iters':>7} {'s/iter':>7} "
             f"{'compute':>8} {'wait':>6} {'preduce':>8} {'samples/s':>9} {'thruput':>7} "
             f"{'bytes/step':>10} {'util':>5} {'loss@steps':>12}"
             + (f" {'consensus':>10}" if gossip else "")]
    for row in rows:
        lines.append(
            f"{row['scenario']:<12} {row['protocol']:<18} "
            f"{_fmt(row['time_to_target_seconds'], '.1f'):>9}s "
            f"{_ratio(row['speedup_vs_allreduce']):>8} "
            f"{_fmt(row['seconds_per_epoch'], '.2f'):>8} "
            f"{_ratio(row['epoch_time_vs_homogeneous']):>8} "
            f"{_ratio(row.get('others_iteration_time_vs_homogeneous')):>7} "
            f"{_fmt(row['iterations_to_target'], '.0f'):>7} "
            f"{_fmt(row['seconds_per_iteration'], '.3f'):>7} "
            f"{_fmt(row['compute_seconds_per_iteration'], '.3f'):>8} "
            f"{_fmt(row['wait_seconds_per_iteration'], '.3f'):>6} "
            f"{_fmt(row['preduce_seconds_per_iteration'], '.3f'):>8} "
            f"{_fmt(row.get('samples_per_second'), '.0f'):>9} "
            f"{_ratio(row.get('throughput_vs_allreduce')):>7} "
            f"{format_bytes(row.get('bytes_per_worker_step')):>10} "
            f"{_percent(row.get('compute_utilization')):>5} "
            f"{_at_steps(row):>12}"
            + (f" {_fmt(row.get('consensus_distance_mean'), '.3g'):>10}" if gossip else ""))
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    """The medians as the Markdown table of docs/benchmarks.md.

    Args:
        rows: The medians (`medians`).

    Returns:
        The table (a run that missed the target says how many of its repeats reached it).
    """
    gossip = any(row.get("consensus_distance_mean") is not None for row in rows)
    head = ["scenario", "protocol", "to target", "iterations", "s/iter", "compute", "wait",
            "P-Reduce", "speedup vs allreduce", "epoch time vs own homogeneous",
            "others' s/iter vs own homogeneous", "samples/s", "throughput vs allreduce",
            "bytes per worker per step", "compute utilization", "loss at equal steps"]
    head += ["consensus distance (mean)"] if gossip else []
    lines = ["| " + " | ".join(head) + " |",
             "|---|---|" + "---:|" * (len(head) - 2)]
    for row in rows:
        ttt = row["time_to_target_seconds"]
        cells = [row["scenario"], row["protocol"],
                 f"{ttt:.1f} s" if ttt is not None else
                 f"not reached ({row['reached_target']}/{row['runs']})",
                 _fmt(row["iterations_to_target"], ".0f"),
                 _fmt(row["seconds_per_iteration"], ".3f"),
                 _fmt(row["compute_seconds_per_iteration"], ".3f"),
                 _fmt(row["wait_seconds_per_iteration"], ".3f"),
                 _fmt(row["preduce_seconds_per_iteration"], ".3f"),
                 _ratio(row["speedup_vs_allreduce"]),
                 _ratio(row["epoch_time_vs_homogeneous"]),
                 _ratio(row.get("others_iteration_time_vs_homogeneous")),
                 _fmt(row.get("samples_per_second"), ".0f"),
                 _ratio(row.get("throughput_vs_allreduce")),
                 format_bytes(row.get("bytes_per_worker_step")),
                 _percent(row.get("compute_utilization")), _at_steps(row)]
        if gossip:
            cells.append(_fmt(row.get("consensus_distance_mean"), ".3g"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(cfg: HarnessConfig, records: list[RunRecord], rows: list[dict]) -> Path:
    """Write OUTPUT/results.json: the configuration, the medians and every record.

    Returns:
        The file's path.
    """
    path = cfg.output / "results.json"
    path.write_text(json.dumps({"config": config_dict(cfg), "medians": rows,
                                "records": [asdict(r) for r in records]}, indent=2) + "\n")
    return path

