"""The fault scenario of the bench: one worker SIGKILLed at 30% of a run and a replacement
started at once, in Ripples and in the peers that heal (torchft, hivemind), side by side.

    python -m ripples.bench.fault                                   # ~15 min here
    python -m ripples.bench.fault --systems ripples-smart,torchft --workers 4 --steps 200

Every system trains the bench's task (same model, seed, shards, batch, one torch thread
per process) for a fixed budget of steps per worker, homogeneous. Once the workers' mean
step reaches `--at` x the budget, the last worker is SIGKILLed (a peer worker with its
process group: hivemind's p2pd daemons die with it, as on a lost host) and a replacement
of the same rank is started. Each system gets the same failure-detection timeout
(`--detect-seconds`): Ripples' lease, torchft's collective and heartbeat timeouts,
hivemind's averaging timeout.

Reported per system:
- the survivors' stall: the longest time one of the run's other workers went without
  completing a step, over the steps after the kill (their normal step time included;
  the median step before the kill and the longest one are printed beside it);
- the replacement's first step: from the kill, and from the replacement's process start
  (imports, joining, fetching the model: it contributes from then on).

Ripples runs are `ripples chaos` trials with a fixed plan (bench/chaos.py: a real
coordinator, `ripples worker run` processes, SIGKILL; its status polls every 0.2 s
time the steps). Peer runs are `ripples.bench.peers.launch` runs with a `PeerFault`
(their step logs time the steps exactly). Writes OUTPUT/fault.json and prints a
Markdown table; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ripples.bench.peers import PEERS, missing_package

RIPPLES_SYSTEMS = ("ripples-smart", "ripples-random", "adpsgd")
"""Ripples' elastic protocols (a replacement heals from a live peer)."""
DEFAULT_SYSTEMS = ("ripples-smart", "torchft", "hivemind-local", "hivemind-sync")


@dataclass(kw_only=True)
class FaultConfig:
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    workers: int = 8
    task: str = "synthetic-cnn"
    batch_size: int = 16
    steps: int = 300
    """Per-worker step budget."""
    at: float = 0.3
    detect_seconds: float = 5.0
    repeats: int = 1
    seed: int = 0
    output: Path = Path("runs/bench-fault")
    timeout_seconds: float = 900.0
    """One system's run; a longer one fails with the folder of its logs."""

    def validate(self) -> None:
        unknown = [s for s in self.systems if s not in RIPPLES_SYSTEMS and s not in PEERS]
        if unknown or not self.systems:
            raise ValueError(f"unknown system(s) {', '.join(unknown) or '(none)'}; choose "
                             f"from {', '.join((*RIPPLES_SYSTEMS, *PEERS))}")
        if self.workers < 3:
            raise ValueError("the fault scenario needs at least 3 workers (2 survivors)")
        if not 0 < self.at < 1:
            raise ValueError(f"--at is a fraction of the budget in (0, 1), not {self.at}")
        if self.steps < 20 or self.detect_seconds <= 0 or self.repeats < 1:
            raise ValueError("--steps must be >= 20, --detect-seconds > 0, --repeats >= 1")


@dataclass(kw_only=True)
class FaultResult:
    system: str
    repeat: int
    ok: bool
    error: str = ""
    step_seconds_before: float | None = None
    longest_before_seconds: float | None = None
    stall_seconds: float | None = None
    """The survivors' stall (see the module's docstring)."""
    first_step_after_kill_seconds: float | None = None
    first_step_after_start_seconds: float | None = None
    final_accuracy: float | None = None
    """Of the average of the final models, on the task's test split (nothing was lost)."""
    directory: str = ""


def run_ripples(cfg: FaultConfig, system: str, repeat: int, out: Path) -> FaultResult:
    from ripples.bench.chaos_config import ChaosConfig
    from ripples.bench.chaos_trial import Trial

    chaos = ChaosConfig(workers=cfg.workers, iterations=cfg.steps,
                        lease_seconds=cfg.detect_seconds, faults=("sigkill",),
                        faults_per_trial=1, min_accuracy=0.0,
                        deadline_seconds=cfg.timeout_seconds, task=cfg.task, protocol=system,
                        checkpoint_every=0, batch_size=cfg.batch_size, fault_at=cfg.at,
                        replace_after=0.0)
    out.mkdir(parents=True, exist_ok=True)
    trial = Trial(chaos, repeat, cfg.seed + repeat, out).run()
    fault = trial.faults[0] if trial.faults else None
    result = FaultResult(system=system, repeat=repeat, ok=trial.ok and fault is not None,
                         error="\n".join(trial.failures), directory=str(out),
                         step_seconds_before=trial.step_seconds_before_fault,
                         longest_before_seconds=trial.longest_step_before_fault_seconds,
                         stall_seconds=trial.stall_after_fault_seconds if fault else None)
    if fault is not None:
        first = fault.first_step_seconds
        result.first_step_after_kill_seconds = first
        if first is not None and fault.replacement_at_seconds is not None:
            result.first_step_after_start_seconds = (
                fault.at_seconds + first - fault.replacement_at_seconds)
    result.final_accuracy = trial.accuracy
    return result


def run_peer_fault(cfg: FaultConfig, peer: str, repeat: int, out: Path) -> FaultResult:
    from ripples.bench.peers.launch import PeerFault, PeerRunConfig, run_peer

    detect = cfg.detect_seconds
    settings: dict[str, object] = (
        {"timeout_seconds": detect, "heartbeat_timeout_ms": int(detect * 1000)}
        if PEERS[peer].package == "torchft" else {"averaging_timeout": detect})
    try:
        summary = run_peer(PeerRunConfig(
            peer=peer, workload=cfg.task, num_workers=cfg.workers, seed=cfg.seed + repeat,
            batch_size=cfg.batch_size, max_steps=cfg.steps, target_loss=0.0,
            settings=settings, output=out, timeout_seconds=cfg.timeout_seconds,
            fault=PeerFault(at=cfg.at)))
    except (RuntimeError, TimeoutError) as err:
        return FaultResult(system=peer, repeat=repeat, ok=False, error=str(err),
                           directory=str(out))
    fault = summary["fault"]
    assert isinstance(fault, dict)
    accuracy = summary.get("final_accuracy")
    return FaultResult(
        system=peer, repeat=repeat, ok=True, directory=str(out),
        step_seconds_before=fault["step_seconds_before"],
        longest_before_seconds=fault["longest_before_seconds"],
        stall_seconds=fault["stall_seconds"],
        first_step_after_kill_seconds=fault["replacement_first_step_seconds"],
        first_step_after_start_seconds=fault["replacement_first_step_after_start_seconds"],
        final_accuracy=float(accuracy) if isinstance(accuracy, (int, float)) else None)


def run_all(cfg: FaultConfig) -> list[FaultResult]:
    """Every system's fault runs, repeats interleaved; prints one line per run."""
    results = []
    plan = [(r, s) for r in range(cfg.repeats) for s in cfg.systems]
    for i, (repeat, system) in enumerate(plan, 1):
        out = cfg.output / "runs" / f"{system}-{repeat}"
        print(f"[{i}/{len(plan)}] {system} (repeat {repeat})", file=sys.stderr, flush=True)
        result = (run_ripples(cfg, system, repeat, out) if system in RIPPLES_SYSTEMS
                  else run_peer_fault(cfg, system, repeat, out))
        print("    " + (f"stall {_s(result.stall_seconds)}, replacement's first step "
                        f"{_s(result.first_step_after_kill_seconds)} after the kill"
                        if result.ok else f"FAILED: {result.error.splitlines()[0:1]} "
                                          f"(logs: {out})"), file=sys.stderr, flush=True)
        results.append(result)
    return results


def _s(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f} s"


def format_markdown(results: list[FaultResult]) -> str:
    lines = ["| system | survivors' median step before | longest step before | survivors' "
             "stall after the kill | replacement's first step, from the kill | from its "
             "start | final accuracy |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.system} | failed: {r.error.splitlines()[0] if r.error else '?'} "
                         "| | | | | |")
            continue
        lines.append(f"| {r.system} | {_s(r.step_seconds_before)} | "
                     f"{_s(r.longest_before_seconds)} | **{_s(r.stall_seconds)}** | "
                     f"{_s(r.first_step_after_kill_seconds)} | "
                     f"{_s(r.first_step_after_start_seconds)} | "
                     f"{'-' if r.final_accuracy is None else f'{r.final_accuracy:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = FaultConfig()
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.fault",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(defaults.systems),
                        help="comma-separated: Ripples protocols "
                             f"({', '.join(RIPPLES_SYSTEMS)}) and peers ({', '.join(PEERS)}); "
                             "a peer whose package is missing is skipped")
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--task", default=defaults.task)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="per-worker step budget")
    parser.add_argument("--at", type=float, default=defaults.at,
                        help="the kill, as a fraction of the budget")
    parser.add_argument("--detect-seconds", type=float, default=defaults.detect_seconds,
                        help="every system's failure-detection timeout")
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", type=Path, default=defaults.output)
    parser.add_argument("--timeout-seconds", type=float, default=defaults.timeout_seconds,
                        help="one system's run")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    skipped = [s for s in systems if s in PEERS and missing_package(s)]
    for peer in skipped:
        print(f"skipping {peer}: its package {missing_package(peer)!r} is not installed "
              "(pip install 'ripples[peers]')", file=sys.stderr)
    cfg = FaultConfig(systems=tuple(s for s in systems if s not in skipped),
                      workers=args.workers, task=args.task, batch_size=args.batch_size,
                      steps=args.steps, at=args.at, detect_seconds=args.detect_seconds,
                      repeats=args.repeats, seed=args.seed, output=args.output,
                      timeout_seconds=args.timeout_seconds)
    try:
        cfg.validate()
    except ValueError as err:
        parser.error(str(err))
    results = run_all(cfg)
    cfg.output.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    (cfg.output / "fault.json").write_text(json.dumps(
        {"config": config, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    print(format_markdown(results))
    print(f"\nresults: {cfg.output / 'fault.json'}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
