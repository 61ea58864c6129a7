"""What library mode costs: `ripples.Optimizer` against the plain PyTorch loop.

    python -m ripples.bench.library                 # both parts (about 4 minutes here)
    python -m ripples.bench.library --part single   # single-process ratio only
    python -m ripples.bench.library --part checkpoint   # what checkpoints cost

1. **Single process.** The same synthetic-cnn loop (ResNet-20, batch 16, SGD with
   momentum, data already in memory) timed in plain PyTorch and through
   `ripples.Optimizer` in single-process mode, interleaved: rounds of `--steps` steps, the
   order alternating between rounds; the ratio is the median of same-round ratios of the
   time per step (goal: <= 1.02x).
2. **Distributed.** `ripples run --workers 4 --protocol ripples-smart --task
   synthetic-cnn` (the built-in runner, a user of the same API); every worker records where
   its `opt.step()` spent time (`step_times`: the local step, the synchronisation it
   waited for and ran, and the rest: Ripples' own bookkeeping). Reported as fractions of
   an iteration (goal: the bookkeeping under 3%).
3. **Checkpoints** (`--part checkpoint`, not in `both`). The single-process loop of part 1
   through `ripples.Optimizer`, with a `ripples.Checkpointer` saving every 20 steps, every
   500 (the default) and none, interleaved: rounds of `--checkpoint-steps` steps, the
   order rotating between rounds, each configuration going on from its own step count.
   The ratio is the median of same-round ratios of the time per step; a save every 500
   steps falls in few rounds, which the median leaves out, so the time spent inside
   `Checkpointer.step()` is reported too, as a fraction of the steps' time (the cost of
   checkpointing itself, apart from the loop's noise), with one save's time and size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ripples.worker.checkpoint import Checkpointer
from ripples.worker.tasks import Task, TaskOptions, build_task


@dataclass(kw_only=True)
class SingleResult:
    plain_ms: float
    wrapped_ms: float
    ratio: float
    ratio_quartiles: tuple[float, float]


@dataclass
class _TimedCheckpoints:
    """A Checkpointer whose step() calls are timed: what checkpointing itself costs, apart
    from the loop's noise."""

    checkpointer: Checkpointer
    seconds: float = 0.0
    saves: int = 0

    def step(self) -> None:
        t0 = time.perf_counter()
        saved = self.checkpointer.step()
        self.seconds += time.perf_counter() - t0
        self.saves += saved is not None


def _loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor,
          torch.Tensor]], loss_fn: nn.Module, report: bool,
          checkpoints: _TimedCheckpoints | None = None) -> float:
    t0 = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if report:
            opt.report_loss(loss.detach(), num_samples=len(x))  # type: ignore[attr-defined]
        if checkpoints is not None:
            checkpoints.step()
    return (time.perf_counter() - t0) / len(batches)


def _synthetic_cnn(steps: int, batch_size: int) -> tuple[Task, list[tuple[torch.Tensor,
                                                                         torch.Tensor]]]:
    """The ResNet-20 task, and `steps` batches of its data already in memory."""
    torch.set_num_threads(1)
    task = build_task("synthetic-cnn", TaskOptions(seed=0, batch_size=batch_size))
    inputs, targets = task.train_data().tensors  # type: ignore[attr-defined]
    return task, [(inputs[i: i + batch_size], targets[i: i + batch_size])
                  for i in range(0, steps * batch_size, batch_size)]


def measure_single(rounds: int, steps: int, batch_size: int) -> SingleResult:
    import ripples
    from ripples.worker.launch_env import LaunchEnv

    task, batches = _synthetic_cnn(steps, batch_size)
    plain_model, wrapped_model = task.build_model(), task.build_model()
    plain = task.build_optimizer(plain_model)
    worker = ripples.init(env=LaunchEnv(host="bench"))
    wrapped = ripples.Optimizer(task.build_optimizer(wrapped_model), wrapped_model)
    loss_fn = task.loss_fn
    assert isinstance(loss_fn, nn.Module)
    _loop(plain_model, plain, batches[:3], loss_fn, False)  # warm-up
    _loop(wrapped_model, wrapped, batches[:3], loss_fn, True)
    plain_times: list[float] = []
    wrapped_times: list[float] = []
    for r in range(rounds):
        runs = [("plain", plain_model, plain, False), ("wrapped", wrapped_model, wrapped, True)]
        for name, model, opt, report in (runs if r % 2 == 0 else runs[::-1]):
            seconds = _loop(model, opt, batches, loss_fn, report)
            (plain_times if name == "plain" else wrapped_times).append(seconds)
        print(f"  round {r + 1}/{rounds}: plain {plain_times[-1] * 1e3:.1f} ms/step, "
              f"ripples.Optimizer {wrapped_times[-1] * 1e3:.1f} ms/step", file=sys.stderr,
              flush=True)
    worker.shutdown()
    ratios = sorted(w / p for w, p in zip(wrapped_times, plain_times, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return SingleResult(plain_ms=statistics.median(plain_times) * 1e3,
                        wrapped_ms=statistics.median(wrapped_times) * 1e3,
                        ratio=statistics.median(ratios), ratio_quartiles=(q[0], q[2]))


@dataclass(kw_only=True)
class CheckpointResult:
    step_ms: float
    """Time per step without checkpoints."""
    ratios: dict[int, float]
    """Checkpoint interval (steps) -> time per step with it / without: the median of
    same-round ratios."""
    fractions: dict[int, float]
    """Checkpoint interval -> time inside Checkpointer.step() / the steps' time without."""
    saves: dict[int, int]
    """Checkpoint interval -> checkpoints written during the rounds."""
    save_ms: float
    """One save inside the loop (mean over every interval's saves)."""
    megabytes: float
    """One checkpoint file."""


def measure_checkpoint(rounds: int, steps: int, batch_size: int,
                       intervals: tuple[int, ...] = (20, 500)) -> CheckpointResult:
    import ripples
    from ripples.worker.launch_env import LaunchEnv

    task, batches = _synthetic_cnn(steps, batch_size)
    worker = ripples.init(env=LaunchEnv(host="bench"))
    model = task.build_model()
    opt = ripples.Optimizer(task.build_optimizer(model), model)
    loss_fn = task.loss_fn
    assert isinstance(loss_fn, nn.Module)
    with tempfile.TemporaryDirectory(prefix="ripples-bench-checkpoint-") as tmp:
        configs: list[tuple[int, _TimedCheckpoints | None]] = [(0, None)] + [
            (n, _TimedCheckpoints(ripples.Checkpointer(opt, directory=Path(tmp) / str(n),
                                                       every=n, keep=2)))
            for n in intervals]
        _loop(model, opt, batches[:3], loss_fn, True)  # warm-up
        reached = {n: 0 for n, _ in configs}  # each configuration's own step count
        times: dict[int, list[float]] = {n: [] for n, _ in configs}
        for r in range(rounds):
            shift = r % len(configs)
            for n, checkpoints in configs[shift:] + configs[:shift]:
                opt.local_step = reached[n]
                times[n].append(_loop(model, opt, batches, loss_fn, True, checkpoints))
                reached[n] = opt.local_step
            print(f"  round {r + 1}/{rounds}: "
                  + ", ".join(f"{'none' if n == 0 else f'every {n}'} "
                              f"{times[n][-1] * 1e3:.1f} ms/step" for n, _ in configs),
                  file=sys.stderr, flush=True)
        timed = {n: c for n, c in configs if c is not None}
        megabytes = next(Path(tmp).rglob("step-*.pt")).stat().st_size / 1e6
    worker.shutdown()
    steps_seconds = sum(times[0]) * steps  # every configuration's steps, without
    saves = sum(c.saves for c in timed.values())
    return CheckpointResult(
        step_ms=statistics.median(times[0]) * 1e3,
        ratios={n: statistics.median(w / p for w, p in zip(times[n], times[0], strict=True))
                for n in intervals},
        fractions={n: c.seconds / steps_seconds for n, c in timed.items()},
        saves={n: c.saves for n, c in timed.items()},
        save_ms=sum(c.seconds for c in timed.values()) / max(1, saves) * 1e3,
        megabytes=megabytes)


@dataclass(kw_only=True)
class DistributedResult:
    iteration_ms: float
    local_fraction: float
    sync_fraction: float
    other_fraction: float
    other_ms: float
    per_worker_other: list[float]


def measure_distributed(workers: int, iterations: int, batch_size: int) -> DistributedResult:
    with tempfile.TemporaryDirectory(prefix="ripples-bench-library-") as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "ripples.cli", "run", "--quiet", "--device", "cpu",
               "--workers", str(workers),
               "--protocol", "ripples-smart", "--task", "synthetic-cnn", "--batch-size",
               str(batch_size), "--iterations", str(iterations), "--output", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        records = [json.loads((out / "workers" / f"rank{r}.json").read_text())
                   for r in range(workers)]
        summary = json.loads((out / "summary.json").read_text())
    iteration = summary["wall_seconds"] / (sum(w["iterations"] for w in summary["workers"])
                                           / workers)
    times = [r["step_times"] for r in records]
    steps = sum(t["steps"] for t in times)

    def per_iteration(key: str) -> float:
        return sum(t[key] for t in times) / steps

    return DistributedResult(
        iteration_ms=iteration * 1e3,
        local_fraction=per_iteration("local_seconds") / iteration,
        sync_fraction=per_iteration("sync_seconds") / iteration,
        other_fraction=per_iteration("other_seconds") / iteration,
        other_ms=per_iteration("other_seconds") * 1e3,
        per_worker_other=[t["other_seconds"] / t["steps"] / iteration for t in times])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.library",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("single", "distributed", "both", "checkpoint"),
                        default="both")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20, help="steps per round (single)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=150,
                        help="iterations per worker (distributed)")
    parser.add_argument("--checkpoint-steps", type=int, default=50,
                        help="steps per round and configuration (checkpoint)")
    args = parser.parse_args(argv)
    if args.part in ("single", "both"):
        print("single process: plain PyTorch vs ripples.Optimizer (synthetic-cnn)",
              file=sys.stderr)
        s = measure_single(args.rounds, args.steps, args.batch_size)
        print(f"single process, ResNet-20 batch {args.batch_size}: plain {s.plain_ms:.1f} "
              f"ms/step, ripples.Optimizer {s.wrapped_ms:.1f} ms/step, ratio "
              f"{s.ratio:.3f}x (quartiles {s.ratio_quartiles[0]:.3f}-"
              f"{s.ratio_quartiles[1]:.3f}, {args.rounds} interleaved rounds)")
    if args.part in ("distributed", "both"):
        print(f"distributed: ripples-smart, {args.workers} workers, {args.iterations} "
              "iterations each", file=sys.stderr)
        d = measure_distributed(args.workers, args.iterations, args.batch_size)
        print(f"ripples-smart, {args.workers} workers: {d.iteration_ms:.1f} ms/iteration; in "
              f"opt.step(): local step {d.local_fraction:.1%}, synchronisation "
              f"{d.sync_fraction:.1%}, Ripples' own bookkeeping {d.other_fraction:.2%} "
              f"({d.other_ms:.2f} ms; per worker "
              f"{', '.join(f'{f:.2%}' for f in d.per_worker_other)})")
    if args.part == "checkpoint":
        print("checkpoints: ripples.Optimizer with a Checkpointer every 20 and 500 steps vs "
              "none (synthetic-cnn)", file=sys.stderr)
        c = measure_checkpoint(args.rounds, args.checkpoint_steps, args.batch_size)
        print(f"checkpoints, ResNet-20 batch {args.batch_size}: {c.step_ms:.1f} ms/step "
              "without; " + "; ".join(
                  f"every {n} steps: time per step {c.ratios[n]:.3f}x, inside "
                  f"Checkpointer.step() {c.fractions[n]:.2%} ({c.saves[n]} saves)"
                  for n in c.ratios)
              + f"; one save {c.save_ms:.1f} ms, {c.megabytes:.1f} MB ({args.rounds} "
              f"interleaved rounds of {args.checkpoint_steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
