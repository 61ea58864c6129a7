"""PNG plots of a benchmark run (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # no display on benchmark machines
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from ripples.bench.bench_run import RunRecord


def plot_loss_curves(records: list[RunRecord], path: Path, target_loss: float,
                     title: str = "") -> Path:
    """Training loss vs wall time, one panel per scenario, one line per protocol (repeat 0);
    `title` over the panels (the network the runs had)."""
    scenarios = list(dict.fromkeys(r.scenario for r in records))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 3.6),
                             squeeze=False, sharey=True)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for rec in records:
            if rec.scenario == scenario and rec.repeat == 0 and rec.loss_curve:
                seconds, losses = zip(*rec.loss_curve, strict=True)
                ax.plot(seconds, losses, label=rec.protocol, linewidth=1.4)
        ax.axhline(target_loss, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(scenario)
        ax.set_xlabel("wall time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean training loss")
    axes[0][-1].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_iteration_split(rows: list[dict], path: Path) -> Path:
    """Time per iteration split into compute / wait / P-Reduce, grouped by scenario."""
    labels = [f"{row['scenario']}\n{row['protocol']}" for row in rows]
    parts = [("compute_seconds_per_iteration", "compute"),
             ("wait_seconds_per_iteration", "wait for group"),
             ("preduce_seconds_per_iteration", "P-Reduce / all-reduce")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(rows)), 4.2))
    bottom = [0.0] * len(rows)
    for key, name in parts:
        values = [float(row[key] or 0.0) for row in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("seconds per iteration (per worker)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
