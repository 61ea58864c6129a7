"""The peers' tuning sweep: each peer's knobs tried one at a time around its defaults, on
the bench's task and scenarios, to report every peer at its best setting rather than at
its package's defaults.

    python -m ripples.bench.peers.sweep                      # every installed peer
    python -m ripples.bench.peers.sweep --peers torchft --scenarios homogeneous

For each peer, every value of every knob in `PEERS[peer].sweep` is one setting (the other
knobs at their defaults); each setting runs once per scenario, settings interleaved
within a scenario. The best setting of a peer is the one with the smallest geometric
mean of its times to target over the scenarios (a run that misses the target counts as
its full wall time, doubled). Writes OUTPUT/sweep.json and prints a table and each peer's
best setting; docs/benchmarks.md records them, and PEERS' defaults are set to them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

from ripples.bench.bench_run import RunRecord, run_one
from ripples.bench.matrix import HarnessConfig, config_dict
from ripples.bench.peers import PEERS, missing_package
from ripples.sim.scenarios import SCENARIOS

SWEEP_SCENARIOS = ("homogeneous", "slow-5x")


def settings_of(peer: str) -> list[dict[str, object]]:
    """The settings a sweep tries for `peer`: its defaults, then one knob changed at a time."""
    spec = PEERS[peer]
    out: list[dict[str, object]] = [{}]
    for knob, values in spec.sweep.items():
        out += [{knob: v} for v in values if v != spec.defaults.get(knob)]
    return out


def label(setting: dict[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "defaults"


def score(records: list[RunRecord]) -> float:
    """Geometric mean of the times to target (a miss: twice its wall time)."""
    times = [r.time_to_target_seconds or 2 * r.wall_seconds for r in records]
    return math.exp(sum(math.log(max(t, 1e-9)) for t in times) / len(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.peers.sweep",
                                     description=__doc__.split("\n\n")[0])
    defaults = HarnessConfig()
    parser.add_argument("--peers", help=f"comma-separated (default: the installed ones of "
                                        f"{', '.join(PEERS)})")
    parser.add_argument("--scenarios", default=",".join(SWEEP_SCENARIOS))
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--task", default=defaults.task)
    parser.add_argument("--target-loss", type=float, default=defaults.target_loss)
    parser.add_argument("--max-epochs", type=float, default=defaults.max_epochs)
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", type=Path, default=Path("runs/peer-sweep"))
    args = parser.parse_args(argv)
    peers = ([p for p in args.peers.split(",") if p] if args.peers
             else [p for p in PEERS if not missing_package(p)])
    scenarios = [s for s in args.scenarios.split(",") if s]
    base = replace(defaults, workers=args.workers, task=args.task,
                   target_loss=args.target_loss, max_epochs=args.max_epochs,
                   max_steps=args.max_steps, seed=args.seed, repeats=1,
                   scenarios=tuple(scenarios), protocols=tuple(peers))
    try:
        base.validate()
    except ValueError as err:
        parser.error(str(err))
    plan = [(peer, setting) for peer in peers for setting in settings_of(peer)]
    results: dict[tuple[str, str], list[RunRecord]] = {}
    done = 0
    for scenario in scenarios:
        for peer, setting in plan:
            done += 1
            print(f"[{done}/{len(plan) * len(scenarios)}] {scenario} {peer} {label(setting)}",
                  file=sys.stderr, flush=True)
            cfg = replace(base, peer_settings={peer: setting},
                          output=args.output / f"{peer}-{label(setting)}")
            rec = run_one(cfg, SCENARIOS[scenario], peer, 0)
            ttt = rec.time_to_target_seconds
            print(f"    target {f'{ttt:.1f} s' if ttt else 'not reached'}, "
                  f"{rec.samples_per_second or 0:.0f} samples/s", file=sys.stderr, flush=True)
            results.setdefault((peer, label(setting)), []).append(rec)
    scored = {key: score(records) for key, records in results.items()}
    best: dict[str, str] = {}
    for (peer, name), value in scored.items():
        if peer not in best or value < scored[(peer, best[peer])]:
            best[peer] = name
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "sweep.json").write_text(json.dumps(
        {"config": config_dict(base), "best": best,
         "rows": [{"peer": peer, "setting": name, "score_seconds": scored[(peer, name)],
                   "runs": [asdict(r) for r in records]}
                  for (peer, name), records in results.items()]}, indent=2) + "\n")
    print(f"| peer | setting | {' | '.join(f'{s}: to target' for s in scenarios)} | "
          f"{' | '.join(f'{s}: samples/s' for s in scenarios)} | geometric mean |")
    print("|---|---|" + "---:|" * (2 * len(scenarios) + 1))
    for (peer, name), records in results.items():
        times = [f"{r.time_to_target_seconds:.1f} s" if r.time_to_target_seconds
                 else "not reached" for r in records]
        rate = [f"{r.samples_per_second or 0:.0f}" for r in records]
        mark = " **(best)**" if best[peer] == name else ""
        print(f"| {peer} | {name}{mark} | {' | '.join(times)} | {' | '.join(rate)} | "
              f"{scored[(peer, name)]:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
