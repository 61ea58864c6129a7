"""Time per iteration: Ripples vs All-Reduce, homogeneous and with one straggler.

Runs ``ripples run`` end to end (coordinator + spawned workers on loopback) for every
(scenario, protocol) pair, repeating the whole matrix and interleaving the runs so that
machine noise hits every protocol alike. Time per iteration is the run's training wall
time divided by the iterations of an average worker (total iterations / workers), so a
protocol whose fast workers keep going while a straggler lags gets the credit for it.

    python -m ripples.bench.iteration_time                  # 4 workers, synthetic-cnn
    python -m ripples.bench.iteration_time --slowdown 10 --repeats 3

Prints one row per (scenario, protocol) with the median seconds per iteration, its split
into compute / wait-for-group / P-Reduce (per worker, per iteration), and ratios: to
allreduce in the same scenario, and to the same protocol's homogeneous figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True)
class IterationBenchConfig:
    workers: int = 4
    protocols: tuple[str, ...] = ("allreduce", "ripples-smart")
    task: str = "synthetic-cnn"
    iterations: int = 30
    """Per-worker iteration budget of each run."""
    slowdown: float = 5.0
    """The straggler scenario: rank 0 is this many times slower."""
    repeats: int = 2
    timeout_seconds: float = 600.0


@dataclass(kw_only=True)
class RunResult:
    scenario: str
    protocol: str
    seconds_per_iteration: float
    compute: float
    wait: float
    preduce: float


def _run_once(cfg: IterationBenchConfig, protocol: str, slowdown: list[str],
              output: Path) -> dict:
    cmd = [sys.executable, "-m", "ripples.cli", "run", "--workers", str(cfg.workers),
           "--protocol", protocol, "--task", cfg.task, "--iterations", str(cfg.iterations),
           "--output", str(output), "--quiet", *slowdown]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_seconds)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads((output / "summary.json").read_text())


def _measure(summary: dict, scenario: str) -> RunResult:
    workers = summary["workers"]
    total = sum(w["iterations"] for w in workers)
    per_worker_iters = total / len(workers)

    def split(key: str) -> float:
        return sum(w[key] for w in workers) / total

    return RunResult(scenario=scenario, protocol=summary["protocol"],
                     seconds_per_iteration=summary["wall_seconds"] / per_worker_iters,
                     compute=split("compute_seconds"), wait=split("wait_seconds"),
                     preduce=split("preduce_seconds"))


def run(cfg: IterationBenchConfig) -> list[RunResult]:
    scenarios: dict[str, list[str]] = {
        "homogeneous": [],
        f"rank 0 {cfg.slowdown:g}x slower": ["--slowdown", f"0:{cfg.slowdown:g}"],
    }
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(cfg.repeats):
            for scenario, flags in scenarios.items():
                protocols = cfg.protocols if repeat % 2 == 0 else cfg.protocols[::-1]
                for protocol in protocols:
                    print(f"[{repeat + 1}/{cfg.repeats}] {scenario}: {protocol}",
                          file=sys.stderr, flush=True)
                    out = Path(tmp) / f"{repeat}-{protocol}-{len(results)}"
                    results.append(_measure(_run_once(cfg, protocol, flags, out), scenario))
    return results


def summarise(results: list[RunResult]) -> list[dict]:
    rows = []
    keys = list(dict.fromkeys((r.scenario, r.protocol) for r in results))
    med = {}
    for scenario, protocol in keys:
        runs = [r for r in results if (r.scenario, r.protocol) == (scenario, protocol)]
        med[(scenario, protocol)] = {
            field: statistics.median(getattr(r, field) for r in runs)
            for field in ("seconds_per_iteration", "compute", "wait", "preduce")}
    homogeneous = keys[0][0]
    for scenario, protocol in keys:
        m = med[(scenario, protocol)]
        base = med.get((scenario, "allreduce"))
        own = med[(homogeneous, protocol)]
        rows.append({"scenario": scenario, "protocol": protocol, **m,
                     "vs_allreduce": (m["seconds_per_iteration"] / base["seconds_per_iteration"]
                                      if base else None),
                     "vs_own_homogeneous": (m["seconds_per_iteration"]
                                            / own["seconds_per_iteration"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    defaults = IterationBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--protocols", default=",".join(defaults.protocols))
    parser.add_argument("--task", default=defaults.task)
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument("--slowdown", type=float, default=defaults.slowdown)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.slowdown < 1:
        parser.error("--slowdown must be at least 1")
    cfg = IterationBenchConfig(workers=args.workers, protocols=tuple(args.protocols.split(",")),
                               task=args.task, iterations=args.iterations,
                               slowdown=args.slowdown, repeats=args.repeats)
    rows = summarise(run(cfg))
    print(f"{'scenario':>22} {'protocol':>15} {'s/iter':>7} {'compute':>8} {'wait':>6} "
          f"{'preduce':>8} {'vs allreduce':>13} {'vs homog.':>10}")
    for row in rows:
        vs_ar = f"{row['vs_allreduce']:.2f}x" if row["vs_allreduce"] is not None else "-"
        print(f"{row['scenario']:>22} {row['protocol']:>15} {row['seconds_per_iteration']:>7.3f} "
              f"{row['compute']:>8.3f} {row['wait']:>6.3f} {row['preduce']:>8.3f} "
              f"{vs_ar:>13} {row['vs_own_homogeneous']:>9.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
