"""What a worker of several ranks costs: Ripples around a sharded FSDP2 step.

    python -m ripples.bench.sharded               # about a minute here
    python -m ripples.bench.sharded --rounds 12 --steps 10 --d-model 192

Two workers of two ranks (`ripples run --workers 2 --ranks-per-worker 2`) train the LM of
examples/transformer_lm.py (AdamW, bf16 autocast on the CPU), its blocks and the model
sharded with FSDP2 over each worker's ranks. In the same processes, rounds of `--steps`
steps alternate, the order swapping between rounds:

- **plain**: the FSDP2 step as a script without Ripples makes it (the wrapped AdamW's
  `step()`);
- **ripples**: `ripples.Optimizer.step()`, the same step with what Ripples adds on a
  worker of several ranks: the mirror of the shards (filled before the synchronisation,
  written back after one that changed it), the non-finite gate, the progress counters,
  and rank 0's verdict handed to the other rank after every step.

The run has local steps longer than the bench, so no group forms: averaging is not what
is measured (its cost is the P-Reduce's, `python -m ripples.bench.preduce`). The overhead
is the median over rounds and ranks of (ripples round time / plain round time) - 1; goal:
at most 5%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL = 0.05
"""Ripples' overhead on a sharded worker's step, at most (a fraction of the plain step)."""


def _worker(args: argparse.Namespace) -> None:
    """One rank: interleaved rounds of plain and Ripples steps; rank 0 of worker 0 and
    rank 1 of worker 1 write theirs."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn import functional

    import ripples
    from ripples.examples import transformer_lm as lm

    worker = ripples.init()
    model_args = lm.build_parser().parse_args(["--d-model", str(args.d_model), "--layers",
                                               str(args.layers)])
    model = lm.build_model(model_args)
    for block in model.blocks:
        fully_shard(block, mesh=worker.mesh)
    fully_shard(model, mesh=worker.mesh)
    opt = ripples.Optimizer(lm.build_adamw(model, model_args), model)
    generator = torch.Generator().manual_seed(worker.rank * 10 + worker.rank_in_worker)
    tokens = torch.randint(0, lm.VOCAB_SIZE, (args.batch_size, 129), generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step(optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step(opt)
    times: dict[str, list[float]] = {"plain": [], "ripples": []}
    for round_index in range(args.rounds):
        order = ("plain", "ripples") if round_index % 2 == 0 else ("ripples", "plain")
        for kind in order:
            optimizer = opt.optimizer if kind == "plain" else opt
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(optimizer)
            times[kind].append((time.perf_counter() - t0) / args.steps)
    if worker.rank_in_worker == worker.rank:  # one rank of each worker
        out = Path(args.worker) / f"rank{worker.rank}-{worker.rank_in_worker}.json"
        out.write_text(json.dumps({**times, "step_times": vars(opt.step_times)}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    total = args.warmup + 2 * args.rounds * args.steps
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "ripples.cli", "run", "--workers", "2",
                   "--ranks-per-worker", "2", "--protocol", "ripples-smart",
                   "--local-steps", str(10 * total), "--output", str(Path(tmp) / "run"),
                   "--quiet", "--", sys.executable, "-m", "ripples.bench.sharded",
                   "--worker", tmp, *(argv or sys.argv[1:])]
        print(f"two workers of two ranks, rounds of {args.steps} steps, plain and ripples "
              f"interleaved ({args.rounds} rounds each) ...", flush=True)
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"the run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    ratios = [r / p for times in results
              for p, r in zip(times["plain"], times["ripples"], strict=True)]
    plain = statistics.median(t for times in results for t in times["plain"])
    wrapped = statistics.median(t for times in results for t in times["ripples"])
    overhead = statistics.median(ratios) - 1
    low, _, high = statistics.quantiles(ratios, n=4)
    print(f"plain FSDP2 step   {plain * 1e3:8.1f} ms (median)")
    print(f"ripples.Optimizer  {wrapped * 1e3:8.1f} ms (median)")
    for times in results:  # where ripples.Optimizer.step() spent its time, per step
        t = times["step_times"]
        print(f"  a rank's opt.step(): wrapped step {t['local_seconds'] / t['steps'] * 1e3:.1f} "
              f"ms, sync {t['sync_seconds'] / t['steps'] * 1e3:.2f} ms, the rest "
              f"{t['other_seconds'] / t['steps'] * 1e3:.2f} ms")
    print(f"overhead {overhead:+.1%} (median of {len(ratios)} same-round ratios; quartiles "
          f"{low - 1:+.1%} .. {high - 1:+.1%}); goal <= {GOAL:.0%}: "
          f"{'met' if overhead <= GOAL else 'missed'}")


if __name__ == "__main__":
    main()
